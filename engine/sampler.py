"""Device-side sampling: one call per step, one row of logits per sampled sequence.

Per row, in this order (all on the logits' device, vectorized across rows):

1. logprobs: `log_softmax` of the model's RAW logits (vLLM's default "raw" logprobs: before min_tokens
   masking, penalties, temperature and filters).
2. min_tokens: EOS (unless `ignore_eos`) and `stop_token_ids` get -inf while `len(output) < min_tokens`.
3. penalties: repetition (vLLM/HF: a logit of a token seen in prompt or output is divided by the penalty
   when positive, multiplied when negative), then frequency and presence (OpenAI: subtract
   `frequency * count + presence * (count > 0)`, counting output tokens only).
4. greedy rows (temperature 0) take the argmax here.
5. temperature scaling, then top-k, top-p (smallest prefix of the sorted distribution whose mass reaches
   top_p; the most likely token always stays), then min-p (drop tokens whose probability is below
   `min_p * max_prob`).
6. draw: exponential race `argmax(probs / Exp(1))`, which samples exactly from `probs`.

Seeded rows draw their noise from their own generator, reseeded every step from (seed, len(output)),
so a seeded request's tokens depend only on its seed, its position and its logits: not on the rest of
the batch, and not on where it was sampled (prefill worker, decode worker, or after a preemption).
Nothing here syncs with the host; the caller syncs once when it reads `token_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A per-request generator on `device`. The request owns it and passes it in every `SamplingBatch`;
    the sampler reseeds it each step (see `step_seed`), so it carries no state between steps."""
    return torch.Generator(device=device).manual_seed(seed)


def step_seed(seed: int, step: int) -> int:
    """The 64-bit seed of a request's noise at output position `step` (splitmix64 of seed and step)."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class SamplerOutput:
    """What one step sampled. Tensors live on the logits' device; reading them is the caller's one sync.

    `logprobs` is the chosen token's log-probability under the raw model distribution (see module doc).
    `top_ids`/`top_logprobs` ([B, k], k = the largest `logprobs` asked in the batch, sorted by descending
    log-probability, same raw distribution) are None when no row asked; rows that asked fewer read a
    prefix.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


@dataclass(slots=True)
class SamplingBatch:
    """One step's sampling inputs, one row per sampled sequence, in the logits' row order.

    Built by the scheduler each step with `build` (the tensors are precomputed there, on the device,
    with at most two host-to-device copies); read-only afterwards. Flags such as `all_greedy` are host
    booleans so the sampler can skip work without looking at device data.
    """

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_ids: list[Sequence[int]]
    output_ids: list[Sequence[int]]
    temperature: torch.Tensor  # [B] f32, 0 for greedy rows
    top_p: torch.Tensor  # [B] f32, inf where disabled (so rounding in a cumsum never trims)
    min_p: torch.Tensor  # [B] f32
    repetition: torch.Tensor  # [B] f32
    presence: torch.Tensor  # [B] f32
    frequency: torch.Tensor  # [B] f32
    top_k: torch.Tensor  # [B] i64, vocab_size where disabled
    suppress: tuple[torch.Tensor, torch.Tensor]  # (rows, token ids) masked by min_tokens
    prompt_tokens: tuple[torch.Tensor, torch.Tensor]  # (rows, ids) of rows with a repetition penalty
    output_tokens: tuple[torch.Tensor, torch.Tensor]  # (rows, ids) of rows with any penalty
    seeded: list[tuple[int, torch.Generator]]  # (row, generator reseeded for this step)
    all_greedy: bool
    any_greedy: bool
    any_unseeded: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    use_repetition: bool
    use_presence_frequency: bool
    num_logprobs: int | None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        *,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """Precompute the batch. `generators[i]` is row i's generator (on `device`) when its params carry
        a seed (None: one is made here); it is ignored for unseeded rows. `vocab_size` is the logits'
        last dimension; stop/EOS ids outside it are ignored."""
        device = torch.device(device)
        rows = range(len(params))
        sampled = [i for i in rows if not params[i].greedy]
        seeded = []
        for i in sampled:
            seed = params[i].seed
            if seed is not None:
                gen = generators[i]
                if gen is None:
                    gen = make_generator(seed, device)
                seeded.append((i, gen.manual_seed(step_seed(seed, len(output_ids[i])))))

        suppress_rows: list[int] = []
        suppress_ids: list[int] = []
        for i in rows:
            p = params[i]
            if len(output_ids[i]) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                ids = sorted(t for t in stops if t < vocab_size)
                suppress_rows += [i] * len(ids)
                suppress_ids += ids
        rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
        pen_rows = [
            i
            for i in rows
            if params[i].repetition_penalty != 1.0
            or params[i].presence_penalty != 0.0
            or params[i].frequency_penalty != 0.0
        ]
        prompt_rows, prompt_flat = _flatten(rep_rows, prompt_ids)
        output_rows, output_flat = _flatten(pen_rows, output_ids)

        floats = _to_device(
            [p.temperature for p in params]
            + [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
            + [p.min_p for p in params]
            + [p.repetition_penalty for p in params]
            + [p.presence_penalty for p in params]
            + [p.frequency_penalty for p in params],
            torch.float32,
            device,
        ).view(6, len(params))
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        int_parts = [top_k, suppress_rows, suppress_ids, prompt_rows, prompt_flat, output_rows, output_flat]
        ints = _to_device(list(chain.from_iterable(int_parts)), torch.int64, device)
        k, s_rows, s_ids, p_rows, p_ids, o_rows, o_ids = ints.split([len(x) for x in int_parts])

        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            params=list(params),
            generators=list(generators),
            prompt_ids=list(prompt_ids),
            output_ids=list(output_ids),
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition=floats[3],
            presence=floats[4],
            frequency=floats[5],
            top_k=k,
            suppress=(s_rows, s_ids),
            prompt_tokens=(p_rows, p_ids),
            output_tokens=(o_rows, o_ids),
            seeded=seeded,
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            any_unseeded=len(seeded) < len(sampled),
            use_top_k=any(top_k[i] < vocab_size for i in sampled),
            use_top_p=any(params[i].top_p < 1.0 for i in sampled),
            use_min_p=any(params[i].min_p > 0.0 for i in sampled),
            use_repetition=bool(rep_rows),
            use_presence_frequency=any(
                params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0 for i in rows
            ),
            num_logprobs=max(asked) if asked else None,
        )


class Sampler:
    """Stateless: turns one step's logits [B, V] into a `SamplerOutput` (see the module doc for the order)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits.float()
        logprobs = raw.log_softmax(dim=-1)  # one pass; logsumexp alone costs 3x as much on the CPU
        processed = penalize(raw, batch)
        tokens = processed.argmax(dim=-1) if batch.all_greedy else _sample(processed, batch)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        top_ids = top_logprobs = None
        if batch.num_logprobs is not None:
            top_logprobs, top_ids = logprobs.topk(batch.num_logprobs, dim=-1)
        return SamplerOutput(tokens, chosen, top_ids, top_logprobs)


def penalize(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 2-3 of the module doc: min_tokens masking and the three penalties. Returns `logits` itself
    when nothing applies, else a new tensor; never writes to `logits`."""
    rows, ids = batch.suppress
    if rows.numel():  # numel is host metadata: no sync
        logits = logits.index_put((rows, ids), torch.tensor(float("-inf"), device=logits.device))
    if not (batch.use_repetition or batch.use_presence_frequency):
        return logits
    out_rows, out_ids = batch.output_tokens
    counts = torch.zeros_like(logits).index_put_(
        (out_rows, out_ids), torch.ones_like(out_ids, dtype=logits.dtype), accumulate=True
    )
    if batch.use_repetition:
        seen = torch.zeros_like(logits, dtype=torch.bool).index_put_(
            batch.prompt_tokens, torch.tensor(True, device=logits.device)
        )
        seen |= counts > 0
        r = batch.repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if batch.use_presence_frequency:
        logits = logits - batch.frequency[:, None] * counts - batch.presence[:, None] * (counts > 0)
    return logits


def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 4-6: greedy rows take the argmax, the others are scaled, filtered and drawn."""
    greedy = batch.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, batch.temperature)[:, None]
    if batch.use_top_k or batch.use_top_p:
        scaled = _top_k_top_p(scaled, batch)
    probs = scaled.softmax(dim=-1)
    if batch.use_min_p:
        floor = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    tokens = _exponential_race(probs, batch)
    return torch.where(greedy, logits.argmax(dim=-1), tokens) if batch.any_greedy else tokens


def _top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k then top-p on one descending sort; filtered logits become -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if batch.use_top_k:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks >= batch.top_k[:, None], float("-inf"))
    if batch.use_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before > batch.top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_race(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exp(1) i.i.d. picks token t with probability probs[t] / sum(probs).
    Seeded rows draw E from their own generator (the one per-row loop here); the rest share one draw."""
    noise = torch.empty_like(probs)
    if batch.any_unseeded:
        noise.exponential_()
    for row, gen in batch.seeded:
        noise[row].exponential_(generator=gen)
    # An exact 0 draw would turn a filtered token's 0/0 into NaN, which argmax would pick.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _flatten(rows: list[int], seqs: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(row index per token, token ids) for the given rows, concatenated."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i in rows:
        row_ids += [i] * len(seqs[i])
        token_ids += seqs[i]
    return row_ids, token_ids


def _to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host-to-device copy; from pinned memory and asynchronous on CUDA, so the host never waits."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
