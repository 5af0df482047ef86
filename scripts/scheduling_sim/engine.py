"""The event loop: a simulated device executes whatever the scheduler commits.

Frames run back to back on one simulated device in commit order.  A frame's
device interval is its profile cost (optionally jittered by a seeded factor);
every tensor-parallel rank reports that interval, one rank ``slow_rank_factor``
slower if asked.  Completion is observed ``host_delay_ns`` after the device
finishes, and output is published at once (the frontend has nothing to hold
back), so the output age the scheduler sees is the publication time.

Arrivals carry a tenant.  A scheduler that declares ``tenant_aware = True`` (the
VTC baseline) is admitted with ``admit(spec, tenant=...)``; others (the
production scheduler has no tenants) with ``admit(spec)``.

:func:`solo_latency_ns` is a request's end-to-end latency alone under the same
costs, the denominator of the slowdown the metrics report.

Speculative rounds.  A lane of a ``SPECULATIVE`` plan with query length q (its
``max_tokens``) offers q - 1 draft tokens; the simulated ranks accept the
leading run of them that succeed, each with probability p, the request's
acceptance profile (``Arrival.acceptance``, :data:`~.workload.ACCEPTANCE`) at
its current output position, and commit accepted + 1 tokens (the correction or
bonus token), capped by q and by the request's remaining output.  Draft j
(1-based) of a round starting at committed output k proposes output position
k + j - 1, and every output position is proposed at most once, so the draws are
kept per position: position t of request i succeeds iff u_i[t] < p, where u_i is
a stream of uniforms seeded by the simulation's seed and i's admission index.
Runs are reproducible, and a request meets the same draws under every
scheduler (common random numbers), whatever widths those choose.  Ordinary
lanes (decode, prefill) commit ``max_tokens`` as before.  Per request,
:class:`RequestStats` counts the rounds, offered and accepted drafts.

Device-allocated speculative programs (completed with a confidence sidecar)
are not simulated: the catalogs here are host-allocated.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from runtime.catalog import PROMPT_ALIGNMENT, GraphDescriptor, GraphKind
from runtime.coordinator.plan import LanePhase
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestHandle, RequestSpec
from scripts.scheduling_sim.workload import ACCEPTANCE, DEFAULT_ACCEPTANCE, Arrival


@dataclass
class RequestStats:
    handle: RequestHandle
    arrival_ns: int
    prompt_len: int
    output_target: int
    publications_ns: list[int] = field(default_factory=list)
    output_tokens: int = 0
    finished_ns: int | None = None
    tenant: int = 0
    acceptance: str = DEFAULT_ACCEPTANCE  # a name of ACCEPTANCE
    spec_rounds: int = 0  # speculative rounds this request took part in
    drafts_offered: int = 0  # draft tokens offered (q - 1 per round)
    drafts_accepted: int = 0  # of those, accepted
    spec_tokens: int = 0  # tokens committed by speculative rounds
    # Prefix caching: whether the request names its prompt's token ids (only then
    # can it reuse cached pages), and the prompt tokens the scheduler attached from
    # its prefix cache (GeneratedToken.cached_tokens; not prompt work).
    cacheable: bool = False
    cached_tokens: int = 0

    @property
    def ttft_ns(self) -> int | None:
        return self.publications_ns[0] - self.arrival_ns if self.publications_ns else None

    @property
    def e2e_ns(self) -> int | None:
        """Arrival to the last output (finished requests only)."""
        return None if self.finished_ns is None else self.finished_ns - self.arrival_ns

    @property
    def tpot_ns(self) -> float | None:
        """Time per output token after the first: (e2e - TTFT) / (output - 1);
        0 for a single-token output; ``None`` until finished."""
        e2e, ttft = self.e2e_ns, self.ttft_ns
        if e2e is None or ttft is None:
            return None
        return (e2e - ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    def gaps_ns(self) -> list[int]:
        p = self.publications_ns
        return [b - a for a, b in pairwise(p)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def solo_frames(spec: RequestSpec, catalog: Sequence[GraphDescriptor]) -> list[GraphDescriptor]:
    """The frames prefill-first FCFS runs for ``spec`` alone, in order.

    The prompt in chunks of the largest prefill bucket, the tail in the smallest
    bucket covering it (the first output token comes with the last chunk);
    then ``max_output_tokens - 1`` decode steps at the smallest decode batch.
    Without prefill buckets the whole prompt runs in one prefill of the prompt
    rounded up to 64, and without decode batches decode runs at B = 1 (the
    shapes the baselines synthesize).
    """
    prefill = sorted(
        (d for d in catalog if d.kind is GraphKind.PREFILL and d.batch_capacity == 1),
        key=lambda d: d.prompt_capacity,
    )
    decode = sorted(
        (d for d in catalog if d.kind is GraphKind.DECODE), key=lambda d: d.batch_capacity
    )
    frames: list[GraphDescriptor] = []
    remaining = spec.prompt_len
    if not prefill:
        capacity = _round_up(remaining, PROMPT_ALIGNMENT)
        frames.append(GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=capacity))
    else:
        largest = prefill[-1]
        while remaining > largest.prompt_capacity:
            frames.append(largest)
            remaining -= largest.prompt_capacity
        frames.append(next(d for d in prefill if d.prompt_capacity >= remaining))
    step = decode[0] if decode else GraphDescriptor(GraphKind.DECODE, 1)
    frames += [step] * (spec.max_output_tokens - 1)
    return frames


def solo_latency_ns(
    spec: RequestSpec,
    catalog: Sequence[GraphDescriptor],
    duration_ns: Callable[[GraphDescriptor], int],
    host_delay_ns: int,
) -> int:
    """The request's end-to-end latency alone under the same costs.

    Arrival to last output for prefill-first FCFS serving ``spec`` alone
    (:func:`solo_frames`): each frame's cost, each followed by the host delay
    before its completion is observed and the next frame dispatched, exactly as
    a :class:`Simulation` without jitter times ``FcfsScheduler`` running that
    one request.
    """
    costs: dict[GraphDescriptor, int] = {}
    total = 0
    for frame in solo_frames(spec, catalog):
        if frame not in costs:
            costs[frame] = duration_ns(frame)
        total += costs[frame] + host_delay_ns
    return total


def _scheduler_catalog(scheduler) -> tuple[GraphDescriptor, ...] | None:
    """The scheduler's prepared catalog where it exposes one (best effort)."""
    for path in (("catalog", "descriptors"), ("shapes", "catalog"), ("catalog",)):
        obj = scheduler
        for name in path:
            obj = getattr(obj, name, None)
        if isinstance(obj, (list, tuple)) and all(isinstance(d, GraphDescriptor) for d in obj):
            return tuple(obj)
    return None


@dataclass
class InFlight:
    fence: int
    plan: object
    dispatch_ns: int
    end_ns: int
    device_ns: int
    queued: bool


class Simulation:
    def __init__(
        self,
        scheduler,
        duration_ns: Callable[[GraphDescriptor], int],
        arrivals: list[Arrival],
        *,
        tp: int = 1,
        jitter: float = 0.0,
        slow_rank_factor: float = 1.0,
        host_delay_ns: int = 50_000,
        seed: int = 0,
        catalog: Sequence[GraphDescriptor] | None = None,
    ) -> None:
        """``catalog``: the prepared shapes, for :meth:`solo_ns`; by default taken
        from the scheduler where it exposes them (the production scheduler and
        the baselines do)."""
        self.scheduler = scheduler
        self.catalog = tuple(catalog) if catalog is not None else _scheduler_catalog(scheduler)
        self._solo_cache: dict[tuple[int, int], int] = {}
        self.duration_ns = duration_ns
        self.pending = sorted(arrivals, key=lambda a: a.at_ns)
        self.tp = tp
        self.jitter = jitter
        self.slow_rank_factor = slow_rank_factor
        self.host_delay_ns = host_delay_ns
        self.rng = random.Random(seed)
        self.now_ns = 0
        self.device_free_ns = 0
        self.next_fence = 0
        self.inflight: list[InFlight] = []
        self.requests: dict[int, RequestStats] = {}
        self.frames = 0
        self.frames_by_graph: dict[str, int] = {}
        # Decode-only frames by width: 1 ordinary decode, W a speculative round.
        self.rounds_by_width: dict[int, int] = {}
        self.trace: list[dict] = []
        self.busy_ns = 0
        # Prompt tokens the frames consumed (prefill rows' prompt_tokens): prompt
        # work, so a cached prefix is not in it.
        self.prompt_tokens_computed = 0
        self.seed = seed
        self._admitted = 0
        # Per request (by handle id): the acceptance uniforms of its output
        # positions, drawn in order from its own seeded stream.
        self._accept_streams: dict[int, tuple[random.Random, list[float]]] = {}

    # -- driving ---------------------------------------------------------------
    @property
    def done(self) -> bool:
        return (
            not self.pending
            and not self.inflight
            and all(s.finished_ns is not None for s in self.requests.values())
        )

    def _admit_due(self) -> None:
        while self.pending and self.pending[0].at_ns <= self.now_ns:
            arrival = self.pending.pop(0)
            if getattr(self.scheduler, "tenant_aware", False):
                handle = self.scheduler.admit(arrival.spec, tenant=arrival.tenant)
            else:
                handle = self.scheduler.admit(arrival.spec)
            acceptance = arrival.acceptance or DEFAULT_ACCEPTANCE
            if acceptance not in ACCEPTANCE:
                raise ValueError(
                    f"acceptance must be one of {sorted(ACCEPTANCE)}, got {acceptance!r}"
                )
            self.requests[handle.id] = RequestStats(
                handle,
                arrival.at_ns,
                arrival.spec.prompt_len,
                arrival.spec.max_output_tokens,
                tenant=arrival.tenant,
                acceptance=acceptance,
                cacheable=bool(arrival.spec.prompt_tokens),
            )
            stream = random.Random(f"accept:{self.seed}:{self._admitted}")
            self._accept_streams[handle.id] = (stream, [])
            self._admitted += 1

    def solo_ns(self, stats: RequestStats) -> int:
        """:func:`solo_latency_ns` of a request of this simulation, under its costs
        (without jitter) and host delay; needs :attr:`catalog`."""
        if self.catalog is None:
            raise ValueError("solo latency needs the catalog: pass Simulation(catalog=...)")
        key = (stats.prompt_len, stats.output_target)
        if key not in self._solo_cache:
            spec = RequestSpec(stats.prompt_len, stats.output_target)
            self._solo_cache[key] = solo_latency_ns(
                spec, self.catalog, self.duration_ns, self.host_delay_ns
            )
        return self._solo_cache[key]

    def _dispatch(self) -> None:
        while True:
            plan = self.scheduler.plan()
            if plan is None:
                return
            self._launch(plan)

    def _launch(self, plan) -> None:
        """Commit ``plan`` under the next fence and put it on the device."""
        fence = self.next_fence
        self.next_fence += 1
        self.scheduler.commit(plan, fence)
        self.inflight.append(self._run_on_device(fence, plan))
        self.prompt_tokens_computed += sum(lane.prompt_tokens for lane in plan.lanes)
        name = plan.graph.describe()
        self.frames_by_graph[name] = self.frames_by_graph.get(name, 0) + 1
        if plan.graph.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE):
            width = plan.graph.token_capacity
            self.rounds_by_width[width] = self.rounds_by_width.get(width, 0) + 1

    def _run_on_device(self, fence: int, plan) -> InFlight:
        """Frame ``fence`` on the device: its cost (jittered if asked), after the
        frames before it; its completion is seen ``host_delay_ns`` after its
        ``end_ns`` (a replay's host model overrides this: scheduling_sim.replay)."""
        cost = self.duration_ns(plan.graph)
        if self.jitter:
            cost = int(cost * (1.0 + self.rng.uniform(-self.jitter, self.jitter)))
        start = max(self.now_ns, self.device_free_ns)
        end = start + cost
        self.device_free_ns = end
        self.busy_ns += cost
        return InFlight(fence, plan, self.now_ns, end, cost, queued=bool(self.inflight))

    def _timer_ns(self) -> int | None:
        """Another time a step must happen at (a subclass's own events); none here."""
        return None

    def step(self) -> bool:
        """Dispatch what the scheduler wants, then advance to the next event."""
        self._admit_due()
        self._dispatch()
        next_completion = self.inflight[0].end_ns + self.host_delay_ns if self.inflight else None
        next_arrival = self.pending[0].at_ns if self.pending else None
        times = [t for t in (next_completion, next_arrival, self._timer_ns()) if t is not None]
        if not times:
            return False
        t = min(times)
        self.now_ns = max(self.now_ns, t)
        self.scheduler.advance_to(self.now_ns)
        if next_completion is not None and t == next_completion:
            self._complete(self.inflight.pop(0))
        return True

    def step_completion(self) -> None:
        """Advance to the next completion and apply it, dispatching nothing."""
        frame = self.inflight.pop(0)
        self.now_ns = max(self.now_ns, frame.end_ns + self.host_delay_ns)
        self.scheduler.advance_to(self.now_ns)
        self._complete(frame)

    def _uniform(self, request_id: int, position: int) -> float:
        stream, drawn = self._accept_streams[request_id]
        while len(drawn) <= position:
            drawn.append(stream.random())
        return drawn[position]

    def accepted_drafts(self, stats: RequestStats, offered: int) -> int:
        """How many of ``offered`` drafts from ``stats``'s current output position
        the ranks accept: the leading successes (see the module docstring)."""
        k = stats.output_tokens
        p = ACCEPTANCE[stats.acceptance].probability(k, stats.output_target)
        accepted = 0
        while accepted < offered and self._uniform(stats.handle.id, k + accepted) < p:
            accepted += 1
        return accepted

    def _speculative_tokens(self, lane) -> int:
        """Tokens a speculative lane of query length ``lane.max_tokens`` commits."""
        stats = self.requests[lane.handle.id]
        q = lane.max_tokens
        accepted = self.accepted_drafts(stats, q - 1)
        stats.spec_rounds += 1
        stats.drafts_offered += q - 1
        stats.drafts_accepted += accepted
        remaining = max(1, stats.output_target - stats.output_tokens)
        count = min(accepted + 1, q, remaining)
        stats.spec_tokens += count
        return count

    def _complete(self, frame: InFlight) -> None:
        plan = frame.plan
        speculative = plan.graph.kind is GraphKind.SPECULATIVE
        if speculative and getattr(plan.graph, "device_allocated", False):
            raise NotImplementedError(
                "device-allocated speculative programs complete with a confidence sidecar; "
                "the simulator runs host-allocated programs only"
            )
        records = []
        for lane in plan.lanes:
            count = lane.max_tokens
            if speculative and lane.phase is LanePhase.DECODE and count > 0:
                count = self._speculative_tokens(lane)
            tokens = tuple(self.rng.randrange(32000) for _ in range(count))
            records.append(CompletionRecord(lane.slot, lane.generation, tokens))
        ranks = [frame.device_ns] * self.tp
        if self.tp > 1 and self.slow_rank_factor != 1.0:
            ranks[-1] = int(frame.device_ns * self.slow_rank_factor)
        timing = ExecutionTiming(
            tuple(ranks),
            host_wall_ns=self.now_ns - frame.dispatch_ns,
            queued=frame.queued,
        )
        generated = self.scheduler.complete(frame.fence, records, timing)
        self.frames += 1
        for record in self.scheduler.drain_trace():
            self.trace.append(record.to_json())
        for g in generated:
            stats = self.requests[g.handle.id]
            stats.output_tokens += len(g.tokens)
            stats.cached_tokens = g.cached_tokens
            stats.publications_ns.append(self.now_ns)
            self.scheduler.published_output(g.handle, g.fence, self.now_ns)
            if g.finished:
                stats.finished_ns = self.now_ns

    def run(
        self,
        *,
        until_ns: int | None = None,
        max_frames: int | None = None,
        stop: Callable[[Simulation], bool] | None = None,
    ) -> Simulation:
        while not self.done:
            if until_ns is not None and self.now_ns >= until_ns:
                break
            if max_frames is not None and self.frames >= max_frames:
                break
            if stop is not None and stop(self):
                break
            if not self.step():
                break
        return self
