"""Admission: every rejection's status code, reason, named field and message; the check order; and
what an admitted request resolves to."""

from __future__ import annotations

import copy
import math
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc
import pytest

from coordinator.admission import DEFAULT_MAX_TOKENS, Admission, AdmittedRequest
from coordinator.auth import Authenticator, KeyRing
from coordinator.chat import TokenizerThread
from coordinator.errors import RpcError
from coordinator.served_model import ServedModel
from splitserve.v1 import serving_pb2 as pb
from splitserve.wire import unpack_ids

INVALID, KEY = grpc.StatusCode.INVALID_ARGUMENT, [("authorization", "Bearer sesame")]


@pytest.fixture
async def admission(served_model: ServedModel) -> AsyncIterator[Admission]:
    tokenizer = TokenizerThread(served_model.tokenizer)
    auth = Authenticator(KeyRing.parse(["sesame"]))
    yield Admission(served_model, tokenizer, auth=auth, max_request_bytes=4096)
    tokenizer.close()


async def rejected(call: Awaitable[Any]) -> RpcError:
    with pytest.raises(RpcError) as caught:
        await call
    return caught.value


def gen(**kwargs: Any) -> pb.GenerateRequest:
    if "token_ids" not in kwargs:
        kwargs.setdefault("text", "hello world")
    return pb.GenerateRequest(**kwargs)


async def test_api_key_missing_and_invalid_are_unauthenticated(admission: Admission) -> None:
    missing = await rejected(admission.admit_generate(gen(), [], None))
    assert (missing.code, missing.reason) == (grpc.StatusCode.UNAUTHENTICATED, "API_KEY_MISSING")
    assert "authorization: Bearer" in missing.message
    wrong = await rejected(admission.admit_generate(gen(), [("authorization", "Bearer nope")], None))
    assert (wrong.code, wrong.reason) == (grpc.StatusCode.UNAUTHENTICATED, "API_KEY_INVALID")
    assert isinstance(await admission.admit_generate(gen(), KEY, None), AdmittedRequest)


async def test_unknown_model_is_not_found_and_names_the_served_one(admission: Admission) -> None:
    err = await rejected(admission.admit_generate(gen(model="gpt-9"), KEY, None))
    assert (err.code, err.reason, err.metadata) == (
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        {"model": "gpt-9"},
    )
    assert "'tiny'" in err.message


@pytest.mark.parametrize(
    ("sampling", "stopping", "output", "field", "words"),
    [
        ({"temperature": math.nan}, {}, {}, "sampling.temperature", "finite number in [0.0, 100.0]"),
        ({"temperature": -0.5}, {}, {}, "sampling.temperature", "got -0.5"),
        ({"top_p": 0.0}, {}, {}, "sampling.top_p", "(0.0, 1.0]"),
        ({"top_k": -2}, {}, {}, "sampling.top_k", "top_k must be"),
        ({"presence_penalty": 3.0}, {}, {}, "sampling.presence_penalty", "[-2.0, 2.0]"),
        ({"repetition_penalty": math.inf}, {}, {}, "sampling.repetition_penalty", "got inf"),
        ({"seed": 2**63}, {}, {}, "sampling.seed", "[0, 2**63)"),
        ({}, {"max_tokens": 0}, {}, "stopping.max_tokens", "at least 1"),
        ({}, {"max_tokens": 4, "min_tokens": 5}, {}, "stopping.min_tokens", "between 0 and max_tokens (4)"),
        ({}, {"stop": [f"s{i}" for i in range(17)]}, {}, "stopping.stop", "at most 16 stop strings"),
        ({}, {"stop": ["ok", "x" * 257]}, {}, "stopping.stop[1]", "1 to 256 characters, got 257"),
        ({}, {"stop_token_ids": list(range(65))}, {}, "stopping.stop_token_ids", "at most 64"),
        ({}, {"stop_token_ids": [5, 10**6]}, {}, "stopping.stop_token_ids[1]", "vocabulary has 1024"),
        ({}, {}, {"logprobs": 21}, "output.logprobs", "between 0 and 20"),
    ],
)
async def test_out_of_range_parameters_name_the_field(
    admission: Admission,
    sampling: dict[str, Any],
    stopping: dict[str, Any],
    output: dict[str, Any],
    field: str,
    words: str,
) -> None:
    request = gen(
        sampling=pb.SamplingParams(**sampling),
        stopping=pb.StoppingCriteria(**stopping),
        output=pb.OutputOptions(**output),
    )
    err = await rejected(admission.admit_generate(request, KEY, None))
    assert (err.code, err.reason, err.field) == (INVALID, "INVALID_PARAMETER", field)
    assert words in err.message
    assert err.status_proto().details[1].type_url.endswith("google.rpc.BadRequest")


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.GenerateRequest(text=""), "text"),
        (pb.GenerateRequest(), "text"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "token_ids"),
    ],
)
async def test_empty_prompt_is_invalid_argument(
    admission: Admission, request_: pb.GenerateRequest, field: str
) -> None:
    err = await rejected(admission.admit_generate(request_, KEY, None))
    assert (err.code, err.reason, err.field) == (INVALID, "EMPTY_PROMPT", field)
    chat = await rejected(admission.admit_chat(pb.ChatRequest(), KEY, None))
    assert (chat.code, chat.reason, chat.field) == (INVALID, "EMPTY_PROMPT", "messages")


async def test_token_ids_and_request_ids_are_checked(admission: Admission) -> None:
    bad_id = await rejected(admission.admit_generate(gen(token_ids=pb.TokenIds(ids=[1, 1024])), KEY, None))
    assert (bad_id.reason, bad_id.field) == ("INVALID_PARAMETER", "token_ids.ids[1]")
    for request_id in ("x" * 129, "tab\there", "é"):
        err = await rejected(admission.admit_generate(gen(request_id=request_id), KEY, None))
        assert (err.reason, err.field) == ("INVALID_PARAMETER", "request_id")


async def test_oversized_request_names_its_size_and_the_limit(admission: Admission) -> None:
    request = gen(text="a" * 5000)
    err = await rejected(admission.admit_generate(request, KEY, None))
    assert (err.code, err.reason) == (INVALID, "REQUEST_TOO_LARGE")
    assert err.metadata == {"request_bytes": str(request.ByteSize()), "limit_bytes": "4096"}


async def test_prompt_over_the_context_and_prompt_plus_max_tokens_over_it(admission: Admission) -> None:
    context = admission.model.context_length
    too_long = await rejected(
        admission.admit_generate(gen(token_ids=pb.TokenIds(ids=[5] * context)), KEY, None)
    )
    assert (too_long.reason, too_long.field) == ("PROMPT_TOO_LONG", "token_ids")
    assert too_long.metadata == {"prompt_tokens": str(context), "context_length": str(context)}
    request = gen(token_ids=pb.TokenIds(ids=[5] * 100), stopping=pb.StoppingCriteria(max_tokens=context))
    err = await rejected(admission.admit_generate(request, KEY, None))
    assert (err.code, err.reason, err.field) == (INVALID, "CONTEXT_LENGTH_EXCEEDED", "stopping.max_tokens")
    assert f"prompt tokens (100) + max_tokens ({context})" in err.message
    assert f"at most {context - 100}" in err.message
    # unset max_tokens is lowered to what the context leaves instead
    near_full = gen(token_ids=pb.TokenIds(ids=[5] * (context - 10)))
    assert (await admission.admit_generate(near_full, KEY, None)).params.max_tokens == 10


async def test_chat_template_failure_is_invalid_argument_with_the_templates_message(
    served_model: ServedModel,
) -> None:
    tokenizer = copy.deepcopy(served_model.tokenizer)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    thread = TokenizerThread(tokenizer)
    try:
        admission = Admission(served_model, thread)
        chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")])
        err = await rejected(admission.admit_chat(chat, [], None))
    finally:
        thread.close()
    assert (err.code, err.reason, err.field) == (INVALID, "CHAT_TEMPLATE_FAILED", "messages")
    assert "roles must alternate" in err.message


async def test_checks_run_in_the_documented_order(admission: Admission) -> None:
    nan = pb.SamplingParams(temperature=math.nan)
    everything_wrong = gen(model="other", sampling=nan, text="a" * 5000)
    assert (await rejected(admission.admit_generate(everything_wrong, [], None))).reason == "API_KEY_MISSING"
    assert (await rejected(admission.admit_generate(everything_wrong, KEY, None))).reason == "MODEL_NOT_FOUND"
    no_model = gen(sampling=nan, text="a" * 5000)
    assert (await rejected(admission.admit_generate(no_model, KEY, None))).reason == "INVALID_PARAMETER"
    too_big_and_too_long = gen(token_ids=pb.TokenIds(ids=[5] * 5000))
    assert (
        await rejected(admission.admit_generate(too_big_and_too_long, KEY, None))
    ).reason == "REQUEST_TOO_LARGE"


async def test_admitted_generate_resolves_defaults_and_draws_a_seed(admission: Admission) -> None:
    admitted = await admission.admit_generate(gen(request_id="abc", priority=3), KEY, 2.0)
    ids = admission.model.tokenizer.encode("hello world")
    assert admitted.prompt_token_ids == ids and admitted.request_id == "abc" and admitted.priority == 3
    assert admitted.params.max_tokens == DEFAULT_MAX_TOKENS and admitted.params.temperature == 1.0
    assert admitted.params.seed is not None and admitted.deadline_unix_ns > 0
    other = await admission.admit_generate(gen(), KEY, None)
    assert (
        other.params.seed != admitted.params.seed
        and len(other.request_id) == 32
        and other.deadline_unix_ns == 0
    )
    req = admitted.execution_request(rid=9, generation=2, output_token_ids=[7, 8])
    assert (req.rid, req.generation, req.model, req.model_identity) == (
        9,
        2,
        "tiny",
        admission.model.identity,
    )
    assert unpack_ids(req.prompt_token_ids) == ids and unpack_ids(req.output_token_ids) == [7, 8]
    assert req.sampling.seed == admitted.params.seed and req.stopping.max_tokens == DEFAULT_MAX_TOKENS
    assert not req.HasField("logprobs")


async def test_chat_renders_the_template_without_adding_special_tokens_twice(admission: Admission) -> None:
    chat = pb.ChatRequest(
        messages=[
            pb.ChatMessage(role="system", content="Be brief."),
            pb.ChatMessage(role="user", content="Hi"),
        ],
        stopping=pb.StoppingCriteria(max_tokens=5, stop=["\n"]),
        sampling=pb.SamplingParams(seed=42, top_k=-1),
    )
    admitted = await admission.admit_chat(chat, KEY, None)
    tokenizer = admission.model.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert admitted.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert admitted.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    assert admitted.params.seed == 42 and admitted.params.stop == ["\n"]
    assert admitted.execution_request(1, 0).sampling.top_k == 0  # -1 and 0 both mean disabled


async def test_a_door_that_already_authenticated_passes_the_principal_and_is_not_checked_again(
    admission: Admission,
) -> None:
    """The HTTP door checks the key before it reads the body and hands admission the principal."""
    caller = admission.authenticate(KEY)
    admitted = await admission.admit_generate(gen(), [], None, caller)
    assert admitted.principal == caller
    chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    assert (await admission.admit_chat(chat, [], None, caller)).principal == caller
