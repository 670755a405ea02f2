"""OpenAI bodies -> the protobuf requests admission checks (the field mapping of docs/http.md)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from coordinator.errors import RpcError
from coordinator.http.errors import http_status, openai_param
from coordinator.http.schema import COMPLETIONS_DEFAULT_MAX_TOKENS, parse_chat, parse_completion

USER = [{"role": "user", "content": "hi"}]


def test_every_chat_knob_lands_in_its_grpc_field() -> None:
    parsed = parse_chat(
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": None},
            ],
            "max_tokens": 9,
            "max_completion_tokens": 7,
            "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
            "presence_penalty": 0.2, "frequency_penalty": 0.3, "repetition_penalty": 1.1, "seed": 42,
            "stop": "END", "stop_token_ids": [3], "min_tokens": 2, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3, "continue_final_message": True, "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False},
            "stream": True, "stream_options": {"include_usage": True}, "user": "ignored", "extra": 1,
        },
        "rid-1",
    )  # fmt: skip
    m = parsed.message
    assert m.model == "tiny" and m.request_id == "rid-1"
    assert [(x.role, x.content) for x in m.messages] == [
        ("system", "be brief"),
        ("user", "hi"),
        ("assistant", ""),
    ]
    assert m.messages[1].name == "ann"
    s = m.sampling
    assert (s.top_k, s.seed) == (5, 42)
    assert s.temperature == pytest.approx(0.5) and s.repetition_penalty == pytest.approx(1.1)
    assert m.stopping.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert list(m.stopping.stop) == ["END"] and list(m.stopping.stop_token_ids) == [3]
    assert m.stopping.min_tokens == 2 and m.stopping.ignore_eos
    assert m.output.logprobs == 3 and m.template.continue_final_message
    assert dict(m.template.kwargs) == {"enable_thinking": False}
    assert parsed.stream and parsed.include_usage and parsed.logprobs


def test_unset_knobs_stay_unset_so_admission_applies_its_defaults() -> None:
    m = parse_chat({"messages": USER}).message
    assert not m.sampling.ListFields() and not m.stopping.ListFields() and not m.output.HasField("logprobs")
    completion = parse_completion({"prompt": "hi"}).message
    assert completion.stopping.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS  # OpenAI's default


@pytest.mark.parametrize(
    ("prompt", "kind"), [("text", "text"), (["text"], "text"), ([1, 2], "token_ids"), ([[1, 2]], "token_ids")]
)
def test_completion_prompt_forms(prompt: Any, kind: str) -> None:
    assert parse_completion({"prompt": prompt}).message.WhichOneof("prompt") == kind


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER, "n": 3}, "n"),
        ({"messages": USER, "tools": []}, "tools"),
        ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "seed": -1}, "seed"),
        ({"messages": USER, "max_tokens": True}, "max_tokens"),
        ({"messages": USER, "stop": [1]}, "stop"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"content": "no role"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({}, "messages"),
    ],
)
def test_chat_shape_errors_name_the_openai_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RpcError) as caught:
        parse_chat(body)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.field == param


@pytest.mark.parametrize(
    ("body", "param"),
    [({"prompt": ["a", "b"]}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": "a", "echo": True}, "echo"),
     ({"prompt": "a", "best_of": 2}, "best_of"), ({"prompt": "a", "suffix": "z"}, "suffix")],
)  # fmt: skip
def test_completion_shape_errors(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RpcError) as caught:
        parse_completion(body)
    assert caught.value.field == param


def test_admission_paths_map_to_openai_params_and_reasons_override_codes() -> None:
    assert openai_param("sampling.top_p") == "top_p"
    assert openai_param("stopping.stop[2]") == "stop[2]"
    assert openai_param("token_ids.ids[4]") == "prompt" and openai_param("text") == "prompt"
    assert openai_param("output.logprobs", {"output.logprobs": "top_logprobs"}) == "top_logprobs"
    assert openai_param("request") is None
    too_large = RpcError(grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_TOO_LARGE", "big")
    assert http_status(too_large) == (413, "invalid_request_error")
    assert http_status(RpcError(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PARAMETER", "x"))[0] == 400
