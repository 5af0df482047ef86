"""Prerequisite lookahead and unmeasured following shapes
(runtime.coordinator.exploration; docs/prerequisites.md, "Unmeasured following
shapes"), and a restore that enables an image request's prompt paying for its
images (the chain's continuation includes the remaining image operations).

A pair whose following shape is unmeasured is indeterminate and wins over
every measured candidate.  Only the prerequisite executes, so when that
following shape is one single-graph selection never runs, the pair stayed
indeterminate for ever: every vision frame and every admission restore of its
kind was a "discovery" that discovered nothing, ahead of all measured work.
"""

from __future__ import annotations

import random

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.cost import CostEntry
from runtime.coordinator.exploration import dominated_unmeasured
from runtime.coordinator.plan import SelectionReason
from runtime.coordinator.prerequisites import sequence_rate
from tests.support.vision_rig import CATALOG, MS, Sim, cost_ms, spans

PREFILL_1_64 = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
PREFILL_1_256 = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=256)
PREFILL_2_256 = GraphDescriptor(GraphKind.PREFILL, 2, prompt_capacity=256)


def _sim(unmeasured=(), costs=None) -> Sim:
    """The rig's scheduler with every program measured (``costs`` overriding the
    rig's, in ms) but ``unmeasured``."""
    sim = Sim(window_rows=64, measured=False)
    for desc in CATALOG:
        if desc not in unmeasured:
            ms = (costs or {}).get(desc, cost_ms(desc))
            sim.s.catalog.observe(desc, int(ms * MS), 0)
    return sim


def _run(sim: Sim, limit: int = 2000) -> list[tuple[SelectionReason, bool, GraphKind]]:
    """Run to idle; per plan its reason, whether its graph was measured when it
    was chosen, and its kind."""
    out = []
    for _ in range(limit):
        sim.now += MS // 10
        sim.s.advance_to(sim.now)
        plan = sim.s.plan()
        if plan is None:
            if not sim.s.waiting and not sim.s.running and not sim.s._res.resident:
                return out
            continue
        out.append((plan.reason, sim.s.catalog.entry(plan.graph).known, plan.graph.kind))
        sim.execute(plan)
    raise AssertionError("the run did not finish")


def _lookahead_discoveries(plans) -> list[GraphKind]:
    """Plans chosen as discovery although the graph they run was measured."""
    return [kind for reason, known, kind in plans if reason is SelectionReason.DISCOVERY and known]


# ---------------------------------------------------------------------------
# The rule


def _entry(desc: GraphDescriptor, ms: float = 0.0) -> CostEntry:
    entry = CostEntry(desc)
    if ms:
        entry.observe(int(ms * MS), 0, 10**12)
    return entry


def test_an_unmeasured_shape_is_dominated_only_by_a_smaller_shape_doing_its_work():
    small, large, packed = _entry(PREFILL_1_64, 2.0), _entry(PREFILL_1_256), _entry(PREFILL_2_256)
    family = [small, large, packed]
    assert dominated_unmeasured(family, large, 1, 40)  # C=64 holds a 40-token chunk
    assert not dominated_unmeasured(family, large, 1, 65)  # it does not hold 65
    assert dominated_unmeasured(family, packed, 1, 200)  # one row: the single C=256
    assert not dominated_unmeasured(family, packed, 2, 200)  # two rows: nothing smaller
    measured_large = _entry(PREFILL_1_256, 5.0)
    assert not dominated_unmeasured([small, measured_large], measured_large, 1, 40)
    # Another width, depth or target layout is other work.
    rect = _entry(GraphDescriptor(GraphKind.SPECULATIVE, 4, 4, 3))
    ragged = _entry(GraphDescriptor(GraphKind.SPECULATIVE, 2, 4, 3, 4), 3.0)
    narrow = _entry(GraphDescriptor(GraphKind.SPECULATIVE, 2, 2, 1), 3.0)
    assert not dominated_unmeasured([rect, ragged, narrow], rect, 2, 0)
    same = _entry(GraphDescriptor(GraphKind.SPECULATIVE, 2, 4, 3), 3.0)
    assert dominated_unmeasured([rect, ragged, same], rect, 2, 0)
    assert not dominated_unmeasured([rect, same], rect, 3, 0)
    decode8, decode4 = (
        _entry(GraphDescriptor(GraphKind.DECODE, 8)),
        _entry(GraphDescriptor(GraphKind.DECODE, 4), 2.0),
    )
    assert dominated_unmeasured([decode4, decode8], decode8, 4, 0)
    assert not dominated_unmeasured([decode4, decode8], decode8, 5, 0)


# ---------------------------------------------------------------------------
# Vision pairs


def _start_decoder(sim: Sim):
    """A request decoding throughout (its prompt prefilled alone)."""
    handle = sim.admit(20, 300, seed=99)
    for _ in range(50):
        sim.step()
        r = sim.s.request(handle)
        if r is not None and r.decoding:
            return handle
    raise AssertionError("the decoder did not start")


def test_vision_frames_are_not_discoveries_for_a_shape_that_never_runs():
    """One image request at a time beside a decoder: the packed PREFILL B=2 is
    never run for one row, so its being unmeasured must not make every vision
    frame an indeterminate pair (it did before the rule: 4 of 4)."""
    sim = _sim(unmeasured=(PREFILL_2_256,))
    _start_decoder(sim)
    plans = []
    for i in range(4):
        handle = sim.admit(100, 2, spans(20, length=40, first_digest=10 + i), seed=i)
        for _ in range(400):
            plan = sim.step()
            if plan is not None:
                plans.append((plan.reason, plan.graph.kind))
            if sim.out[handle.id]:
                break
        assert sim.out[handle.id], f"image request {i} produced no token"
    kinds = [kind for _, kind in plans]
    assert kinds.count(GraphKind.VISION) >= 4
    assert not any(
        reason is SelectionReason.DISCOVERY and kind is GraphKind.VISION for reason, kind in plans
    )


# ---------------------------------------------------------------------------
# Restore pairs


def _shared_prefix_prompts(n: int, shared: int = 32, length: int = 40):
    rng = random.Random(5)
    prefix = tuple(rng.randrange(50_000) for _ in range(shared))
    return [prefix + tuple(rng.randrange(50_000) for _ in range(length - shared)) for _ in range(n)]


def test_admission_restores_are_not_discoveries_for_a_capacity_never_run():
    """Prompts sharing two cached pages: each admission restores them and its
    8-token rest fits PREFILL C=64, so the unmeasured C=256 never runs; the
    restore pairs must be ordinary (before the rule each was a discovery)."""
    sim = _sim(unmeasured=(PREFILL_1_256,))
    prompts = _shared_prefix_prompts(4)
    plans = []
    for tokens in prompts:
        sim.admit(len(tokens), 2, tokens=tokens)
        plans += _run(sim)
    restores = [kind for _, _, kind in plans if kind is GraphKind.RESTORE]
    assert len(restores) >= 3  # every admission after the first restores
    assert _lookahead_discoveries(plans) == []


def test_a_capacity_that_does_run_is_still_discovered_through_a_restore():
    """The rule leaves out only dominated shapes: a 100-token rest after the
    cached pages needs C=256, so the unmeasured C=256 is explored, measured, and
    no later decision is a discovery."""
    sim = _sim(unmeasured=(PREFILL_1_256,))
    prompts = _shared_prefix_prompts(3, length=132)
    plans = []
    for tokens in prompts:
        sim.admit(len(tokens), 2, tokens=tokens)
        plans += _run(sim)
    assert sim.s.catalog.entry(PREFILL_1_256).known  # discovered
    # (at most one lookahead discovery before it is measured)
    assert len(_lookahead_discoveries(plans)) <= 1


# ---------------------------------------------------------------------------
# An image request's restore pays for its images


def _restore_candidate_of_image_request(vision_ms: float):
    costs = {d: vision_ms for d in CATALOG if d.kind is GraphKind.VISION}
    sim = _sim(costs=costs)
    rng = random.Random(3)
    prefix = tuple(rng.randrange(50_000) for _ in range(32))
    first = prefix + tuple(rng.randrange(50_000) for _ in range(64))
    sim.admit(96, 2, spans(32, length=40, first_digest=1), tokens=first)
    _run(sim)  # its pages before the image are published
    _start_decoder(sim)
    second = prefix + tuple(rng.randrange(50_000) for _ in range(64))
    handle = sim.admit(96, 2, spans(32, length=40, first_digest=2), tokens=second)
    r = sim.s.request(handle)
    assert r is not None and r.consumed_prompt == 32 and r.vision is not None
    sim.now += MS // 10
    sim.s.advance_to(sim.now)
    ctx = sim.s._context()
    cands = [
        c
        for c in sim.s._candidates(ctx)
        if c.entry.descriptor.kind is GraphKind.RESTORE
        and any(v.request.handle == handle for v in c.lanes)
    ]
    assert cands
    return sim, max(cands, key=lambda c: c.rank_key()), ctx


@pytest.mark.parametrize("vision_ms", [1.0, 40.0])
def test_the_restore_of_an_image_request_is_scored_over_its_images(vision_ms):
    _, cand, ctx = _restore_candidate_of_image_request(vision_ms)
    t_ms = cand.entry.estimate_ns / 1e6
    # Its following prefill (C=64 holds the image and the 24 text tokens after
    # it) plus one vision frame on the largest VISION program for its one image.
    f_ms = cost_ms(PREFILL_1_64) + vision_ms
    assert not cand.unknown
    assert cand.score == pytest.approx(sequence_rate(cand.value, t_ms, f_ms, ctx.active_age_price))


def test_expensive_images_let_the_decoder_go_first():
    """The chain's rate falls with its vision time: with cheap images the
    restore wins, with images costing 400 ms the running decoder does (before,
    the restore's score ignored the images and it won both)."""
    cheap, cheap_cand, _ = _restore_candidate_of_image_request(1.0)
    dear, dear_cand, _ = _restore_candidate_of_image_request(400.0)
    assert dear_cand.score < cheap_cand.score
    assert cheap.s.plan().graph.kind is GraphKind.RESTORE
    assert dear.s.plan().graph.kind is not GraphKind.RESTORE


# ---------------------------------------------------------------------------
# Spare restore rows


def test_a_restore_advances_other_prompt_ready_rows_on_its_spare_rows():
    """Three admissions restoring the same cached pages at once: a RESTORE B=4
    as fast as B=1 binds all three (spec: "Unused prerequisite capacity can
    advance additional rows at no extra physical cost; equal value rates prefer
    advancing more requests"); before, each restore bound one."""
    restore4 = GraphDescriptor(GraphKind.RESTORE, 4)
    sim = _sim()
    sim.s = type(sim.s)([*CATALOG, restore4], sim.s.config)
    for desc in CATALOG:
        sim.s.catalog.observe(desc, int(cost_ms(desc) * MS), 0)
    sim.s.catalog.observe(restore4, int(cost_ms(GraphDescriptor(GraphKind.RESTORE, 1)) * MS), 0)
    prompts = _shared_prefix_prompts(4)
    sim.admit(len(prompts[0]), 2, tokens=prompts[0])
    _run(sim)  # its pages are published
    handles = [sim.admit(len(t), 2, tokens=t) for t in prompts[1:]]
    sim.now += MS // 10
    sim.s.advance_to(sim.now)
    plan = sim.s.plan()
    assert plan is not None and plan.graph == restore4
    assert sorted(lane.handle.id for lane in plan.lanes) == sorted(h.id for h in handles)
    sim.execute(plan)
    assert all(sim.s.request(h).consumed_prompt == 32 for h in handles)
    _run(sim)
    assert all(len(sim.out[h.id]) == 2 for h in handles)


def test_a_restore_pair_serves_k_restored_rows_on_a_packed_prefill():
    """Three admissions restoring the same cached pages, each with an 8-token
    rest: a RESTORE B=4 then a PREFILL B=4 C=64 serving all three beats a
    faster RESTORE B=1 then a single prefill (spec: "Enumerate the number k of
    newly ready rows served by the following graph"); before, a restore pair
    enabled one prompt row on a single prefill and the B=1 restore won."""
    restore4 = GraphDescriptor(GraphKind.RESTORE, 4)
    packed = GraphDescriptor(GraphKind.PREFILL, 4, prompt_capacity=64)
    sim = _sim()
    sim.s = type(sim.s)([*CATALOG, restore4, packed], sim.s.config)
    for desc in CATALOG:
        sim.s.catalog.observe(desc, int(cost_ms(desc) * MS), 0)
    sim.s.catalog.observe(GraphDescriptor(GraphKind.RESTORE, 1), int(0.4 * MS), 0)
    sim.s.catalog.observe(restore4, int(0.5 * MS), 0)
    sim.s.catalog.observe(packed, int(2.2 * MS), 0)
    prompts = _shared_prefix_prompts(4)
    sim.admit(len(prompts[0]), 2, tokens=prompts[0])
    _run(sim)
    handles = [sim.admit(len(t), 2, tokens=t) for t in prompts[1:]]
    sim.now += MS // 10
    sim.s.advance_to(sim.now)
    ctx = sim.s._context()
    cands = [c for c in sim.s._candidates(ctx) if c.entry.descriptor == restore4]
    best = max(cands, key=lambda c: c.rank_key())
    # Its score: the three rows' 8-token chunks on the packed prefill, over T + F.
    value = sum(v.finish_value + 8 * (1.0 + v.token_price) for v in best.lanes)
    assert best.value == pytest.approx(value)
    assert best.score == pytest.approx(sequence_rate(value, 0.5, 2.2, ctx.active_age_price))
    plan = sim.s.plan()
    assert plan is not None and plan.graph == restore4 and len(plan.lanes) == 3
    sim.execute(plan)
    sim.now += MS // 10
    sim.s.advance_to(sim.now)
    follow = sim.s.plan()
    assert follow is not None and follow.graph == packed
    assert sorted(lane.handle.id for lane in follow.lanes) == sorted(h.id for h in handles)
