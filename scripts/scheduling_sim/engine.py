"""The event loop: a simulated device executes whatever the scheduler commits.

Frames run back to back on one simulated device in commit order.  A frame's
device interval is its profile cost (optionally jittered by a seeded factor);
every tensor-parallel rank reports that interval, one rank ``slow_rank_factor``
slower if asked.  Completion is observed ``host_delay_ns`` after the device
finishes, and output is published at once (the frontend has nothing to hold
back), so the output age the scheduler sees is the publication time.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

from runtime.catalog import GraphDescriptor
from runtime.coordinator import CompletionRecord, ExecutionTiming, RequestHandle
from scripts.scheduling_sim.workload import Arrival


@dataclass
class RequestStats:
    handle: RequestHandle
    arrival_ns: int
    prompt_len: int
    output_target: int
    publications_ns: list[int] = field(default_factory=list)
    output_tokens: int = 0
    finished_ns: int | None = None

    @property
    def ttft_ns(self) -> int | None:
        return self.publications_ns[0] - self.arrival_ns if self.publications_ns else None

    def gaps_ns(self) -> list[int]:
        p = self.publications_ns
        return [b - a for a, b in pairwise(p)]


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
    ) -> None:
        self.scheduler = scheduler
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
        self.trace: list[dict] = []
        self.busy_ns = 0

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
            handle = self.scheduler.admit(arrival.spec)
            self.requests[handle.id] = RequestStats(
                handle, arrival.at_ns, arrival.spec.prompt_len, arrival.spec.max_output_tokens
            )

    def _dispatch(self) -> None:
        while True:
            plan = self.scheduler.plan()
            if plan is None:
                return
            fence = self.next_fence
            self.next_fence += 1
            self.scheduler.commit(plan, fence)
            cost = self.duration_ns(plan.graph)
            if self.jitter:
                cost = int(cost * (1.0 + self.rng.uniform(-self.jitter, self.jitter)))
            start = max(self.now_ns, self.device_free_ns)
            end = start + cost
            self.device_free_ns = end
            self.busy_ns += cost
            self.inflight.append(
                InFlight(fence, plan, self.now_ns, end, cost, queued=bool(self.inflight))
            )
            name = plan.graph.describe()
            self.frames_by_graph[name] = self.frames_by_graph.get(name, 0) + 1

    def step(self) -> bool:
        """Dispatch what the scheduler wants, then advance to the next event."""
        self._admit_due()
        self._dispatch()
        next_completion = self.inflight[0].end_ns + self.host_delay_ns if self.inflight else None
        next_arrival = self.pending[0].at_ns if self.pending else None
        times = [t for t in (next_completion, next_arrival) if t is not None]
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

    def _complete(self, frame: InFlight) -> None:
        plan = frame.plan
        records = []
        for lane in plan.lanes:
            tokens = tuple(self.rng.randrange(32000) for _ in range(lane.max_tokens))
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
