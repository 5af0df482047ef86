"""Mixed programs as following shapes of vision (issue 27; spec, "Prerequisites
and completion" and the mixed-program paragraph; docs/vision.md, "Scheduling").

(1) a vision frame followed by a mixed program (the newly ready row its prompt
row, the running decoders its decode rows) is chosen exactly when that
sequence has the best rate (a crossover seen from both sides), and the mixed
plan that follows reads the image at its prompt row; (2) the exact cohort
against brute force; (3) random runs: a mixed prompt row with images never
splits a span nor reads an unencoded image; (4) commit refuses those cases,
naming the request."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.errors import CommitError
from runtime.coordinator.plan import LanePhase
from runtime.coordinator.policy import prompt_lane_value
from runtime.coordinator.prerequisites import sequence_rate
from runtime.coordinator.scheduler import Scheduler
from runtime.coordinator.vision_select import VisionCandidate, mixed_cohort
from runtime.image_spans import ImageSpan, fit_chunk
from tests.support.vision_rig import MS, Sim, cost_ms, digest, spans

MIXED = GraphDescriptor(GraphKind.MIXED, 4, prompt_capacity=128)
VISION = GraphDescriptor(GraphKind.VISION, 1)
CATALOG = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=256),
    GraphDescriptor(GraphKind.DECODE, 1),
    GraphDescriptor(GraphKind.DECODE, 4),
    MIXED,
    VISION,
    GraphDescriptor(GraphKind.SNAPSHOT, 1),
    GraphDescriptor(GraphKind.RESTORE, 1),
)


def drive(images=None, window_rows: int = 64) -> tuple[Sim, list, object]:
    """Three decoders streaming, then a request whose prompt opens with an
    image: nothing of it can run before a vision frame."""
    sim = Sim(window_rows=window_rows)
    sim.s = Scheduler(list(CATALOG), sim.s.config)
    for desc in CATALOG:
        sim.s.catalog.observe(desc, int(cost_ms(desc) * MS), 0)
    decoders = [sim.admit(30, 400, seed=10 + i) for i in range(3)]
    while any(len(sim.out[h.id]) < 3 for h in decoders):
        sim.step()
    image = sim.admit(120, 8, spans(0, length=48) if images is None else images, seed=20)
    return sim, decoders, image


def pair_rates(s: Scheduler, ctx) -> tuple[float, float]:
    """The vision frame's pair rates computed from the lanes: with the best
    following prefill shape, and with the mixed shape (the image row its prompt
    row, the B - 1 best decoders beside it, their ages reset at T + F)."""
    (row,) = ctx.vision.rows
    images = row.view.request.spec.images
    t_ms = s.catalog.entries(GraphKind.VISION)[0].estimate_ns / 1e6

    def tokens(capacity: int) -> int:
        return fit_chunk(images, 0, min(capacity, row.reach[1]))

    prefill = max(
        sequence_rate(
            prompt_lane_value(row.view, tokens(e.descriptor.prompt_capacity), ctx.beta),
            t_ms, e.estimate_ns / 1e6, ctx.active_age_price,
        )
        for e in s.catalog.entries(GraphKind.PREFILL)
    )  # fmt: skip
    (entry,) = s.catalog.entries(GraphKind.MIXED)
    f_ms = entry.estimate_ns / 1e6
    best = sorted((v.decode_value for v in ctx.decode), reverse=True)[: MIXED.batch_capacity - 1]
    value = prompt_lane_value(row.view, tokens(MIXED.prompt_capacity), ctx.beta)
    value += sum(v + ctx.decode_age_slope * (t_ms + f_ms) for v in best)
    return prefill, sequence_rate(value, t_ms, f_ms, ctx.active_age_price)


def test_a_vision_mixed_pair_wins_only_with_the_best_rate():
    """Sweep the mixed program's measured cost F: the vision frame paired with
    the mixed program is chosen exactly when that sequence's rate beats both
    the vision/prefill pair and every other candidate; then the mixed plan
    carries the image row as its prompt row and reads the image from its
    window slot at that row."""
    sim, decoders, image = drive()
    seen, followed = [], 0
    for f_ms in (2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 20.0, 40.0):
        trial = copy.deepcopy(sim)
        s = trial.s
        s.catalog.observe(MIXED, int(f_ms * MS), trial.now)
        s.catalog.observe(VISION, int(0.5 * MS), trial.now)
        ctx = s._context()
        cands = s._candidates(ctx)
        assert ctx.decode and not ctx.prefill and not ctx.imaged  # the image blocks it
        prefill_pair, mixed_pair = pair_rates(s, ctx)
        (vision,) = [c for c in cands if isinstance(c, VisionCandidate)]
        assert vision.score == pytest.approx(max(prefill_pair, mixed_pair))
        assert (vision.follow.descriptor.kind is GraphKind.MIXED) == (mixed_pair > prefill_pair)
        alternative = max(c.score for c in cands if c is not vision)
        plan = s.plan()
        wins = plan.graph.kind is GraphKind.VISION and mixed_pair > prefill_pair
        assert wins == (mixed_pair > max(prefill_pair, alternative)), (f_ms, mixed_pair)
        if wins:
            trial.execute(plan, int(0.5 * MS))
            following = s.plan()  # (replanned: the lookahead binds only the vision frame)
            if following.graph.kind is GraphKind.MIXED:
                (row,) = [i for i, x in enumerate(following.lanes) if x.phase is LanePhase.PREFILL]
                assert following.lanes[row].handle == image
                assert {x.handle for x in following.lanes} == {image, *decoders}
                reads = [(x.lane, x.span, x.window_slot, x.offset) for x in following.image_reads]
                assert reads == [(row, 0, 0, 0)]
                trial.execute(following)  # (the rig checks it: span whole, image encoded)
                assert s.request(image).consumed_prompt == following.lanes[row].prompt_tokens
                followed += 1
        seen.append(wins)
    assert True in seen and False in seen  # both sides of the crossover were seen
    assert seen == sorted(seen, reverse=True)  # a cheaper mixed program wins, a dearer loses
    assert followed  # the mixed program did follow, its prompt row reading the image


# ---------------------------------------------------------------------------
# (2) the exact cohort against brute force


def brute(groups, decoders, rows):
    best = None
    for options in groups:
        for _, value in options:
            for n in range(min(rows - 1, len(decoders)) + 1):
                for subset in itertools.combinations(decoders, n):
                    total = value + sum(subset)
                    best = total if best is None else max(best, total)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_mixed_cohort_matches_brute_force(seed):
    rng = random.Random(seed)
    groups = [
        [(j + 1, rng.uniform(-1, 10)) for j in range(rng.randrange(0, 4))]
        for _ in range(rng.randrange(0, 5))
    ]
    decoders = [rng.uniform(-2, 6) for _ in range(rng.randrange(0, 6))]
    rows = rng.choice([1, 2, 4, 8])
    got = mixed_cohort(groups, decoders, rows)
    expected = brute(groups, decoders, rows)
    if expected is None:
        assert got is None
        return
    assert got is not None
    value, (g, o), chosen = got
    assert value == pytest.approx(expected)
    assert len(chosen) <= rows - 1
    assert value == pytest.approx(groups[g][o][1] + sum(decoders[i] for i in chosen))


def test_the_vision_search_matches_brute_force_on_small_instances():
    """Several image rows and the running decoders: per vision shape, the best
    pair's score equals the brute-force best over every following shape, image
    row, image count within the budget and decoder subset."""
    sim, _, _ = drive()
    for i in range(2):
        sim.admit(150, 4, spans(0, 50, length=40, first_digest=10 * i + 5), seed=30 + i)
    s = sim.s
    s.catalog.observe(VISION, int(0.5 * MS), sim.now)
    ctx = s._context()
    cands = [c for c in s._candidates(ctx) if isinstance(c, VisionCandidate)]
    assert len(ctx.vision.rows) == 3 and cands
    t_ms = s.catalog.entries(GraphKind.VISION)[0].estimate_ns / 1e6
    best = None
    for kind in (GraphKind.PREFILL, GraphKind.MIXED):
        for e in s.catalog.entries(kind):
            d, f_ms = e.descriptor, e.estimate_ns / 1e6
            for row in ctx.vision.rows:
                pos, images = row.view.prompt_pos, row.view.request.spec.images
                base = fit_chunk(images, pos, min(d.prompt_capacity, row.reach[0]))
                for j in range(1, min(len(row.images), VISION.batch_capacity) + 1):
                    tokens = fit_chunk(images, pos, min(d.prompt_capacity, row.reach[j]))
                    if tokens <= base:
                        continue
                    value = prompt_lane_value(row.view, tokens, ctx.beta)
                    others = ctx.decode if kind is GraphKind.MIXED else []
                    for n in range(min(d.batch_capacity - 1, len(others)) + 1):
                        for subset in itertools.combinations(others, n):
                            age = ctx.decode_age_slope * (t_ms + f_ms)
                            total = value + sum(v.decode_value + age for v in subset)
                            rate = sequence_rate(total, t_ms, f_ms, ctx.active_age_price)
                            best = rate if best is None else max(best, rate)
    (cand,) = cands
    assert cand.score == pytest.approx(best)


# ---------------------------------------------------------------------------
# (3) random runs: spans whole, windows encoded, on mixed prompt rows too


STRESS = (
    *CATALOG,
    GraphDescriptor(GraphKind.MIXED, 2, prompt_capacity=64),
    GraphDescriptor(GraphKind.VISION, 2),
)


@pytest.mark.parametrize("seed", range(6))
def test_mixed_prompt_rows_never_split_a_span_or_read_unencoded_images(seed):
    """Random prompts with random images beside text decoders, cheap mixed
    programs: every plan passes the rig's check (no chunk splits a span, reads
    only encoded images of the active window, its image reads at the prompt
    row), every request completes, each prompt is consumed exactly once, and
    image rows do run as mixed prompt rows."""
    rng = random.Random(seed)
    sim = Sim(window_rows=96, window_slots=2, measured=False)
    sim.s = Scheduler(list(STRESS), sim.s.config)
    for desc in STRESS:
        cheap = desc.kind is GraphKind.MIXED
        sim.s.catalog.observe(desc, int((0.3 if cheap else cost_ms(desc)) * MS), 0)
    handles = [
        sim.admit(rng.randrange(20, 60), rng.randrange(20, 60), seed=50 + i) for i in range(3)
    ]
    for i in range(6):
        prompt = rng.randrange(80, 300)
        starts, pos = [], rng.randrange(0, 20)
        while True:
            length = rng.randrange(8, 49)
            if pos + length > prompt:
                break
            starts.append((pos, length))
            pos += length + rng.randrange(0, 30)
        images = [ImageSpan(s, n, digest(100 * i + k)) for k, (s, n) in enumerate(starts)]
        handles.append(sim.admit(prompt, rng.randrange(1, 6), images, seed=i))
    sim.run()
    for h in handles:
        assert len(sim.out[h.id]) >= 1
        chunks = sim.prompt_chunks(h)
        starts = list(itertools.accumulate([0] + [t for _, t in chunks]))[:-1]
        assert [s for s, _ in chunks] == starts
    assert len(sim.s._windows.free_windows) == 2
    mixed_reads = [p for p in sim.plans if p.graph.kind is GraphKind.MIXED and p.image_reads]
    assert mixed_reads  # image rows ran as mixed prompt rows, reading their images


# ---------------------------------------------------------------------------
# (4) commit refuses a mixed prompt row that splits a span or reads an unencoded image


def test_commit_refuses_a_mixed_row_splitting_a_span_or_reading_unencoded_images():
    sim, _, image = drive(spans(0, 60, length=40), window_rows=128)
    s = sim.s
    s.catalog.observe(VISION, int(0.5 * MS), sim.now)
    s.catalog.observe(MIXED, int(0.5 * MS), sim.now)
    plan = s.plan()
    assert plan.graph.kind is GraphKind.VISION
    sim.execute(plan, int(0.5 * MS))  # image 0 encoded, image 1 not: the chunk stops at 60
    for _ in range(9):  # a dear vision frame now: the chunk to image 1 runs first
        s.catalog.observe(VISION, 500 * MS, sim.now)
    plan = s.plan()
    assert plan.graph.kind is GraphKind.MIXED
    (row,) = [i for i, x in enumerate(plan.lanes) if x.phase is LanePhase.PREFILL]
    lane = plan.lanes[row]
    assert lane.handle == image and lane.prompt_tokens == 60
    r = s.request(image)
    assert r is not None and r.vision is not None and r.vision.encoded == 1

    def with_tokens(n):
        lanes = list(plan.lanes)
        lanes[row] = dataclasses.replace(lane, prompt_tokens=n)
        return dataclasses.replace(plan, lanes=tuple(lanes))

    with pytest.raises(CommitError, match=f"request {image.id}: the chunk splits an image span"):
        s.commit(with_tokens(20), sim.fence + 1)
    with pytest.raises(CommitError, match=f"request {image.id}: prompt extent out of range"):
        s.commit(with_tokens(100), sim.fence + 1)  # image 1 (60..100) is not encoded
    sim.execute(plan)  # the plan as built commits and runs
    assert s.request(image).consumed_prompt == 60
