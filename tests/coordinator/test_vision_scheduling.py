"""Vision in the scheduler (runtime.coordinator.vision, vision_select,
vision_checks; docs/vision.md, "Scheduling"): whole-image windows bounded by
the feature storage, vision frames populating the active window, prefill that
never splits an image span nor crosses into a window not yet populated,
window transitions through a private snapshot row (snapshot, then restore into
a fresh generation), the vision/prefill pair search against running decoders,
and image digests in the prefix cache's page keys."""

from __future__ import annotations

import copy
import itertools
import random

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.errors import CommitError, SchedulerError
from runtime.coordinator.plan import LanePhase, ScheduledPlan
from runtime.coordinator.prerequisites import sequence_rate
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from runtime.coordinator.vision_select import choose_cohort
from runtime.image_spans import ImageSpan, VisionStorage, fit_chunk

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
    return COST_MS[(desc.kind, desc.batch_capacity, desc.prompt_capacity)]


def digest(n: int) -> str:
    return f"{n:064x}"


def spans(*starts: int, length: int = 40, first_digest: int = 1) -> tuple[ImageSpan, ...]:
    return tuple(ImageSpan(s, length, digest(first_digest + i)) for i, s in enumerate(starts))


class Sim:
    """Drives the scheduler with measured costs; checks every image plan it runs."""

    def __init__(self, window_rows: int = 40, window_slots: int = 4, measured: bool = True):
        config = SchedulerConfig(
            max_slots=8, page_size=16, num_pages=512, debug_page_accounting=True,
            vision=VisionStorage(window_slots, window_rows),
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
            if self.step() is None and not self.s.waiting and not self.s.running:
                if not self.s._res.resident:
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
        assert plan.graph.kind is not GraphKind.MIXED
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


# ---------------------------------------------------------------------------
# (1) a request spanning three windows


def test_three_windows_complete_like_one_window():
    images = spans(20, 80, 140)  # 40 rows each: three windows of 40 rows, or one of 128
    runs = {}
    for rows in (40, 128):
        sim = Sim(window_rows=rows)
        h = sim.admit(200, 4, images, seed=3)
        r = sim.s.request(h)
        assert r is not None and r.vision is not None
        assert r.vision.windows_left == (3 if rows == 40 else 1)
        row = r.vision.snapshot_row
        assert (row >= 0) == (rows == 40)  # reserved once at residency when several windows
        free_rows = list(sim.s._windows.free_rows)
        rows_seen = set()
        while sim.s.request(h) is not None:
            sim.step()
            r = sim.s.request(h)
            if r is not None and r.vision is not None and r.vision.snapshot_row >= 0:
                rows_seen.add(r.vision.snapshot_row)
        assert sim.out[h.id] == [7] * 4
        chunks = sim.prompt_chunks(h)
        assert sum(t for _, t in chunks) == 200  # every prompt token consumed once
        starts = list(itertools.accumulate([0] + [t for _, t in chunks]))[:-1]
        assert [s for s, _ in chunks] == starts  # in order, none repeated
        runs[rows] = (chunks, sim)
        kinds = [p.graph.kind for p in sim.plans]
        vision = [p for p in sim.plans if p.graph.kind is GraphKind.VISION]
        assert sum(len(p.vision_images) for p in vision) == 3  # each image encoded once
        if rows == 40:
            assert rows_seen == {row}  # the one private row, through every window
            phases = [p.lanes[0].phase for p in sim.plans]
            assert phases.count(LanePhase.WINDOW_SNAPSHOT) == 2
            assert phases.count(LanePhase.WINDOW_RESTORE) == 2 == kinds.count(GraphKind.RESTORE)
            # each window's vision writes from offset zero
            assert [im.offset for p in vision for im in p.vision_images] == [0, 0, 0]
            phases = [v[0] for v in sim.cache_versions]
            assert phases == [LanePhase.WINDOW_SNAPSHOT, LanePhase.WINDOW_RESTORE] * 2
            # private window snapshots publish nothing
            assert all(before == after for _, before, after in sim.cache_versions)
            gens = {p.lanes[0].generation for p in sim.plans if p.lanes[0].handle == h}
            assert len(gens) == 3  # a fresh request generation per window
        else:
            assert GraphKind.SNAPSHOT not in kinds[:-1] and GraphKind.RESTORE not in kinds
            assert sorted(im.offset for p in vision for im in p.vision_images) == [0, 40, 80]
        assert sim.s._windows.free_rows == sorted(free_rows + ([row] if row >= 0 else []))
        assert len(sim.s._windows.free_windows) == 4  # every window slot back
    # the same committed prompt consumption, whatever the windows
    assert sum(t for _, t in runs[40][0]) == sum(t for _, t in runs[128][0]) == 200


def test_window_transition_stages_and_checks():
    sim = Sim(window_rows=40)
    h = sim.admit(120, 2, spans(10, 60), seed=5)
    seen = []
    while sim.s.request(h) is not None:
        plan = sim.step()
        if plan is not None:
            seen.append((plan.graph.kind, plan.lanes[0].phase))
    assert seen[:4] == [
        (GraphKind.VISION, LanePhase.VISION),
        (GraphKind.PREFILL, LanePhase.PREFILL),
        (GraphKind.SNAPSHOT, LanePhase.WINDOW_SNAPSHOT),
        (GraphKind.RESTORE, LanePhase.WINDOW_RESTORE),
    ]
    assert (GraphKind.VISION, LanePhase.VISION) == seen[4]


def test_admission_refuses_what_cannot_run():
    s = Scheduler(list(CATALOG), SchedulerConfig(max_slots=4))  # no feature storage
    with pytest.raises(SchedulerError, match="no vision programs or no image-feature storage"):
        s.admit(RequestSpec(100, 2, images=spans(10)))
    sim = Sim(window_rows=32)
    with pytest.raises(SchedulerError, match="exceed the window"):
        sim.s.admit(RequestSpec(100, 2, images=spans(10)))
    no_state = tuple(d for d in CATALOG if d.kind not in (GraphKind.SNAPSHOT, GraphKind.RESTORE))
    s = Scheduler(list(no_state), SchedulerConfig(vision=VisionStorage(2, 40)))
    with pytest.raises(SchedulerError, match="snapshot and restore programs"):
        s.admit(RequestSpec(200, 2, images=spans(20, 80)))
    s.admit(RequestSpec(200, 2, images=spans(20)))  # one window needs no transition
