"""Translations between control.proto messages and the engine's types, in one place.

The engine keys a sequence by a string request id; a worker uses `engine_request_id(rid, generation)`
so two generations of one rid can never be confused inside one engine.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TypeAlias

from engine.block_pool import BlockPool
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence
from splitserve import wire
from splitserve.v1 import control_pb2, serving_pb2

_SEED_MASK = (1 << 63) - 1
Finish: TypeAlias = serving_pb2.FinishReason.ValueType


def engine_request_id(rid: int, generation: int) -> str:
    return f"{rid}.{generation}"


def sampling_params(req: control_pb2.ExecutionRequest) -> SamplingParams:
    """The request's resolved sampling and stopping as `SamplingParams`; ValueError names a bad field.

    The proto seed is uint64 while the engine takes [0, 2**63): both workers fold it the same way, so
    P's first token and D's later ones still come from one seed.
    """
    s, stop = req.sampling, req.stopping
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed & _SEED_MASK,
        max_tokens=stop.max_tokens,
        min_tokens=stop.min_tokens,
        stop_token_ids=wire.unpack_ids(stop.stop_token_ids),
        ignore_eos=stop.ignore_eos,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
    )


def finish_reason(seq: Sequence, eos_token_ids: Seq[int]) -> Finish:
    """The proto FinishReason of a sequence the scheduler finished (UNSPECIFIED if it goes on)."""
    if seq.finish_reason is FinishReason.LENGTH:
        return serving_pb2.FINISH_REASON_LENGTH
    if seq.finish_reason is FinishReason.STOP:
        last = seq.token_ids[-1]
        if not seq.params.ignore_eos and last in eos_token_ids and last not in seq.params.stop_token_ids:
            return serving_pb2.FINISH_REASON_EOS_TOKEN
        return serving_pb2.FINISH_REASON_STOP_TOKEN
    return serving_pb2.FINISH_REASON_UNSPECIFIED


def tokens_message(
    rid: int,
    generation: int,
    offset: int,
    token_ids: Seq[int],
    logprobs: Seq[float] | None = None,
    top: Seq[Seq[tuple[int, float]]] = (),
    top_n: int = 0,
    finish: Finish = serving_pb2.FINISH_REASON_UNSPECIFIED,
) -> control_pb2.Tokens:
    """One `Tokens` item. `logprobs` is None when the request did not ask for them; `top[i]` holds the
    `top_n` alternatives of token i."""
    msg = control_pb2.Tokens(
        rid=rid,
        generation=generation,
        offset=offset,
        token_ids=wire.pack_ids(list(token_ids)),
        finish_reason=finish,
    )
    if logprobs is not None:
        lp = msg.logprobs
        lp.logprobs.extend(logprobs)
        lp.top_n = top_n
        if top_n:
            lp.top_token_ids = wire.pack_ids([tok for row in top for tok, _ in row[:top_n]])
            lp.top_logprobs.extend(val for row in top for _, val in row[:top_n])
    return msg


def pool_state(pool: BlockPool, *, check_integrity: bool = False) -> serving_pb2.KvPoolState:
    """KvPoolState now; with `check_integrity` the pool's `check_integrity()` result is included."""
    stats = pool.stats()
    state = serving_pb2.KvPoolState(
        total_blocks=stats["total"],
        block_size=pool.block_size,
        free_blocks=stats["free"] - stats["cached_free"],
        cached_blocks=stats["cached_free"],
        held_blocks=stats["held"],
    )
    if check_integrity:
        try:
            pool.check_integrity()
            state.integrity_ok = True
        except AssertionError as exc:
            state.integrity_ok = False
            state.integrity_error = str(exc) or "check_integrity failed"
    return state
