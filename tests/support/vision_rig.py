"""The vision scheduling rig: a catalog with vision, snapshot and restore
programs, a driver that checks every image plan it runs (no chunk splits a
span, reads only encoded images of the active window, on a prefill program or
a mixed program's prompt row, and its image reads name the right window slot
and offsets)."""

from __future__ import annotations

import random

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.plan import LanePhase, ScheduledPlan
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from runtime.image_spans import ImageSpan, VisionStorage

MS = 1_000_000
CATALOG = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=256),
    GraphDescriptor(GraphKind.PREFILL, 2, prompt_capacity=256),
    GraphDescriptor(GraphKind.DECODE, 1),
    GraphDescriptor(GraphKind.DECODE, 4),
    GraphDescriptor(GraphKind.VISION, 1),
    GraphDescriptor(GraphKind.VISION, 2),
    GraphDescriptor(GraphKind.VISION, 4),
    GraphDescriptor(GraphKind.SNAPSHOT, 1),
    GraphDescriptor(GraphKind.RESTORE, 1),
)
COST_MS = {
    (GraphKind.PREFILL, 1, 64): 2.0,
    (GraphKind.PREFILL, 1, 256): 5.0,
    (GraphKind.PREFILL, 2, 256): 5.5,
    (GraphKind.DECODE, 1, 0): 2.0,
    (GraphKind.DECODE, 4, 0): 3.0,
    (GraphKind.VISION, 1, 0): 1.0,
    (GraphKind.VISION, 2, 0): 1.5,
    (GraphKind.VISION, 4, 0): 2.5,
    (GraphKind.SNAPSHOT, 1, 0): 0.5,
    (GraphKind.RESTORE, 1, 0): 0.5,
}


def cost_ms(desc: GraphDescriptor) -> float:
    key = (desc.kind, desc.batch_capacity, desc.prompt_capacity)
    return COST_MS[key] if key in COST_MS else 1.0 + desc.prompt_capacity / 64


def digest(n: int) -> str:
    return f"{n:064x}"


def spans(*starts: int, length: int = 40, first_digest: int = 1) -> tuple[ImageSpan, ...]:
    return tuple(ImageSpan(s, length, digest(first_digest + i)) for i, s in enumerate(starts))


class Sim:
    """Drives the scheduler with measured costs; checks every image plan it runs."""

    def __init__(
        self, window_rows: int = 40, window_slots: int = 4, measured: bool = True,
        snapshot_rows: int = 0, num_pages: int = 512,
    ) -> None:  # fmt: skip
        config = SchedulerConfig(
            max_slots=8, page_size=16, num_pages=num_pages, debug_page_accounting=True,
            vision=VisionStorage(window_slots, window_rows, snapshot_rows),
        )  # fmt: skip
        self.s = Scheduler(list(CATALOG), config)
        if measured:
            for desc in CATALOG:
                self.s.catalog.observe(desc, int(cost_ms(desc) * MS), 0)
        self.now = 0
        self.fence = 0
        self.out: dict[int, list[int]] = {}
        self.plans: list[ScheduledPlan] = []
        self.cache_versions: list[tuple[LanePhase, int, int]] = []

    def admit(self, prompt_len: int, max_tokens: int, images=(), seed: int = 0, tokens=None):
        rng = random.Random(seed)
        if tokens is None:
            tokens = tuple(rng.randrange(50_000) for _ in range(prompt_len))
        spec = RequestSpec(prompt_len, max_tokens, prompt_tokens=tokens, images=tuple(images))
        handle = self.s.admit(spec)
        self.out[handle.id] = []
        return handle

    def step(self):
        self.now += MS // 10
        self.s.advance_to(self.now)
        plan = self.s.plan()
        if plan is None:
            return None
        self.execute(plan)
        return plan

    def execute(self, plan: ScheduledPlan, cost: int | None = None) -> None:
        s = self.s
        check_image_plan(s, plan)
        self.fence += 1
        version = s._res.cache.version
        s.commit(plan, self.fence)
        self.plans.append(plan)
        records = [
            CompletionRecord(lane.slot, lane.generation, (7,) * lane.max_tokens)
            for lane in plan.lanes
        ]
        cost = int(cost_ms(plan.graph) * MS) if cost is None else cost
        self.now += cost
        s.advance_to(self.now)
        for g in s.complete(self.fence, records, ExecutionTiming((cost,), host_wall_ns=cost)):
            self.out[g.handle.id] += g.tokens
            if g.tokens:
                s.published_output(g.handle, g.fence)
        if plan.lanes[0].phase in (LanePhase.WINDOW_SNAPSHOT, LanePhase.WINDOW_RESTORE):
            self.cache_versions.append((plan.lanes[0].phase, version, s._res.cache.version))

    def run(self, limit: int = 2000) -> None:
        for _ in range(limit):
            idle = self.step() is None and not self.s.waiting and not self.s.running
            if idle and not self.s._res.resident:
                return
        raise AssertionError("the run did not finish")

    def prompt_chunks(self, handle) -> list[tuple[int, int]]:
        return [
            (lane.prompt_start, lane.prompt_tokens)
            for plan in self.plans
            for lane in plan.lanes
            if lane.handle == handle and lane.phase is LanePhase.PREFILL
        ]


def check_image_plan(s: Scheduler, plan: ScheduledPlan) -> None:
    """What every image plan must satisfy before it is committed (test 3)."""
    for i, lane in enumerate(plan.lanes):
        r = s.request(lane.handle)
        if r is None or r.vision is None or lane.phase is not LanePhase.PREFILL:
            continue
        start, end = lane.prompt_start, lane.prompt_start + lane.prompt_tokens
        if plan.graph.kind is GraphKind.MIXED:  # its one prompt row
            assert sum(x.phase is LanePhase.PREFILL for x in plan.lanes) == 1
        for k, span in enumerate(r.spec.images):
            assert not (span.start < end < span.end), "a chunk splits an image span"
            if span.start < end and span.end > start:  # read by this chunk
                assert r.vision.first <= k < r.vision.encoded, "prefill crossed into unencoded"
        reads = [(x.span, x.position, x.rows) for x in plan.image_reads if x.lane == i]
        inside = [
            (k, sp.start, sp.length)
            for k, sp in enumerate(r.spec.images)
            if sp.start >= start and sp.end <= end
        ]
        assert reads == inside
        for x in plan.image_reads:
            if x.lane == i:
                assert x.window_slot == r.vision.window_slot >= 0
                assert x.offset == r.vision.offset(x.span)
