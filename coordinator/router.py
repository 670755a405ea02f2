"""Placement: which prefill worker computes a request's KV, which decode worker receives and decodes it,
and whether the hop is worth it at all (conditional disaggregation).

Decode worker: the READY one with the most allocatable KV blocks (last report less what was placed
since) that can hold the whole sequence and whose KV layout equals the prefill worker's.

Prefill worker: the READY one with the lowest *estimated TTFT*

    compute(queued + uncached_tokens, its step budget)
    queued = queued uncached tokens it reported + tokens placed on it since
    compute(n, per_step) = n x cost_per_token + ceil(n / per_step) x step_base

where cost_per_token and step_base are the worker's measured step cost (engine/step_cost.py:
time ~ base + tokens x cost; no base term until it reports its budget and base). A prefill
worker's steps are all prompt, so its report prices it (the slope, or the average per token before
its steps differ in size); a colocated worker's once it has a fit (step base > 0). Any other
worker borrows the mean of those: a decode worker's steps are decodes, whose fit over their few
tokens is no prompt cost (a 45 ms step over 6 of them averages 7,500 us a token; their slope, what
one more running sequence adds, came out 10 ms a token in session 29, and while any fitted worker's
slope counted, a prefill worker whose fit clamped its base to 0 borrowed it: a 1,024-token document
on an idle P estimated at 12.9 s). With no such report anywhere, its own average, then the pool's,
then a default.
uncached_tokens is the sequence minus the longest prefix whose chained block hashes the worker reported in PrefixCacheEvents. A prefix hit on a busy worker therefore loses to an idle worker when
the queue costs more than the recompute (seed 001, "the cache hit that loses"). A colocated worker is
its own decode worker.

A worker that runs `--long-prefill-token-threshold T` (it reports T, and how many of its queued
tokens belong to longer prompts) does not serve its queue in order: prompts of at most T tokens go
first, the one long prompt advancing one block of B tokens in their steps (at most half a step's
prompt tokens), and its chunk of up to T fills the steps without them. With t = min(T, per_step) there

    short prompt (n <= T): steps = ceil((short queued + n + B) / per_step), computing those short
        tokens plus the long prompt's share of them: B in the step the prompt joins, then half what
        the short ones leave of their last step, up to B (B is 0 once no long work is queued), after
        half the long prompt's chunk in flight (step_base + min(long queued, t) x cost_per_token: a
        prompt arriving during a step waits out the rest)
    long prompt:           the short queued tokens' steps as above, then the rest of all of them
        at t a step (every queued short prompt runs first)

each step costing step_base, each token cost_per_token; without T, the plain FIFO compute above.
Without this a chat behind a queued document was priced after the document.

Conditional disaggregation (`RoutingPolicy.disaggregation`): the remote path costs the prefill
worker's estimate plus the decode worker's measured KV transfer time (and, when the first token
streams from the decode worker, `--first-token-from decode`, half its decode step while it runs any:
the request joins at its next step boundary); the local path (the decode
worker prefills the prompt itself, in chunks of the step budget its running decodes leave) costs

    ahead, steps = the prompt tokens it computes until this prompt is done, and their steps, in its
                   own order at `spare` a step (the same as a prefill worker's above: under its
                   threshold a chat goes before a document already prefilling there)
    local_ms = prompt(ahead, steps) + steps x its decode step (>= its step base)
               + half its decode step while it runs any, and half a long prompt's chunk in it (the
               step in flight, waited out)
    prompt(n, k) = n x its prompt cost a token + k x its prompt base
    (a decode step a step even while it runs nothing: a step of prompt alone pays the same fixed
    part, the weights read once, and D's whole-step fit, polluted by its decode steps, priced an idle
    D's chat above what it took; tried in session 26, not kept)
    spare = its step token budget - its running sequences (one decode token each per step), at most
            its prefill_tokens_while_decoding while any runs (the same cap D's scheduler applies;
            none for a prompt short by its whole length on a worker that runs those whole,
            `--short-prompts-whole`)

where the prompt cost a token and base are what D reports of prompt tokens *beside its decodes*
(`prompt_beside_decodes_*`: the fit its own time cap uses, a fixed part per step that carries prompt
tokens and a cost a token); before it has measured one, its whole-step cost_per_token and no base.
A decode worker that borrows the prefill workers' idle cores for its prompt steps (`--borrow-cores`,
engine/worker/core_lease.py) reports the same fit over those steps (`prompt_on_borrowed_cores_*`);
while no prefill worker has work (queued or placed since its report), a short prompt (by its
threshold) is priced by that, at the prompt tokens a step its time cap buys there
(`prefill_tokens_while_decoding_on_borrowed_cores`): the prefill workers' cores are then free for it (every one of them, so
a decode worker's own lender is among them wherever the pools span hosts). Until it has measured
such a step it reports its own share of their team (`prompt_on_borrowed_cores_share`: 1 thread of
2 is 0.5) and the home price times that is the prior: without one the router priced an unmeasured
D at home, sent every chat to an idle P, and D never borrowed to measure (session 29: 31 of 36
chats at 0.5 req/s shipped, TTFT p50 122 ms). A long prompt keeps the
home fit: the decode worker computes it on its own cores (engine/worker/stepper.py). The lender pays
for it: a prefill worker with no work of its own, while a decode worker has short prompts queued or
placed on the borrowed cores, first waits out one such step to take its cores back (a claim waits
for at most one borrowed step), so its queue is one such step: as many of those tokens as one step of
D's carries there (`spare`, on borrowed cores), at the borrowed fit, plus a decode step
(`claim_wait_ms`). Without it a chat arriving just behind another that went to D
was priced at an idle P and shipped, then queued 11-59 ms for P's core (session 29: 155-165 ms
against 65 for its neighbour).

A long prompt (over the worker's threshold T) is priced as counted times the worker's learned
factor for that path, observed / estimated over its recent long prompts (coordinator/ttft_calibration.py):
the count sees what is queued, not the short prompts that will go first while a long one prefills
for seconds, nor the decodes they add to its steps.

`conditional` takes the local path when it is cheaper and the uncached prompt is at most
`local_prefill_max_tokens` (a long prompt always goes to a prefill worker, so decode keeps its core),
and, with `local_first_ttft_ms` > 0, also whenever local_ms is within it: a short prompt then
leaves the prefill worker to the long ones even when that worker would be sooner for it, since
every prompt a prefill worker takes delays the long prompts queued behind it; with `ttft_slo_ms` > 0
a prompt over the decode worker's threshold T goes local only when the remote estimate is over that
target (its chunks would stretch every running request's gaps for seconds: worth it only to save a
first token's target; at 0.5 req/s of issue 12's mix, documents on D made 33-161 of the 59-181 gaps
over 1.5x the unloaded TPOT in session 28's runs);
`always` never prefills on a decode worker; `never` always does.

The gap a local prefill makes (`RoutingPolicy.itl_stretch` > 0): while the decode worker decodes
anything (running or placed there), the first step that carries the prompt also carries every running
request's next token, so that gap is

    local_gap = step + prompt(min(uncached, spare)) over 1 step (on borrowed cores where priced so)

and `conditional` goes local only while `local_gap <= itl_stretch x step`; otherwise the prompt goes
remote, unless the remote estimate is over the TTFT target (`ttft_slo_ms`, where set): a prompt costs
running requests one long gap only to save its first token's target. A worker decoding nothing has
no gap to stretch, so an idle decode worker still prefills short prompts itself (session 34, issue 12's
study: a 64-token chat whole in one step of a decoding D was estimated at 39-60 ms against a 10 ms
decode step; those steps made conditional's ITL p99 1.6-4.8x unloaded).

Prompt lanes: a prefill worker with `--max-prompt-tokens N` takes sequences of at most N tokens, and
one with `--cpu-priority idle` (SCHED_IDLE) computes only while its CPUs have nothing else to run, so
the router ranks it after every normal-priority prefill worker that takes the prompt, and does not
count its work as holding cores a decode worker could borrow. Two prefill workers pinned to the same
cores, a short lane at normal priority and a long one at idle priority, let a chat's prefill preempt
a document's mid-chunk: the kernel runs the chat's thread the moment it is runnable (session 35,
engine alone on one core: a 64-token prefill took 40.6 ms beside a 1,024-token prefill loop at
SCHED_IDLE, 40.8 alone, and 82.1 beside one at the same priority). Without lanes a chat sent to a
prefill worker waited out the rest of a document's 256-token chunk there (issue 12's study at 1-2
req/s: remote chats' TTFT 59-461 ms against a TTFT p50 of 50-68 for the best colocated budget).

The TPOT a local prefill costs the decode worker (`RoutingPolicy.tpot_slo_ms` > 0): all its prompt
work (`work`: queued, placed since, and this prompt's uncached tokens), in whatever order, lands in
its steps, `spare` a step, on top of the decodes, adding `prompt(work)` of step time. A running
request with `r` output tokens left of `n` sees the part of it computed in its remaining
steps, `prompt(min(work, r x spare))`, spread over its `n - 1` inter-token gaps:

    projected_tpot = max over running requests of  step + prompt(min(work, r x spare)) / (n - 1)
    step = its measured decode step (step base + running x cost before it has one)

and `conditional` goes local only while that stays within the target (`--tpot-guard ceiling`), so a
decode worker already at its target sheds prefill to the prefill workers (whose queue then meters new
decodes into it). `--tpot-guard increment` judges only what this prompt adds: it refuses local when a
running request whose projection without the prompt's tokens is within the target would be over it
with them; a decode worker over the target by its own step then still takes short prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from coordinator.routing_policy import RoutingPolicy
from coordinator.ttft_calibration import long_ttft_factor
from coordinator.workers import COLOCATED, DECODE, PREFILL, WorkerInfo, WorkerRegistry
from engine.block_pool import hash_block
from engine.config import long_prompt, prefill_budget
from splitserve.v1 import serving_pb2

# used until some prefill worker has measured its cost (microseconds per uncached prompt token)
DEFAULT_PREFILL_US_PER_TOKEN = 100.0
REMOTE, LOCAL, COLOCATED_PATH = (
    serving_pb2.PREFILL_PATH_REMOTE,
    serving_pb2.PREFILL_PATH_LOCAL,
    serving_pb2.PREFILL_PATH_COLOCATED,
)


def decision_name(path: serving_pb2.PrefillPath.ValueType) -> str:
    """`PREFILL_PATH_LOCAL` -> "local": a path as the `decision` metric labels and logs name it."""
    return serving_pb2.PrefillPath.Name(path).removeprefix("PREFILL_PATH_").lower()


@dataclass(frozen=True, slots=True)
class Placement:
    """The router's choice for one request generation, with the numbers behind it (for logs and the
    request's Timings.routing)."""

    prefill: WorkerInfo  # the decode worker itself on the LOCAL and COLOCATED paths
    decode: WorkerInfo
    cached_tokens: int
    uncached_tokens: int
    estimated_ttft_ms: float
    needed_blocks: int
    path: serving_pb2.PrefillPath.ValueType = REMOTE
    remote_ttft_ms: float = 0.0
    local_ttft_ms: float = 0.0
    transfer_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    decode_spare_tokens: int = 0
    local_tpot_ms: float = 0.0
    tpot_target_ms: float = 0.0
    local_added_ms: float = 0.0
    decode_running: int = 0
    local_pushed_over: int = 0  # running requests the local prefill would push over the TPOT target
    local_first_ttft_ms: float = 0.0  # the policy's local-first bound the local estimate was held to
    remote_ttft_factor: float = 1.0  # what remote_ttft_ms includes for a long prompt (ttft_calibration)
    local_ttft_factor: float = 1.0  # the same for local_ttft_ms
    local_on_borrowed_cores: bool = False  # local_ttft_ms priced by D's fit on borrowed cores
    ttft_target_ms: float = 0.0  # the policy's TTFT target a long prompt's remote estimate was held to
    local_gap_ms: float = 0.0  # the decode worker's first step carrying the prompt, while it decodes
    itl_stretch: float = 0.0  # the policy's bound on local_gap_ms, a multiple of its decode step

    @property
    def colocated(self) -> bool:
        """One worker prefills and decodes (LOCAL or COLOCATED): no KV crosses a process."""
        return self.prefill is self.decode

    @property
    def decision(self) -> str:
        """The path's name for logs and the `decision` metric label: remote, local or colocated."""
        return decision_name(self.path)

    def routing(self) -> serving_pb2.RoutingDecision:
        return serving_pb2.RoutingDecision(
            path=self.path,
            estimated_ttft_ms=self.estimated_ttft_ms,
            remote_ttft_ms=self.remote_ttft_ms,
            local_ttft_ms=self.local_ttft_ms,
            transfer_ms=self.transfer_ms,
            cached_tokens=self.cached_tokens,
            uncached_tokens=self.uncached_tokens,
            prefill_queue_ms=self.prefill_queue_ms,
            decode_spare_tokens=self.decode_spare_tokens,
            local_tpot_ms=self.local_tpot_ms,
            tpot_target_ms=self.tpot_target_ms,
            local_added_ms=self.local_added_ms,
            decode_running=self.decode_running,
            local_first_ttft_ms=self.local_first_ttft_ms,
            remote_ttft_factor=self.remote_ttft_factor,
            local_ttft_factor=self.local_ttft_factor,
            local_on_borrowed_cores=self.local_on_borrowed_cores,
            ttft_target_ms=self.ttft_target_ms,
            local_gap_ms=self.local_gap_ms,
            itl_stretch=self.itl_stretch,
        )

    @property
    def ttft_factor(self) -> float:
        """The factor the chosen path's estimate includes (1: a short prompt, or none observed)."""
        return self.local_ttft_factor if self.path == LOCAL else self.remote_ttft_factor


@dataclass(frozen=True, slots=True)
class RunningDecode:
    """A request decoding (or placed to decode) on a decode worker, as the TPOT projection sees it:
    output tokens still to come and in all (max_tokens; an early EOS only helps)."""

    remaining_tokens: int
    output_tokens: int


Decoding = Callable[[str], Sequence[RunningDecode]]  # decode worker id -> its running requests


def no_decoding(worker_id: str) -> Sequence[RunningDecode]:
    return ()


@dataclass(frozen=True, slots=True)
class LocalEstimate:
    """A decode worker's estimate for prefilling a sequence itself."""

    ttft_ms: float  # as counted, times ttft_factor
    cached_tokens: int
    spare_tokens: int  # step budget its running decodes leave
    work_tokens: int  # its queued prefill + placed since + this sequence's uncached tokens
    own_tokens: int  # this sequence's uncached tokens
    ttft_factor: float = 1.0  # a long prompt's correction (coordinator/ttft_calibration.py)
    on_borrowed_cores: bool = False  # priced by its fit on borrowed cores (Router.on_borrowed_cores)


@dataclass(frozen=True, slots=True)
class TpotEstimate:
    """What a local prefill costs the decode worker's running requests."""

    added_ms: float  # step time the prefill work adds, spread over the running requests' tokens
    tpot_ms: float  # the worst running request's projected TPOT; 0 with nothing running
    running: int
    pushed_over: int = 0  # running requests within the target without this prompt, over it with it


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, model_identity: str) -> list[int]:
    """Routing keys of the sequence's full blocks, as workers report them in PrefixCacheEvents: the first
    8 bytes of the engine's chained block hash, little-endian. The last token is never in a cached block
    (its logits are needed), as in the engine's prefix matching."""
    keys, parent = [], None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], model_identity)
        keys.append(int.from_bytes(parent[:8], "little"))
    return keys


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks a decode worker reserves for a sequence of `num_tokens`, plus room for its next token."""
    return -(-(num_tokens + 1) // block_size)


class Router:
    """Stateless policy over the registry; `commit` records what it placed until the next report."""

    def __init__(self, registry: WorkerRegistry, policy: RoutingPolicy | None = None) -> None:
        self.registry = registry
        self.policy = policy or RoutingPolicy()

    def cost_us_per_token(self, worker: WorkerInfo) -> float:
        """The marginal cost of a prompt token on `worker` (module doc: whose fit it borrows)."""
        own = worker.load.prefill_us_per_token
        if _prices_prompts(worker):
            return own
        fitted = [w.load.prefill_us_per_token for w in self.registry if _prices_prompts(w)]
        if fitted:
            return sum(fitted) / len(fitted)
        if own > 0:
            return own
        measured = [w.load.prefill_us_per_token for w in self.registry if w.load.prefill_us_per_token > 0]
        return sum(measured) / len(measured) if measured else DEFAULT_PREFILL_US_PER_TOKEN

    def estimate_ttft(
        self, worker: WorkerInfo, token_ids: Sequence[int], hashes: dict[int, list[int]] | None = None
    ) -> tuple[float, int]:
        """(estimated ms to the first token on `worker`, tokens of the sequence it has cached)."""
        cached = self.cached_tokens(worker, token_ids, hashes)
        return self.prefill_ms(worker, len(token_ids) - cached), cached

    def prefill_ms(self, worker: WorkerInfo, uncached: int) -> float:
        """Estimated ms until a new prompt of `uncached` tokens has its first token on `worker`,
        behind the work queued there (module doc: in order, or beside long prompts under T)."""
        load = worker.load
        run = self.prompt_run(worker, uncached, load.step_token_budget)
        cost_ms = self.cost_us_per_token(worker) / 1e3
        in_flight = (load.step_base_ms + run.in_flight_tokens * cost_ms) / 2 if run.in_flight_tokens else 0.0
        return run.tokens * cost_ms + run.steps * load.step_base_ms + in_flight

    def prompt_run(self, worker: WorkerInfo, uncached: int, per_step: int) -> PromptRun:
        """What `worker` computes, `per_step` prompt tokens a step, until a new prompt of `uncached`
        tokens is done behind what is queued there (reported and placed since)."""
        load = worker.load
        return prompt_run(
            load.queued_tokens + worker.pending_tokens,
            load.queued_long_tokens + worker.pending_long_tokens,
            uncached,
            per_step,
            load.long_prefill_token_threshold,
            worker.block_size,
        )

    def compute_ms(self, worker: WorkerInfo, tokens: int, per_step: int | None = None) -> float:
        """Estimated ms for `worker` to compute `tokens`, `per_step` (default: its step budget) a step."""
        load = worker.load
        per_step = load.step_token_budget if per_step is None else per_step
        return tokens * self.cost_us_per_token(worker) / 1e3 + _steps(tokens, per_step) * load.step_base_ms

    def estimate_local(
        self, decode: WorkerInfo, token_ids: Sequence[int], hashes: dict[int, list[int]] | None = None
    ) -> LocalEstimate | None:
        """`decode` prefilling the sequence itself within its spare step budget; None when its
        running decodes leave no budget (or it has not reported its budget yet)."""
        load = decode.load
        cached = self.cached_tokens(decode, token_ids, hashes)
        own = len(token_ids) - cached
        borrowed = self.on_borrowed_cores(decode, own)
        spare = _spare_tokens(decode, borrowed, len(token_ids))
        if spare <= 0:
            return None
        work = load.queued_tokens + decode.pending_tokens + own
        run = self.prompt_run(decode, own, spare)  # what runs before it: D's own order, as P's
        in_flight = _step_in_flight_ms(decode)  # the step under way, and a long prompt's chunk in it
        if run.in_flight_tokens:
            in_flight += self.local_prompt_ms(decode, run.in_flight_tokens, 1, borrowed) / 2
        ttft = self.local_prompt_ms(decode, run.tokens, run.steps, borrowed) + run.steps * _decode_step_ms(
            decode
        )
        factor = self.long_ttft_factor(decode, own, LOCAL)
        return LocalEstimate((ttft + in_flight) * factor, cached, spare, work, own, factor, borrowed)

    @staticmethod
    def priced_by_own_fit(worker: WorkerInfo, path: serving_pb2.PrefillPath.ValueType) -> bool:
        """Whether `worker`'s estimates on `path` come from its own fitted cost, not an average, a
        borrowed or a default one: its step fit where that prices prompts (`cost_us_per_token`), and
        on the local path also its fit of prompt tokens beside decodes (`local_prompt_ms`)."""
        load = worker.load
        if path == LOCAL and load.prompt_beside_decodes_us_per_token > 0:
            return True
        return _prices_prompts(worker) and load.step_base_ms > 0

    @staticmethod
    def long_ttft_factor(worker: WorkerInfo, uncached: int, path: serving_pb2.PrefillPath.ValueType) -> float:
        """What a prompt of `uncached` tokens' counted estimate on `worker` by `path` is multiplied by:
        the worker's learned factor for a long prompt there, 1 for a short one."""
        if long_prompt(worker.load.long_prefill_token_threshold, uncached):
            return long_ttft_factor(worker, path)
        return 1.0

    def local_prompt_ms(self, decode: WorkerInfo, tokens: int, steps: int, borrowed: bool = False) -> float:
        """What `tokens` of prompt over `steps` steps add to `decode`'s steps beyond its decodes: the
        fit it reports of prompt tokens beside decodes (a fixed part per step that carries any, and a
        cost a token); before it has one, its whole-step cost a token and no fixed part. `borrowed`
        (`on_borrowed_cores`): the fit of its steps on borrowed cores; before it has one, the home
        price x its own share of such a step's team (`prompt_on_borrowed_cores_share`)."""
        load = decode.load
        if borrowed and load.prompt_on_borrowed_cores_us_per_token > 0:
            return (
                tokens * load.prompt_on_borrowed_cores_us_per_token / 1e3
                + steps * load.prompt_on_borrowed_cores_base_ms
            )
        if borrowed:
            return self.local_prompt_ms(decode, tokens, steps) * load.prompt_on_borrowed_cores_share
        if load.prompt_beside_decodes_us_per_token <= 0:
            return tokens * self.cost_us_per_token(decode) / 1e3
        return (
            tokens * load.prompt_beside_decodes_us_per_token / 1e3
            + steps * load.prompt_beside_decodes_base_ms
        )

    def claim_wait_ms(self) -> float:
        """What a prefill worker waits to take its cores back before its first step (module doc):
        the longest step of short prompts a decode worker computes on borrowed cores, queued or
        placed there since; 0 while any prefill worker has work (nothing is borrowed then). The same
        for every prefill worker: each is idle whenever it is not 0."""
        if not self._prefill_workers_idle():
            return 0.0
        waits = [0.0]
        for decode in self.registry.ready():
            load = decode.load
            short = (
                load.queued_tokens
                - load.queued_long_tokens
                + decode.pending_tokens
                - decode.pending_long_tokens
            )
            if decode.role == DECODE and short > 0 and _borrows(decode):
                tokens = min(short, max(_spare_tokens(decode, True, 0), 0))  # one step's
                waits.append(self.local_prompt_ms(decode, tokens, 1, True) + _decode_step_ms(decode))
        return max(waits)

    def _prefill_workers_idle(self) -> bool:
        """No READY prefill worker at normal priority has prompt work, reported or placed since: their
        cores are free to borrow (module doc; one at idle priority yields them anyway)."""
        return not any(
            w.load.queued_tokens + w.pending_tokens
            for w in self.registry.ready()
            if w.role == PREFILL and not w.idle_priority
        )

    def on_borrowed_cores(self, decode: WorkerInfo, uncached: int) -> bool:
        """Whether `decode` prefills a prompt of `uncached` tokens on borrowed cores (module doc): it
        borrows (it reports a fit of such steps, or its share of their team before it has one), the
        prompt is short by its threshold, and no READY prefill worker has prompt work, reported or
        placed since (their cores are free)."""
        if not _borrows(decode) or long_prompt(decode.load.long_prefill_token_threshold, uncached):
            return False
        return self._prefill_workers_idle()

    def estimate_tpot(
        self, decode: WorkerInfo, est: LocalEstimate, running: Sequence[RunningDecode]
    ) -> TpotEstimate:
        """`decode`'s projected TPOT once `est.work_tokens` of prefill land in its steps (module doc)."""
        spare = est.spare_tokens

        def landing(tokens: int) -> float:  # what `tokens` of prompt add, `spare` a step
            return self.local_prompt_ms(decode, tokens, _steps(tokens, spare))

        load = decode.load
        step = load.decode_step_ms or load.step_base_ms + len(running) * self.cost_us_per_token(decode) / 1e3
        worst, pushed = 0.0, 0
        target = self.policy.tpot_slo_ms
        before = est.work_tokens - est.own_tokens  # the prefill work D has without this prompt
        for r in running:
            gaps, room = max(1, r.output_tokens - 1), r.remaining_tokens * spare
            tpot = step + landing(min(est.work_tokens, room)) / gaps
            worst = max(worst, tpot)
            pushed += step + landing(min(before, room)) / gaps <= target < tpot
        added = landing(est.work_tokens)
        return TpotEstimate(added, worst, len(running), pushed)

    def cached_tokens(
        self, worker: WorkerInfo, token_ids: Sequence[int], hashes: dict[int, list[int]] | None = None
    ) -> int:
        """Tokens of the sequence's longest prefix that `worker` reported in its prefix events."""
        cached = 0
        if worker.prefix_hashes:
            keys = _hashes_for(token_ids, worker.block_size, self.registry.model.identity, hashes)
            for key in keys:
                if key not in worker.prefix_hashes:
                    break
                cached += worker.block_size
        return cached

    def choose_decode(
        self, num_tokens: int, layout_hash: str, exclude: frozenset[str] = frozenset()
    ) -> WorkerInfo | None:
        """The READY decode worker with the most free blocks that fits the sequence, or None."""
        fits = [
            w
            for w in self.registry.ready()
            if w.role == DECODE
            and w.layout_hash == layout_hash
            and w.worker_id not in exclude
            and w.free_blocks_estimate >= blocks_for(num_tokens, w.block_size)
        ]
        if not fits:
            return None
        return min(fits, key=lambda w: (-w.free_blocks_estimate, w.load.running_requests, w.worker_id))

    def place(self, token_ids: Sequence[int], decoding: Decoding = no_decoding) -> Placement | None:
        """Best placement for the sequence `token_ids` (prompt + output so far) under the policy, or
        None when no READY worker has room now. `decoding` names each decode worker's running
        requests (the coordinator's request table), for the TPOT target."""
        hashes: dict[int, list[int]] = {}
        remote = self._place_remote(token_ids, hashes)
        if self.policy.disaggregation == "always" or (remote is not None and remote.path == COLOCATED_PATH):
            return remote
        local = self._place_local(token_ids, hashes, remote, decoding)
        if local is None or self.policy.disaggregation == "never":
            return local or remote
        too_long = local.uncached_tokens > self.policy.local_prefill_max_tokens
        target = self.policy.tpot_slo_ms
        if self.policy.tpot_guard == "increment":
            over_tpot = target > 0 and local.local_pushed_over > 0
        else:
            over_tpot = target > 0 and local.local_tpot_ms > target
        if remote is None:  # no prefill worker can take it now: wait for one (or for D's TPOT)
            return None if too_long or over_tpot else local
        if (
            too_long
            or over_tpot
            or self.remote_meets_target(remote, local)
            or self.spares_gaps(remote, local)
        ):
            return _with_local(remote, local)
        first = self.policy.local_first_ttft_ms
        if local.local_ttft_ms < remote.remote_ttft_ms or (first > 0 and local.local_ttft_ms <= first):
            return local
        return _with_local(remote, local)

    def remote_meets_target(self, remote: Placement, local: Placement) -> bool:
        """A long prompt for the decode worker (over its threshold: chunks beside its decodes for many
        steps) whose remote estimate is within the policy's TTFT target: it goes remote however much
        sooner the local path would be (`RoutingPolicy.ttft_slo_ms`; never while that is 0)."""
        target = self.policy.ttft_slo_ms
        threshold = local.decode.load.long_prefill_token_threshold
        return (
            target > 0 and long_prompt(threshold, local.uncached_tokens) and remote.remote_ttft_ms <= target
        )

    def spares_gaps(self, remote: Placement, local: Placement) -> bool:
        """The local prefill would stretch the decode worker's next gap past the policy's bound
        (`RoutingPolicy.itl_stretch` x its decode step, while it decodes) and the remote path is within
        the TTFT target (where one is set): the prompt goes remote to spare its running requests."""
        stretch = self.policy.itl_stretch
        if stretch <= 0 or local.local_gap_ms <= stretch * _decode_step_ms(local.decode):
            return False
        target = self.policy.ttft_slo_ms
        return target <= 0 or remote.remote_ttft_ms <= target

    def _place_remote(self, token_ids: Sequence[int], hashes: dict[int, list[int]]) -> Placement | None:
        """The lowest-TTFT prefill worker whose lane takes the sequence and that pairs with a decode
        worker with room (or a colocated worker with room), with the transfer estimate of that decode
        worker; one at idle priority only when none at normal priority does."""
        options = []
        idle_claim = self.claim_wait_ms()  # a prefill worker's; a colocated worker lends nothing
        for worker in self.registry.ready():
            if worker.does_prefill and worker.takes_sequence(len(token_ids)):
                ttft, cached = self.estimate_ttft(worker, token_ids, hashes)
                factor = self.long_ttft_factor(worker, len(token_ids) - cached, REMOTE)  # colocated: 1
                claim = idle_claim if worker.role == PREFILL else 0.0
                options.append((ttft * factor + claim, worker.worker_id, worker, cached, factor, claim))
        # an idle-priority worker only after every one at normal priority (module doc: prompt lanes)
        ranked = sorted(options, key=lambda o: (o[2].idle_priority, o[0], o[1]))
        for ttft, _, prefill, cached, factor, claim in ranked:
            if prefill.role == COLOCATED:
                fits = prefill.free_blocks_estimate >= blocks_for(len(token_ids), prefill.block_size)
                decode = prefill if fits else None
            else:
                decode = self.choose_decode(len(token_ids), prefill.layout_hash)
            if decode is None:
                continue
            needed = blocks_for(len(token_ids), decode.block_size)
            uncached = len(token_ids) - cached
            if prefill is decode:
                return Placement(prefill, decode, cached, uncached, ttft, needed, COLOCATED_PATH)
            transfer = decode.load.kv_transfer_ms
            queue_ms = self.compute_ms(prefill, prefill.load.queued_tokens + prefill.pending_tokens) + claim
            total = ttft + transfer * factor
            if self.policy.first_token_from == "decode":  # token 1 streams at D's next step boundary
                total += _step_in_flight_ms(decode) * factor
            return Placement(
                prefill,
                decode,
                cached,
                uncached,
                total,
                needed,
                REMOTE,
                total,
                0.0,
                transfer,
                queue_ms,
                remote_ttft_factor=factor,
            )
        return None

    def _place_local(
        self,
        token_ids: Sequence[int],
        hashes: dict[int, list[int]],
        remote: Placement | None,
        decoding: Decoding,
    ) -> Placement | None:
        """The decode worker with room and the lowest local estimate (`never`: with room, by free
        blocks, even without spare budget); None when none has both."""
        best: tuple[float, str, WorkerInfo, LocalEstimate | None] | None = None
        for decode in self.registry.ready():
            if decode.role != DECODE or decode.free_blocks_estimate < blocks_for(
                len(token_ids), decode.block_size
            ):
                continue
            est = self.estimate_local(decode, token_ids, hashes)
            if est is None and self.policy.disaggregation != "never":
                continue
            key = est.ttft_ms if est is not None else float("inf")
            if best is None or (key, decode.worker_id) < (best[0], best[1]):
                best = (key, decode.worker_id, decode, est)
        if best is None:
            return None
        _, _, decode, est = best
        cached = est.cached_tokens if est is not None else self.cached_tokens(decode, token_ids, hashes)
        ttft = est.ttft_ms if est is not None else 0.0
        target = self.policy.tpot_slo_ms
        running = decoding(decode.worker_id)
        tpot = (
            self.estimate_tpot(decode, est, running)
            if est is not None and target > 0
            else TpotEstimate(0.0, 0.0, 0)
        )
        gap = 0.0
        if est is not None and running:  # its first step carrying the prompt, with its decodes
            tokens = min(est.own_tokens, est.spare_tokens)
            gap = _decode_step_ms(decode) + self.local_prompt_ms(decode, tokens, 1, est.on_borrowed_cores)
        return Placement(
            decode,
            decode,
            cached,
            len(token_ids) - cached,
            ttft,
            blocks_for(len(token_ids), decode.block_size),
            LOCAL,
            remote.remote_ttft_ms if remote is not None else 0.0,
            ttft,
            remote.transfer_ms if remote is not None else 0.0,
            remote.prefill_queue_ms if remote is not None else 0.0,
            est.spare_tokens if est is not None else 0,
            tpot.tpot_ms,
            target,
            tpot.added_ms,
            tpot.running,
            tpot.pushed_over,
            self.policy.local_first_ttft_ms,
            remote.remote_ttft_factor if remote is not None else 1.0,
            est.ttft_factor if est is not None else 1.0,
            est is not None and est.on_borrowed_cores,
            self.policy.ttft_slo_ms,
            gap,
            self.policy.itl_stretch,
        )

    def largest_pool_refusal(self, num_tokens: int) -> tuple[int, WorkerInfo] | None:
        """(blocks needed, the largest registered decode-capable pool) when no such pool, of any
        health, could ever hold a sequence of `num_tokens` even when empty; None when one could (or
        when none is registered: that is MODEL_NOT_READY, not a limit)."""
        pools = [w for w in self.registry if w.does_decode]
        if not pools or any(blocks_for(num_tokens, w.block_size) <= w.register.num_blocks for w in pools):
            return None
        largest = max(pools, key=lambda w: (w.register.num_blocks * w.block_size, w.worker_id))
        return blocks_for(num_tokens, largest.block_size), largest

    def commit(self, placement: Placement) -> None:
        prefill = placement.prefill
        prefill.pending_tokens += placement.uncached_tokens
        if long_prompt(prefill.load.long_prefill_token_threshold, placement.uncached_tokens):
            prefill.pending_long_tokens += placement.uncached_tokens
        placement.decode.pending_blocks += placement.needed_blocks

    def commit_decode(self, decode: WorkerInfo, num_tokens: int) -> None:
        decode.pending_blocks += blocks_for(num_tokens, decode.block_size)


@dataclass(frozen=True, slots=True)
class PromptRun:
    """The prompt work a worker does until a new prompt is done (module doc: its order)."""

    tokens: int  # prompt tokens computed, the new prompt's included
    steps: int  # the steps they take
    in_flight_tokens: int  # a long prompt's chunk in the step under way, which a short prompt waits out


def prompt_run(
    queued: int, queued_long: int, uncached: int, per_step: int, threshold: int, block: int
) -> PromptRun:
    """A new prompt of `uncached` tokens behind `queued` prompt tokens (`queued_long` of them in prompts
    over `threshold`), `per_step` prompt tokens a step: first come, first served without a threshold;
    under one, short prompts first, the one long prompt keeping a `block` of their steps and filling
    the steps without them up to the threshold (engine.scheduler's order). Exact for a short prompt
    joining beside the long one alone; behind other short prompts the long one may take its block in
    more steps than the count has it, a step later each (the count sees one total of short work, not
    when each joins)."""
    if not threshold or per_step <= 0:
        return PromptRun(queued + uncached, _steps(queued + uncached, per_step), 0)
    long_work = min(queued, queued_long)
    short_work = queued - long_work
    fill = min(threshold, per_step)  # a step's prompt tokens while a long prompt runs
    floor = min(block, fill, per_step // 2) if long_work else 0
    if not long_prompt(threshold, uncached):
        steps, beside = _short_first(short_work + uncached, long_work, per_step, floor)
        return PromptRun(short_work + uncached + beside, steps, min(long_work, fill))
    steps, beside = _short_first(short_work, long_work, per_step, floor)
    tokens = long_work + short_work + uncached
    return PromptRun(tokens, steps + _steps(tokens - short_work - beside, fill), 0)


def _short_first(short: int, long_work: int, per_step: int, floor: int) -> tuple[int, int]:
    """(steps, long prompt tokens in them) while `short` tokens of short prompts run first: the long
    prompt takes its `floor` in the step a short prompt joins (it runs before the waiting), then half
    of what the short ones leave of their last step, up to the floor."""
    if not short:
        return 0, 0
    steps = _steps(short + min(long_work, floor), per_step)
    last_left = steps * per_step - short - floor if steps > 1 else 0
    return steps, min(long_work, floor + min(floor, last_left // 2))


def _steps(tokens: int, per_step: int) -> int:
    """Steps of at most `per_step` tokens that `tokens` take (0 without a budget)."""
    return -(-tokens // per_step) if per_step > 0 else 0


def _hashes_for(
    token_ids: Sequence[int], block_size: int, identity: str, memo: dict[int, list[int]] | None
) -> list[int]:
    if memo is None:
        return prefix_block_hashes(token_ids, block_size, identity)
    if block_size not in memo:
        memo[block_size] = prefix_block_hashes(token_ids, block_size, identity)
    return memo[block_size]


def _with_local(remote: Placement, local: Placement) -> Placement:
    """The remote placement carrying the local estimates it beat (for Timings.routing)."""
    return replace(
        remote,
        local_ttft_ms=local.local_ttft_ms,
        decode_spare_tokens=local.decode_spare_tokens,
        local_tpot_ms=local.local_tpot_ms,
        tpot_target_ms=local.tpot_target_ms,
        local_added_ms=local.local_added_ms,
        decode_running=local.decode_running,
        local_pushed_over=local.local_pushed_over,
        local_first_ttft_ms=local.local_first_ttft_ms,
        local_ttft_factor=local.local_ttft_factor,
        local_on_borrowed_cores=local.local_on_borrowed_cores,
        ttft_target_ms=local.ttft_target_ms,
        local_gap_ms=local.local_gap_ms,
        itl_stretch=local.itl_stretch,
    )


def _prices_prompts(worker: WorkerInfo) -> bool:
    """Whether `worker`'s step report is a prompt token's cost (module doc): a prefill worker's, or a
    colocated worker's fit."""
    load = worker.load
    if load.prefill_us_per_token <= 0:
        return False
    return worker.role == PREFILL or (worker.role == COLOCATED and load.step_base_ms > 0)


def _spare_tokens(decode: WorkerInfo, borrowed: bool, prompt_len: int) -> int:
    """Prompt tokens a step of `decode` carries beside its running decodes (module doc: `spare`), on
    borrowed cores or at home; for a prompt of `prompt_len` tokens (by its whole length, as its
    scheduler judges it), uncapped when it runs short prompts whole and that one is short (a short
    prompt's length, e.g. 0, for any of those)."""
    load = decode.load
    cap = load.prefill_tokens_while_decoding
    if borrowed and load.prefill_tokens_while_decoding_on_borrowed_cores:
        cap = load.prefill_tokens_while_decoding_on_borrowed_cores
    if load.short_prompts_whole and not long_prompt(load.long_prefill_token_threshold, prompt_len):
        cap = 0  # its caps bound long prefills' chunks only
    return prefill_budget(load.step_token_budget, cap, load.running_requests)


def _borrows(decode: WorkerInfo) -> bool:
    """Whether `decode` runs short prompts' steps on borrowed cores: it reports a fit of such steps,
    or its share of their team before it has one."""
    load = decode.load
    return load.prompt_on_borrowed_cores_us_per_token > 0 or load.prompt_on_borrowed_cores_share > 0


def _decode_step_ms(decode: WorkerInfo) -> float:
    """`decode`'s step with its running decodes: measured, at least its fitted step base."""
    return max(decode.load.decode_step_ms, decode.load.step_base_ms)


def _step_in_flight_ms(decode: WorkerInfo) -> float:
    """What a request joining `decode` waits out: half its decode step while it runs any."""
    return _decode_step_ms(decode) / 2 if decode.load.running_requests else 0.0
