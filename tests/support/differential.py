"""Random scheduler states for the differential test of selection (issue 25).

:class:`Explorer` drives a real :class:`~runtime.coordinator.scheduler.Scheduler`
through random events and, before every ``plan()``, asks both the scheduler and
the reference (:func:`tests.support.reference.planning.reference_plan`) what to
run: a *state* is one such comparison.  The events cover what selection reads:

* catalogs of every program kind: prefill buckets (packed ones too), decode batches, width-one
  and wide mixed shapes, rectangular, ragged and device-allocated speculative
  programs, restore and snapshot programs (with a page pool small enough to
  preempt, so restores happen);
* arrivals, cancellations, plans committed one or two deep (a queued frame the
  next plan projects through), completions in order with random device
  intervals (sometimes none, sometimes a readiness stall, sometimes a host wall
  time longer than the device's), random acceptance, a confidence sidecar for
  device-allocated rounds and survival rows now and then, publication now or
  later, and time jumps past the estimates' freshness (stale entries, refresh
  credit, probe credit);
* both policy presets and fixed-width execution.

Nothing here times anything: time is simulated.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PRESETS, SchedulerConfig
from runtime.coordinator.plan import LanePhase, ScheduledPlan
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.rounds import device_allocation
from runtime.coordinator.scheduler import Scheduler
from tests.support.reference.planning import plan_differences, reference_plan

MS = 1_000_000
BATCHES = (1, 2, 4, 8, 16)


def random_catalog(rng: random.Random, speculation: bool, states: bool) -> list[GraphDescriptor]:
    """A catalog with a random subset of every kind the flags allow."""
    out = [
        GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=c)
        for c in (64, 128, 256, 512)
        if c == 64 or rng.random() < 0.6
    ]
    if rng.random() < 0.5:  # packed prefill programs
        for b in (2, 4):
            out += [
                GraphDescriptor(GraphKind.PREFILL, b, prompt_capacity=c)
                for c in (64, 128, 256)
                if rng.random() < 0.5
            ]
    batches = [b for b in BATCHES if b == 1 or rng.random() < 0.7]
    out += [GraphDescriptor(GraphKind.DECODE, b) for b in batches]
    for b in batches:
        if b >= 2 and rng.random() < 0.5:
            for c in (64, 256):
                out.append(GraphDescriptor(GraphKind.MIXED, b, prompt_capacity=c))
    if speculation:
        widths = sorted(rng.sample((2, 3, 4, 5), rng.randint(1, 3)))
        for b in batches:
            for w in widths:
                if b == 1 or rng.random() < 0.8:  # without it, a ragged one may be the largest
                    out.append(GraphDescriptor(GraphKind.SPECULATIVE, b, w, w - 1))
                if b >= 2 and rng.random() < 0.5:  # ragged, host-allocated
                    p = rng.randint(b, b * w - 1)
                    out.append(GraphDescriptor(GraphKind.SPECULATIVE, b, w, w - 1, p))
                if rng.random() < 0.3:  # device-allocated (prefix limits)
                    p = rng.randint(b, b * w)
                    out.append(GraphDescriptor(GraphKind.SPECULATIVE, b, w, w - 1, p, 0, True))
            if b >= 2 and rng.random() < 0.3:
                w = widths[-1]
                out.append(GraphDescriptor(GraphKind.MIXED, b, w, w - 1, 0, 64))
    if states:
        out += [GraphDescriptor(GraphKind.SNAPSHOT, b) for b in (1, 4) if rng.random() < 0.8]
        out += [GraphDescriptor(GraphKind.RESTORE, b) for b in (1, 2) if rng.random() < 0.8]
    return list(dict.fromkeys(out))  # duplicates (a ragged P drawn twice) once


def cost_ns(desc: GraphDescriptor) -> int:
    """A synthetic device interval: a floor, the rows, the prompt, the draft depth."""
    if desc.kind in (GraphKind.SNAPSHOT, GraphKind.RESTORE):
        return int((0.4 + 0.05 * desc.batch_capacity) * MS)
    rows = desc.target_capacity + desc.prompt_capacity
    packed = 0.05 * (desc.batch_capacity - 1) if desc.kind is GraphKind.PREFILL else 0.0
    return int((3.0 + 0.02 * rows + 0.5 * desc.proposal_depth + packed) * MS)


@dataclass
class Explorer:
    """One random scheduler and the events that move it (module docstring)."""

    seed: int
    speculation: bool = True
    states: bool = True
    compared: int = 0  # states compared so far
    differences: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = self.rng = random.Random(self.seed)
        catalog = random_catalog(rng, self.speculation, self.states)
        widths = sorted({d.token_capacity for d in catalog if d.kind is GraphKind.SPECULATIVE})
        fixed = rng.choice(widths) if widths and rng.random() < 0.25 else 0
        config = SchedulerConfig(
            max_slots=rng.choice((4, 8, 16)),
            page_size=16,
            num_pages=rng.choice((24, 48, 4096)),  # small pools preempt: restores
            fixed_speculative_width=fixed,
            proposer=rng.choice(("draft", "copy")),
        )
        policy = PRESETS[rng.choice(("balanced", "throughput"))]
        self.s = Scheduler(catalog, config, policy)
        self.now = 0
        self.fence = 0
        self.inflight: deque[tuple[int, ScheduledPlan, int]] = deque()
        self.unpublished: list = []  # generated bursts not yet published
        self.accept: dict[int, float] = {}
        self.handles: list = []
        if self.speculation and rng.random() < 0.5 and self.s.speculation is not None:
            depth = max(d.token_capacity - 1 for d in catalog if d.kind is GraphKind.SPECULATIVE)
            self.s.speculation.preseed(config.proposer, [0.9**d for d in range(1, depth + 1)])

    # ------------------------------------------------------------------ events
    def admit(self) -> None:
        rng = self.rng
        prompt = rng.choice((1, 5, 16, 40, 64, 100, 200))
        output = rng.choice((1, 2, 3, 8, 20, 60))
        if (prompt + output + 15) // 16 > self.s.config.num_pages:
            return
        group = rng.choice((None, None, 1, 2))
        # Named tokens (preemption needs them), a shared system prompt now and then.
        shared = (7,) * min(prompt, 32) if rng.random() < 0.3 else ()
        tokens = shared + tuple(rng.randrange(50_000) for _ in range(prompt - len(shared)))
        handle = self.s.admit(RequestSpec(prompt, output, group=group, prompt_tokens=tokens))
        self.accept[handle.id] = rng.choice((0.05, 0.5, 0.9))
        self.handles.append(handle)

    def compare(self) -> ScheduledPlan | None:
        """The scheduler's plan, checked against the reference's."""
        s = self.s
        before = s._next_plan
        fast = s.plan()
        ref = reference_plan(s)
        self.compared += 1
        for line in plan_differences(fast, ref):
            self.differences.append(f"seed {self.seed} state {self.compared}: {line}")
        assert s._next_plan == before + (fast is not None)
        return fast

    def dispatch(self) -> None:
        plan = self.compare()
        if plan is None:
            return
        if self.rng.random() < 0.1 and not self.inflight:
            return  # planned and not committed: the next state differs only in time
        self.fence += 1
        self.s.commit(plan, self.fence)
        start = max([self.now] + [end for *_, end in self.inflight])
        self.inflight.append((self.fence, plan, start + cost_ns(plan.graph)))

    def complete(self) -> None:
        rng = self.rng
        fence, plan, end = self.inflight.popleft()
        self.now = max(self.now, end)
        self.s.advance_to(self.now)
        device = cost_ns(plan.graph)
        if rng.random() < 0.05:
            device = 0  # no device interval: nothing measured, the wall time pays
        stall = device // 10 if rng.random() < 0.2 else 0
        wall = device + (rng.randint(0, 3 * MS) if rng.random() < 0.3 else 0)
        timing = ExecutionTiming(
            (device, max(0, device - rng.randint(0, MS))) if device else (0,),
            readiness_delay_ns=stall,
            host_wall_ns=max(wall, 1),
            queued=bool(self.inflight),
        )
        records, sidecar = self._records(plan)
        survival = None
        speculative = plan.graph.kind is GraphKind.SPECULATIVE and plan.graph.proposal_depth > 0
        if speculative and rng.random() < 0.3:
            survival = [self._survival_row(plan.graph.proposal_depth) for _ in plan.lanes]
        s = self.s
        if sidecar is not None and survival is not None:
            out = s.complete_packed_round_with_survival(fence, records, timing, sidecar, survival)
        elif sidecar is not None:
            out = s.complete_packed_round(fence, records, timing, sidecar)
        elif survival is not None:
            out = s.complete_with_survival(fence, records, timing, survival)
        else:
            out = s.complete(fence, records, timing)
        for g in out:
            if g.tokens or g.finished:
                self.unpublished.append(g)
        if rng.random() < 0.8:
            self.publish()

    def publish(self) -> None:
        for g in self.unpublished:
            if g.tokens:
                self.s.published_output(g.handle, g.fence, self.now)
        self.unpublished = []

    def _survival_row(self, depth: int) -> list[float]:
        row, s = [], 1.0
        for _ in range(depth):
            s *= self.rng.random()
            row.append(s)
        return row

    def _records(self, plan: ScheduledPlan):
        """Each lane's committed tokens; a device-allocated round's sidecar too."""
        rng = self.rng
        graph = plan.graph
        rows = [lane.max_tokens for lane in plan.lanes]
        sidecar = None
        if graph.device_allocated:
            joint = [self._survival_row(graph.proposal_depth) for _ in plan.lanes]
            conditional = [
                [row[0]] + [b / a if a > 0 else 0.0 for a, b in pairwise(row)] for row in joint
            ]
            sidecar = [conditional, joint]
            slots = [lane.slot for lane in plan.lanes]
            rows = device_allocation(joint, rows, slots, graph.target_capacity)
        records = []
        for lane, q in zip(plan.lanes, rows):
            count = lane.max_tokens if not graph.device_allocated else q
            if lane.phase is LanePhase.DECODE and q > 1:
                count = 1
                while count < q and rng.random() < self.accept[lane.handle.id]:
                    count += 1
            tokens = tuple(range(count)) if lane.phase not in (
                LanePhase.RESTORE, LanePhase.TERMINAL) else ()  # fmt: skip
            records.append(CompletionRecord(lane.slot, lane.generation, tokens))
        return records, sidecar

    def step(self) -> None:
        """One random event (and a comparison before every dispatch)."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.15 or not self.handles:
            self.admit()
        elif roll < 0.18 and self.handles:
            self.s.cancel(rng.choice(self.handles))
        elif roll < 0.2:
            self.now += rng.choice((MS, 40 * 1000 * MS))  # now and then past the TTL
            self.s.advance_to(self.now)
        elif len(self.inflight) < 2 and roll < 0.7:
            self.dispatch()
        elif self.inflight:
            self.complete()
        else:
            self.dispatch()

    def run(self, comparisons: int, events: int = 100_000) -> None:
        """Events until ``comparisons`` states were compared (or ``events`` ran)."""
        for _ in range(events):
            if self.compared >= comparisons:
                return
            self.step()
