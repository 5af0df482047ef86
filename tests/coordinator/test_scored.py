"""Scored prefill in the scheduler (issue 27, docs/scored-prefill.md).

A request whose prompt is scored (``RequestSpec.score_prompt``) runs its
prompt work on SCORED_PREFILL programs only, single or packed, never a plain
prefill or a mixed prompt row; unscored requests never run on scored
programs; both compete with the same values; ``max_output_tokens`` 0 finishes
when the prompt completes; a scored request attaches no cached prefix (its
scores are recomputed), yet publishes its pages for others.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.errors import CommitError, SchedulerError
from runtime.coordinator.plan import LanePhase
from runtime.coordinator.requests import AdmissionError, RequestSpec
from runtime.coordinator.scheduler import Scheduler
from tests.support.selection_driver import MS, Driver, decode, prefill

SCORED = GraphKind.SCORED_PREFILL


def scored(capacity: int, batch: int = 1) -> GraphDescriptor:
    return GraphDescriptor(SCORED, batch, prompt_capacity=capacity)


def packed(capacity: int, batch: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, batch, prompt_capacity=capacity)


def mixed(batch: int, capacity: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.MIXED, batch, prompt_capacity=capacity)


CATALOG = [
    *(prefill(c) for c in (64, 128, 256)),
    packed(256, 2), packed(256, 4),
    *(scored(c) for c in (64, 128, 256)),
    scored(256, 2), scored(256, 4),
    mixed(2, 64), mixed(4, 64),
    decode(1), decode(2), decode(4),
]  # fmt: skip


def cost_ms(d: GraphDescriptor) -> float:
    """Prompt tokens at 1 us each on a 2 ms floor, the scored and plain shapes
    alike (so the choices between them show the rules, not the costs)."""
    if d.prompt_capacity:
        return 2.0 + d.prompt_capacity / 1000 + 0.01 * (d.batch_capacity - 1)
    return 2.0 + 0.05 * d.batch_capacity


def measured(descs=CATALOG) -> Driver:
    drv = Driver(descs, cost=lambda d: round(cost_ms(d) * MS))
    drv.advance(1)
    for d in descs:
        drv.sched.catalog.observe(d, drv.cost(d), drv.now)
    return drv


def drain(drv: Driver, limit: int = 200) -> list:
    """Run frames until nothing is left; every committed plan."""
    for _ in range(limit):
        if drv.sched.plan() is None:
            return drv.committed
        drv.step()
    raise AssertionError("the scheduler never drained")


def test_scored_prompts_run_on_scored_programs_only_and_unscored_never():
    drv = measured()
    scored_ids = {drv.admit(n, 4, score_prompt=True).id for n in (60, 90, 300)}
    plain_ids = {drv.admit(n, 4).id for n in (70, 100)}
    plans = drain(drv)
    kinds = {GraphKind.PREFILL: set(), SCORED: set(), GraphKind.MIXED: set()}
    for plan in plans:
        for lane in plan.lanes:
            if lane.phase is LanePhase.PREFILL:
                kinds[plan.graph.kind].add(lane.handle.id)
    assert kinds[SCORED] == scored_ids
    assert kinds[GraphKind.PREFILL] | kinds[GraphKind.MIXED] == plain_ids
    # Scored rows pack like prefill rows: some scored frame serves several of them.
    assert max(len(p.lanes) for p in plans if p.graph.kind is SCORED) >= 2
    # The 300-token prompt took two scored chunks (a 256 capacity at most).
    chunks = [lane.prompt_tokens for p in plans if p.graph.kind is SCORED for lane in p.lanes]
    assert sum(chunks) == 60 + 90 + 300 and max(chunks) <= 256


def test_a_scored_prompt_is_never_a_mixed_prompt_row():
    drv = measured()
    drv.admit(40, 50)  # a decoder, so mixed programs compete
    drv.step()
    handle = drv.admit(30, 4, score_prompt=True)
    plan = drv.plan()
    for _ in range(20):
        rows = [lane for lane in plan.lanes if lane.phase is LanePhase.PREFILL]
        if rows:
            assert plan.graph.kind is SCORED and rows[0].handle == handle
            break
        drv.run(plan)
        plan = drv.plan()
    else:
        raise AssertionError("the scored prompt never ran")


def test_scored_and_unscored_prompts_are_valued_alike():
    """The same prompt on both kinds, at the same cost: the same score."""
    from runtime.coordinator.policy import prefill_candidates

    drv = measured()
    drv.admit(100, 4)
    drv.admit(100, 4, score_prompt=True)
    ctx = drv.sched._context()
    plain, scored_out = [], []
    prefill_candidates(ctx, plain, None, GraphKind.PREFILL)
    prefill_candidates(ctx, scored_out, None, SCORED)
    assert [c.entry.descriptor.kind for c in scored_out] == [SCORED] * len(scored_out)
    assert {c.entry.descriptor.kind for c in plain} == {GraphKind.PREFILL}
    best = {k: max(c.score for c in out) for k, out in (("p", plain), ("s", scored_out))}
    assert best["s"] == pytest.approx(best["p"])


def test_commit_refuses_a_prompt_row_on_the_other_kind():
    drv = measured()
    drv.admit(100, 4, score_prompt=True)
    plan = drv.plan()
    assert plan.graph == scored(128)
    with pytest.raises(CommitError, match="a scored prompt row on prefill"):
        drv.sched.commit(replace(plan, graph=prefill(128)), 1)
    drv.sched.commit(plan, 1)
    drv2 = measured()
    drv2.admit(100, 4)
    plan = drv2.plan()
    with pytest.raises(CommitError, match="an unscored prompt row on scored_prefill"):
        drv2.sched.commit(replace(plan, graph=scored(128)), 1)


def test_max_tokens_zero_finishes_when_the_prompt_completes():
    drv = measured()
    handle = drv.admit(300, 0, score_prompt=True)
    first = drv.plan()
    assert first.graph.kind is SCORED and first.lanes[0].max_tokens == 0
    assert drv.run(first) == []  # a chunk: nothing to report yet
    last = drv.plan()
    assert last.graph.kind is SCORED and last.lanes[0].max_tokens == 0  # commits nothing
    (item,) = drv.run(last)
    assert item.handle == handle and item.tokens == ()
    assert item.finished and item.finish_reason == "length"
    assert drv.sched.request(handle) is None  # retired
    assert drv.sched.plan() is None


def test_max_tokens_zero_is_for_scored_prompts_only():
    with pytest.raises(AdmissionError, match="max_output_tokens must be a positive integer"):
        RequestSpec(10, 0)
    with pytest.raises(AdmissionError, match="non-negative"):
        RequestSpec(10, -1, score_prompt=True)
    assert RequestSpec(10, 0, score_prompt=True).max_output_tokens == 0


def test_a_catalog_without_scored_programs_refuses_a_scored_request():
    drv = measured([prefill(64), decode(1)])
    with pytest.raises(SchedulerError, match="score_prompt: the catalog has no scored prefill"):
        drv.admit(10, 4, score_prompt=True)


def test_a_scored_request_attaches_no_cached_prefix_but_publishes():
    config = SchedulerConfig(max_slots=8, page_size=16, num_pages=256)
    sched = Scheduler(CATALOG, config)
    drv = Driver(CATALOG, cost=lambda d: round(cost_ms(d) * MS))
    drv.sched = sched
    drv.advance(1)
    for d in CATALOG:
        sched.catalog.observe(d, drv.cost(d), drv.now)
    prompt = tuple(range(5, 105))  # 100 tokens
    for _ in range(2):  # the second finds the first's pages published, and recomputes
        handle = sched.admit(RequestSpec(100, 2, prompt_tokens=prompt, score_prompt=True))
        plan = drv.plan()
        (lane,) = plan.lanes
        assert plan.graph.kind is SCORED and lane.handle == handle
        assert (lane.prompt_start, lane.prompt_tokens) == (0, 100)  # every position
        assert [g.cached_tokens for g in drv.run(plan)] == [0]  # usage stays honest
        drain(drv)
    # An unscored sibling attaches what the scored requests published.
    sibling = sched.admit(RequestSpec(100, 2, prompt_tokens=prompt))
    plan = drv.plan()
    lane = next(lane for lane in plan.lanes if lane.handle == sibling)
    assert lane.prompt_start == 99 and plan.graph.kind is not SCORED
    assert [g.cached_tokens for g in drv.run(plan)] == [99]
