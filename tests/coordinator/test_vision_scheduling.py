"""Vision in the scheduler (runtime.coordinator.vision, vision_select,
vision_checks; docs/vision.md, "Scheduling"): whole-image windows bounded by
the feature storage, vision frames populating the active window, prefill that
never splits an image span nor crosses into a window not yet populated,
window transitions through a private snapshot row (snapshot, then restore into
a fresh generation), the vision/prefill pair search against running decoders,
and the commit checks of image rows (the cache keys and the cohort choice:
test_vision_cache.py)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.errors import CommitError, SchedulerError
from runtime.coordinator.plan import LanePhase
from runtime.coordinator.policy import prompt_lane_value
from runtime.coordinator.prerequisites import sequence_rate
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from runtime.image_spans import ImageSpan, VisionStorage, fit_chunk
from tests.support.vision_rig import CATALOG, MS, Sim, cost_ms, digest, spans

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
    assert seen[4] == (GraphKind.VISION, LanePhase.VISION)


def test_a_window_snapshot_waits_for_a_free_private_row():
    """One private snapshot row, two requests of two windows each: the second
    gets no row at residency, waits at its boundary until the first retires,
    then takes the freed row; both complete."""
    sim = Sim(window_rows=40, snapshot_rows=1)
    a = sim.admit(120, 2, spans(10, 60), seed=1)
    b = sim.admit(120, 2, spans(10, 60, first_digest=5), seed=2)
    ra, rb = sim.s.request(a), sim.s.request(b)
    assert ra.vision.snapshot_row == 0 and rb.vision.snapshot_row == -1
    held = []
    sim_requests = (a, b)
    for _ in range(400):
        if all(sim.s.request(h) is None for h in sim_requests):
            break
        sim.step()
        rows = [
            r.vision.snapshot_row
            for r in map(sim.s.request, sim_requests)
            if r is not None and r.vision.snapshot_row >= 0
        ]
        assert len(rows) <= 1
        held.append(tuple(rows))
    assert sim.out[a.id] == [7, 7] and sim.out[b.id] == [7, 7]
    assert sim.s._windows.free_rows == [0]


def test_preempted_image_requests_resume_and_release_their_windows():
    """A small page pool: image requests are preempted, give back their window
    slot and snapshot row, resume (their windows from what they reattach) and
    complete; every plan still keeps spans atomic."""
    sim = Sim(window_rows=64, window_slots=2, num_pages=24)
    handles = [
        sim.admit(150, 60, spans(10, 60, 110, length=30, first_digest=10 * i), seed=i)
        for i in range(4)
    ]
    sim.run(4000)
    assert all(len(sim.out[h.id]) == 60 for h in handles)
    assert sim.s.memory_stats()["preemptions"] > 0
    assert len(sim.s._windows.free_windows) == 2
    assert len(sim.s._windows.free_rows) == sim.s._windows.snapshot_rows


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
    small = (
        GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
        GraphDescriptor(GraphKind.DECODE, 1),
        GraphDescriptor(GraphKind.VISION, 1),
    )
    s = Scheduler(list(small), SchedulerConfig(vision=VisionStorage(2, 128)))
    with pytest.raises(SchedulerError, match="exceeds the largest prefill chunk"):
        s.admit(RequestSpec(200, 2, images=spans(20, length=80)))


# ---------------------------------------------------------------------------
# (2) vision/prefill pairs against running decoders: the crossover


PAIR_CATALOG = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=256),
    GraphDescriptor(GraphKind.DECODE, 1),
    GraphDescriptor(GraphKind.DECODE, 4),
    GraphDescriptor(GraphKind.VISION, 1),
    GraphDescriptor(GraphKind.SNAPSHOT, 1),
    GraphDescriptor(GraphKind.RESTORE, 1),
)


def drive_to_vision() -> tuple[Sim, list, object]:
    """Three decoders streaming, then a request whose prompt opens with an
    image: nothing of it can run before a vision frame."""
    sim = Sim(window_rows=64)
    sim.s = Scheduler(list(PAIR_CATALOG), sim.s.config)
    for desc in PAIR_CATALOG:
        if desc.kind is not GraphKind.VISION:
            sim.s.catalog.observe(desc, int(cost_ms(desc) * MS), 0)
    decoders = [sim.admit(30, 400, seed=10 + i) for i in range(3)]
    while any(len(sim.out[h.id]) < 3 for h in decoders):
        sim.step()
    image = sim.admit(120, 8, spans(0, length=48), seed=20)
    return sim, decoders, image


def test_a_vision_pair_wins_only_with_enough_value_per_time():
    """The snapshot-cost check's counterpart for vision: sweep the vision
    frame's measured cost T; the vision frame (followed by the prefill it
    enables) is chosen exactly when that sequence's value per time, with the
    decoders' waiting cost over T + F, beats the decoders' own round; a chosen
    vision frame does enable that prefill, which reads the image from its slot."""
    sim, _, image = drive_to_vision()
    chosen = []
    for t_ms in (0.05, 0.5, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 200.0):
        trial = copy.deepcopy(sim)
        s = trial.s
        vision = next(d for d in PAIR_CATALOG if d.kind is GraphKind.VISION)
        s.catalog.observe(vision, int(t_ms * MS), trial.now)
        ctx = s._context()
        cands = s._candidates(ctx)
        assert ctx.decode and not ctx.prefill and not ctx.imaged  # the image blocks it
        others = [c for c in cands if c.entry.descriptor.kind is not GraphKind.VISION]
        alternative = max(c.score for c in others)
        # The pair, computed from the lane: the best following prefill shape.
        (row,) = ctx.vision.rows
        pair = max(
            sequence_rate(
                prompt_value(row.view, fit_chunk(row.view.request.spec.images, 0,
                             min(e.descriptor.prompt_capacity, row.reach[1])), ctx.beta),
                t_ms, e.estimate_ns / 1e6, ctx.active_age_price,
            )
            for e in s.catalog.entries(GraphKind.PREFILL)
        )  # fmt: skip
        plan = s.plan()
        wins = plan.graph.kind is GraphKind.VISION
        assert wins == (pair > alternative), (t_ms, pair, alternative)
        if wins:
            assert plan.estimated_duration_ns == int(t_ms * MS)  # T only: no lookahead time
            assert [(im.handle, im.span, im.window_slot, im.offset) for im in plan.vision_images] \
                == [(image, 0, 0, 0)]  # fmt: skip
            trial.execute(plan, int(t_ms * MS))
            following = s.plan()
            assert following.graph.kind is GraphKind.PREFILL
            assert [lane.handle for lane in following.lanes] == [image]
            assert [(x.span, x.window_slot, x.offset) for x in following.image_reads] == [(0, 0, 0)]
        chosen.append(wins)
    assert True in chosen and False in chosen  # both sides of the crossover were seen
    assert chosen == sorted(chosen, reverse=True)  # cheaper vision wins, dearer loses


def prompt_value(view, tokens, beta):
    return prompt_lane_value(view, tokens, beta)


def test_vision_frames_drain_the_window_and_commit_no_token():
    sim, _, image = drive_to_vision()
    vision = next(d for d in PAIR_CATALOG if d.kind is GraphKind.VISION)
    sim.s.catalog.observe(vision, int(0.5 * MS), sim.now)
    plan = sim.s.plan()
    assert plan.graph.kind is GraphKind.VISION and plan.requires_empty_window
    assert all(lane.max_tokens == 0 and lane.prompt_tokens == 0 for lane in plan.lanes)
    fence = sim.fence + 1
    sim.s.commit(plan, fence)
    record = CompletionRecord(plan.lanes[0].slot, plan.lanes[0].generation, (5,))
    with pytest.raises(Exception, match="tokens"):
        sim.s.complete(fence, [record], ExecutionTiming((MS,), host_wall_ns=MS))
    record = CompletionRecord(plan.lanes[0].slot, plan.lanes[0].generation, ())
    assert sim.s.complete(fence, [record], ExecutionTiming((MS,), host_wall_ns=MS)) == []
    r = sim.s.request(image)
    assert r is not None and r.vision is not None and r.vision.encoded == 1


def test_commit_refuses_stale_or_foreign_image_plans():
    sim, _, _ = drive_to_vision()
    vision = next(d for d in PAIR_CATALOG if d.kind is GraphKind.VISION)
    sim.s.catalog.observe(vision, int(0.5 * MS), sim.now)
    plan = sim.s.plan()
    assert plan.graph.kind is GraphKind.VISION
    im = plan.vision_images[0]
    bad = dataclasses.replace(plan, vision_images=(dataclasses.replace(im, offset=8),))
    with pytest.raises(CommitError, match="offset"):
        sim.s.commit(bad, sim.fence + 1)
    bad = dataclasses.replace(plan, vision_images=(dataclasses.replace(im, window_slot=99),))
    with pytest.raises(CommitError, match="window slot"):
        sim.s.commit(bad, sim.fence + 1)
    bad = dataclasses.replace(plan, vision_images=())
    with pytest.raises(CommitError, match="images"):
        sim.s.commit(bad, sim.fence + 1)


# ---------------------------------------------------------------------------
# (3) atomic spans and populated windows, under load


STRESS_CATALOG = (
    *CATALOG,
    GraphDescriptor(GraphKind.MIXED, 2, prompt_capacity=64),
    GraphDescriptor(GraphKind.DECODE, 2),
)


@pytest.mark.parametrize("seed", range(4))
def test_no_chunk_splits_a_span_or_reads_an_unpopulated_window(seed):
    """Random prompts with random images (several windows each), text requests
    beside them, a mixed shape in the catalog: every plan passes
    ``check_image_plan`` (no chunk splits a span, reads only encoded images of
    the active window, its reads at its prompt row), every request completes, and each
    prompt is consumed exactly once."""
    rng = random.Random(seed)
    sim = Sim(window_rows=64, window_slots=2, measured=False)
    sim.s = Scheduler(list(STRESS_CATALOG), sim.s.config)
    handles = []
    for i in range(6):
        prompt = rng.randrange(80, 400)
        starts, pos = [], rng.randrange(0, 20)
        while True:
            length = rng.randrange(8, 49)
            if pos + length > prompt:
                break
            starts.append((pos, length))
            pos += length + rng.randrange(0, 30)
        images = [ImageSpan(s, n, digest(100 * i + k)) for k, (s, n) in enumerate(starts)]
        handles.append(sim.admit(prompt, rng.randrange(1, 6), images if i % 3 else (), seed=i))
    sim.run()
    for h in handles:
        assert len(sim.out[h.id]) >= 1
        chunks = sim.prompt_chunks(h)
        starts = list(itertools.accumulate([0] + [t for _, t in chunks]))[:-1]
        assert [s for s, _ in chunks] == starts
    assert len(sim.s._windows.free_windows) == 2
    assert len(sim.s._windows.free_rows) == sim.s._windows.snapshot_rows
    assert any(p.graph.kind is GraphKind.VISION for p in sim.plans)


@pytest.mark.parametrize("seed", [0, 5, 13, 57, 77])
def test_random_pools_windows_and_rows_never_stall(seed):
    """Random page pools (preemption), window slots, window sizes, snapshot rows
    and measured or unmeasured costs: every request completes and every window
    slot and snapshot row comes back."""
    rng = random.Random(seed)
    pages = rng.choice([20, 24, 32, 48])
    sim = Sim(
        window_rows=rng.choice([48, 64, 128]), window_slots=rng.choice([1, 2, 4]),
        num_pages=pages, snapshot_rows=rng.choice([0, 1, 2]), measured=False,
    )  # fmt: skip
    sim.s = Scheduler(list(STRESS_CATALOG), sim.s.config)
    if rng.random() < 0.5:
        for desc in STRESS_CATALOG:
            sim.s.catalog.observe(desc, int(cost_ms(desc) * MS), 0)
    handles = []
    for i in range(rng.randrange(2, 7)):
        prompt = rng.randrange(60, 250)
        starts, pos = [], rng.randrange(0, 20)
        while True:
            length = rng.randrange(8, 45)
            if pos + length > prompt:
                break
            starts.append((pos, length))
            pos += length + rng.randrange(0, 30)
        images = [ImageSpan(s, n, digest(100 * i + k)) for k, (s, n) in enumerate(starts)]
        output = rng.randrange(1, 40)
        handles.append(sim.admit(prompt, output, images if i % 3 else (), seed=seed * 10 + i))
    sim.run(6000)
    assert all(sim.out[h.id] for h in handles)
    store = sim.s._windows
    assert len(store.free_windows) == store.storage.window_slots
    assert len(store.free_rows) == store.snapshot_rows
