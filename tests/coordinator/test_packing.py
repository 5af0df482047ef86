"""runtime.coordinator.packing: packed prefill programs (issue 26).

The cohort search against brute force over every cohort and every chunk split
on small instances (the guarantees the module states, and how often it is
exact), then the scheduler end to end: several waiting prompts share one
frame, each row consumes its own chunk and the finishing rows commit their
first tokens; dominance keeps the smallest shape; exploration skips a larger
unmeasured capacity; commit refuses a malformed packed plan.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.errors import CommitError
from runtime.coordinator.packing import PromptRows
from runtime.coordinator.plan import LanePhase
from runtime.coordinator.policy import prompt_lane_value
from tests.support.selection_driver import MS, Driver, decode, prefill

BETA = 64.0


def packed(batch: int, capacity: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, batch, prompt_capacity=capacity)


def row(rng: random.Random, rid: int, history: bool = False) -> SimpleNamespace:
    """A prompt row as the search reads it: position, tokens to its next hard
    boundary, its prompt's end, price, first-output value, restored history."""
    pos = rng.randint(0, 40)
    target = pos + rng.randint(1, 12)
    available = target - pos if rng.random() < 0.6 else rng.randint(1, target - pos)
    request = SimpleNamespace(prefill_target=target, handle=SimpleNamespace(id=rid))
    return SimpleNamespace(
        request=request, prompt_pos=pos, available=available, to_endpoint=available,
        token_price=rng.uniform(0.0, 3.0), lru=rng.randint(-1, 5),
        history_end=pos + rng.randint(1, available) if history else 0,
        finish_value=rng.uniform(0.0, 200.0),
    )  # fmt: skip


def brute_force(rows, batch: int, capacity: int) -> float:
    """The best value of any cohort of at most ``batch`` rows and any chunks
    (each at least one token, at most the row's available) fitting ``capacity``."""
    best = 0.0
    for n in range(1, min(batch, len(rows)) + 1):
        for cohort in itertools.combinations(rows, n):
            for chunks in itertools.product(*(range(1, v.available + 1) for v in cohort)):
                if sum(chunks) <= capacity:
                    value = sum(prompt_lane_value(v, t, BETA) for v, t in zip(cohort, chunks))
                    best = max(best, value)
    return best


def instances(seed: int, count: int, history: bool = False):
    rng = random.Random(seed)
    for _ in range(count):
        rows = [row(rng, i, history and rng.random() < 0.5) for i in range(rng.randint(1, 4))]
        yield rows, rng.choice((1, 2, 4)), rng.randint(2, 30)


@pytest.mark.parametrize("seed", range(4))
def test_the_search_keeps_its_guarantees_against_brute_force(seed):
    exact = total = 0
    for rows, batch, capacity in instances(seed, 80):
        value, cohort, chunks = PromptRows(rows, BETA).best(batch, capacity)
        # What the search returns is a real cohort and split, valued right.
        assert len(cohort) == len(set(cohort)) <= batch
        assert sum(chunks) <= capacity and all(
            1 <= t <= rows[i].available for i, t in zip(cohort, chunks)
        )
        assert value == pytest.approx(
            sum(prompt_lane_value(rows[i], t, BETA) for i, t in zip(cohort, chunks))
        )
        best = brute_force(rows, batch, capacity)
        assert value <= best * (1 + 1e-12)
        capped = sorted(
            (prompt_lane_value(v, min(v.available, capacity), BETA), v.available) for v in rows
        )[::-1][:batch]
        if batch == 1 or sum(size for _, size in capped) <= capacity:
            assert value == pytest.approx(best), "exact: the most valuable rows fit whole"
        if len(rows) <= batch:  # no restored history here: within one first output
            bonus = max(v.finish_value for v in rows)
            assert value >= best - bonus - 1e-9
        exact += value >= best * (1 - 1e-12)
        total += 1
    assert exact >= total * 0.8, f"exact on {exact} of {total}"


def test_restoring_rows_stay_feasible_and_exact_when_the_best_rows_fit():
    for rows, batch, capacity in instances(99, 150, history=True):
        value, _, _ = PromptRows(rows, BETA).best(batch, capacity)
        best = brute_force(rows, batch, capacity)
        assert value <= best * (1 + 1e-12)
        if sum(v.available for v in rows) <= capacity and len(rows) <= batch:
            assert value == pytest.approx(best)


def test_a_known_miss_is_within_the_stated_bound():
    """Capacity 100 and three rows of room: the value ordering starts with the
    large row (100 tokens, worth 100), the value-per-token one with the two tiny
    ones and a middle one (95); the best is a tiny row and the two middle ones,
    one of them partial (158.5).  Stated in docs/scheduler.md: not exact in
    general, and the cardinality bound is what the orderings miss here."""

    def make(rid, size, price):
        request = SimpleNamespace(prefill_target=10_000, handle=SimpleNamespace(id=rid))
        return SimpleNamespace(
            request=request, prompt_pos=0, available=size, to_endpoint=size,
            token_price=price - 1.0, lru=0, history_end=0, finish_value=0.0,
        )  # fmt: skip

    rows = [
        make(0, 1, 10.0),
        make(1, 1, 10.0),
        make(2, 50, 1.5),
        make(3, 50, 1.5),
        make(4, 100, 1.0),
    ]
    value, _, _ = PromptRows(rows, BETA).best(3, 100)
    assert brute_force(rows, 3, 100) == pytest.approx(158.5)
    assert value == pytest.approx(100.0)


# ------------------------------------------------------------- the scheduler


def measured(descs, cost_ms) -> Driver:
    drv = Driver(descs, cost=lambda d: round(cost_ms(d) * MS))
    drv.advance(1)
    for d in descs:
        drv.sched.catalog.observe(d, drv.cost(d), drv.now)
    return drv


def cost_ms(d: GraphDescriptor) -> float:
    """Prompt tokens at 1 us each on a 2 ms floor; a packed shape costs what the
    single one of its capacity does, plus 10 us a row."""
    if d.kind is GraphKind.PREFILL:
        return 2.0 + d.prompt_capacity / 1000 + 0.01 * (d.batch_capacity - 1)
    return 2.0 + 0.05 * d.batch_capacity


CATALOG = [
    *(prefill(c) for c in (64, 128, 256, 512)),
    *(packed(b, c) for b in (2, 4) for c in (256, 512)),
    decode(1), decode(2), decode(4),
]  # fmt: skip


def test_waiting_prompts_share_one_packed_frame_and_each_commits_its_first_token():
    drv = measured(CATALOG, cost_ms)
    handles = [drv.admit(n, 8) for n in (60, 90, 100)]
    plan = drv.plan()
    assert plan.graph == packed(4, 256)
    assert [lane.phase for lane in plan.lanes] == [LanePhase.PREFILL] * 3
    assert sorted(lane.prompt_tokens for lane in plan.lanes) == [60, 90, 100]
    assert {lane.handle for lane in plan.lanes} == set(handles)
    assert all(lane.max_tokens == 1 and lane.prompt_start == 0 for lane in plan.lanes)
    out = drv.run(plan)
    assert sorted(g.handle.id for g in out) == sorted(h.id for h in handles)
    for r in drv.sched.active_requests():
        assert r.decoding and r.committed_output == 1
    assert drv.plan().graph.kind is GraphKind.DECODE  # every prompt is done


def test_a_partial_row_takes_the_tokens_left_and_continues_next_frame():
    drv = measured(CATALOG, cost_ms)
    long = drv.admit(700, 8)
    short = drv.admit(100, 8)
    plan = drv.plan()
    assert plan.graph == packed(2, 512)
    chunks = {lane.handle: (lane.prompt_tokens, lane.max_tokens) for lane in plan.lanes}
    assert chunks == {short: (100, 1), long: (412, 0)}
    drv.run(plan)
    request = {r.handle: r for r in drv.sched.active_requests()}
    assert request[long].consumed_prompt == 412 and not request[long].decoding
    assert request[short].decoding


def test_the_same_rows_and_chunks_keep_only_the_smallest_shape():
    from runtime.coordinator.packing import packed_prefill_candidates

    drv = measured(CATALOG, cost_ms)
    for n in (60, 90):
        drv.admit(n, 8)
    out = []
    packed_prefill_candidates(drv.sched._context(), out)
    shapes = sorted((c.entry.descriptor.batch_capacity, c.entry.descriptor.prompt_capacity)
                    for c in out)  # fmt: skip
    assert shapes == [(2, 256)]  # (2, 512), (4, 256), (4, 512) do the same work


def test_a_lone_prompt_is_left_to_the_single_prefill():
    from runtime.coordinator.packing import packed_prefill_candidates

    drv = measured(CATALOG, cost_ms)
    drv.admit(200, 8)
    out = []
    packed_prefill_candidates(drv.sched._context(), out)
    assert out == []
    assert drv.plan().graph == prefill(256)


def test_a_larger_unmeasured_packed_capacity_is_not_explored():
    descs = [prefill(64), prefill(512), packed(2, 128), packed(2, 512), decode(1)]
    drv = Driver(descs)
    drv.advance(1)
    for d in (prefill(64), prefill(512), packed(2, 128), decode(1)):
        drv.sched.catalog.observe(d, drv.cost(d), drv.now)
    drv.admit(1000, 8, message_endpoints=(50,))
    drv.admit(1000, 8, message_endpoints=(60,))
    from runtime.coordinator.packing import packed_prefill_candidates

    out = []
    packed_prefill_candidates(drv.sched._context(), out)
    # The two rows reach their endpoints in 110 tokens: (2, 128) holds that,
    # so the unmeasured (2, 512) is not explored.
    assert [c.entry.descriptor for c in out] == [packed(2, 128)]


def test_commit_refuses_a_packed_plan_over_capacity_or_with_a_decode_row():
    drv = measured(CATALOG, cost_ms)
    for n in (150, 150):
        drv.admit(n, 8)
    plan = drv.plan()
    assert plan.graph == packed(2, 512)
    with pytest.raises(CommitError, match="300 tokens exceed the prompt capacity 256"):
        drv.sched.commit(replace(plan, graph=packed(2, 256)), 1)
    decode_row = replace(plan.lanes[1], phase=LanePhase.DECODE)
    with pytest.raises(CommitError, match="every lane of a prefill plan is a prompt row"):
        drv.sched.commit(replace(plan, lanes=(plan.lanes[0], decode_row)), 1)
    drv.sched.commit(plan, 1)  # the plan itself is fine
