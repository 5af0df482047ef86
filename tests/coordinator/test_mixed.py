"""Mixed prefill/decode selection in the production scheduler (spec, "Mixed
execution contract", the mixed parts of "Useful service and selection",
"Planning and the execution queue" and "Verification").

The exhaustive test scores every legal cohort, mixed ones included, with the
spec objective written here independently of ``runtime.coordinator.utility``.
"""

from __future__ import annotations

import random
from itertools import combinations

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PolicyConfig
from runtime.coordinator.errors import CommitError, CompletionError
from runtime.coordinator.plan import LanePhase, LaneWork, SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import Phase
from runtime.ranks.capacity import mixed_shapes
from tests.support.selection_driver import (
    ENUM_BATCHES,
    ENUM_BUCKETS,
    MS,
    TOKEN,
    TTL_NS,
    Driver,
    admit_due,
    decode,
    next_hard_end,
    prefill,
    random_policy,
    runnable,
    spec_objective,
    table_cost,
)
from tests.support.selection_driver import random_costs as separate_random_costs

S = 1000 * MS
BUCKETS = ENUM_BUCKETS  # (64, 128, 256)
BATCHES = ENUM_BATCHES  # (1, 2, 4, 8)


def mixed(batch: int, capacity: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.MIXED, batch, prompt_capacity=capacity)


def full_catalog(buckets=BUCKETS, batches=BATCHES) -> list[GraphDescriptor]:
    return (
        [prefill(c) for c in buckets]
        + [decode(b) for b in batches]
        + mixed_shapes(batches, buckets)
    )


def observe_all(drv: Driver, costs: dict[GraphDescriptor, float]) -> None:
    """Every graph measured once at its table cost (as a completion would)."""
    for desc, ms in costs.items():
        drv.sched.catalog.observe(desc, round(ms * MS), drv.now)


def random_costs(rng: random.Random) -> dict[GraphDescriptor, float]:
    """test_selection's plausible but arbitrary prefill and decode costs (ms, over
    the same buckets and batches), plus arbitrary mixed costs that need not
    follow either family."""
    costs = separate_random_costs(rng)
    for d in mixed_shapes(BATCHES, BUCKETS):
        costs[d] = round(rng.uniform(1.0, 10.0) * MS) / MS
    return costs


# ------------------------------------------------------ exhaustive enumeration


def enumerate_cohorts(sched, costs) -> dict:
    """Every legal undominated (graph, prompt row, prompt work, decoders) and its score.

    Dominance as the spec states it: the same kind, cohort and logical work
    (mixed: the same prompt row and prompt tokens) on a shape whose capacities
    are all at least as large, one strictly larger, is left out.
    """
    policy = sched.policy
    beta, c = policy.output_token_value, policy.decode_age_price
    start = sched.now_ns
    ctx = sched._context()
    assert ctx.start_ns == start
    views = {v.request.handle.id: v for v in ctx.prefill + ctx.decode}
    live = runnable(sched)
    decoders = [r for r in live if r.phase is Phase.DECODE]
    prefilling = [r for r in live if r.phase is Phase.PREFILL]
    k = len(decoders)
    family = {
        (d.batch_capacity, d.prompt_capacity): t
        for d, t in costs.items()
        if d.kind in (GraphKind.DECODE, GraphKind.MIXED)
    }
    sigma = k * min(t / min(b, k) for (b, _), t in family.items()) if k else 0.0
    decodes = {d.batch_capacity: t for d, t in costs.items() if d.kind is GraphKind.DECODE}
    caps = {d.prompt_capacity: t for d, t in costs.items() if d.kind is GraphKind.PREFILL}
    mixes = {
        (d.batch_capacity, d.prompt_capacity): t
        for d, t in costs.items()
        if d.kind is GraphKind.MIXED
    }

    def age_ms(r) -> float:
        last = r.last_visible_ns if r.last_visible_ns is not None else r.became_decoder_ns
        return (start - last) / MS

    def decode_score(cohort, t):
        priced = age = 0.0
        for r in cohort:
            v = views[r.handle.id]
            priced += beta + v.token_price + v.delivery_price
            age += c * sigma * (age_ms(r) + t)
        return priced, age

    def prompt_priced(r, tokens):
        v = views[r.handle.id]
        priced = tokens * (1 + v.token_price)
        if r.consumed_prompt + tokens == r.spec.prompt_len:
            priced += beta + v.token_price
        return priced

    scores = {}
    for b, t in decodes.items():
        for n in range(1, min(b, k) + 1):
            if any(n <= smaller for smaller in decodes if smaller < b):
                continue
            for cohort in combinations(decoders, n):
                priced, age = decode_score(cohort, t)
                key = ("decode", b, 0, None, 0, frozenset(r.handle.id for r in cohort))
                scores[key] = spec_objective(t, priced, age, c * k)
    for r in prefilling:
        avail = next_hard_end(r)
        for cap, t in caps.items():
            tokens = min(cap, avail)
            if any(min(smaller, avail) == tokens for smaller in caps if smaller < cap):
                continue
            key = ("prefill", 1, cap, r.handle.id, tokens, frozenset())
            scores[key] = spec_objective(t, prompt_priced(r, tokens), 0.0, c * k)
    for (b, cap), t in mixes.items():
        smaller_shapes = [
            (b2, c2) for (b2, c2) in mixes if b2 <= b and c2 <= cap and (b2, c2) != (b, cap)
        ]
        for n in range(1, min(b, k) + 1):
            if any(n <= b2 for b2, _ in smaller_shapes):
                continue  # the same decode-only cohort fits a smaller mixed shape
            for cohort in combinations(decoders, n):
                priced, age = decode_score(cohort, t)
                key = ("mixed", b, cap, None, 0, frozenset(x.handle.id for x in cohort))
                scores[key] = spec_objective(t, priced, age, c * k)
        for r in prefilling:
            avail = next_hard_end(r)
            tokens = min(cap, avail)
            for n in range(0, min(b - 1, k) + 1):
                if any(n <= b2 - 1 and min(c2, avail) == tokens for b2, c2 in smaller_shapes):
                    continue  # the same row, work and decoders fit a smaller mixed shape
                for cohort in combinations(decoders, n):
                    priced, age = decode_score(cohort, t)
                    priced += prompt_priced(r, tokens)
                    ids = frozenset(x.handle.id for x in cohort)
                    key = ("mixed", b, cap, r.handle.id, tokens, ids)
                    scores[key] = spec_objective(t, priced, age, c * k)
    return scores


def plan_key(plan) -> tuple:
    g = plan.graph
    row = plan.prompt_row
    prompt = plan.lanes[row] if row >= 0 else None
    decoders = frozenset(la.handle.id for la in plan.lanes if la.phase is LanePhase.DECODE)
    return (
        g.kind.value,
        g.batch_capacity,
        g.prompt_capacity,
        None if prompt is None else prompt.handle.id,
        0 if prompt is None else prompt.prompt_tokens,
        decoders,
    )


def check_winner(drv: Driver, costs, plan) -> str:
    scores = enumerate_cohorts(drv.sched, costs)
    assert scores, "something was runnable"
    top_key = max(scores, key=scores.__getitem__)
    top = scores[top_key]
    key = plan_key(plan)
    assert key in scores, f"plan {key} is not a legal undominated cohort"
    mine = scores[key]
    assert plan.reason is SelectionReason.ORDINARY
    assert mine >= top - 1e-9 * abs(top), (key, mine, top_key, top)
    assert plan.unscaled_value_rate() == pytest.approx(mine, rel=1e-9, abs=1e-12)
    return key[0]


def exhaustive_trial(seed: int) -> tuple[int, set[str]]:
    rng = random.Random(seed)
    costs = random_costs(rng)
    policy = random_policy(rng) if seed % 2 else None
    drv = Driver(full_catalog(), table_cost(costs), policy)
    observe_all(drv, costs)
    n = rng.randint(2, 5)
    arrivals = sorted(rng.randint(0, 12) for _ in range(n))
    arrivals[0] = 0
    checks = 0
    kinds: set[str] = set()
    for frame in range(rng.randint(20, 40)):
        admit_due(drv, rng, arrivals, frame)
        if not runnable(drv.sched):
            continue
        plan = drv.plan()
        kinds.add(check_winner(drv, costs, plan))
        checks += 1
        drv.run(plan)  # one frame at a time: every plan starts from an empty window
    return checks, kinds


@pytest.mark.parametrize("block", range(3))
def test_mixed_winner_maximizes_the_spec_objective_over_every_legal_cohort(block):
    checks = 0
    kinds: set[str] = set()
    for seed in range(block * 40, block * 40 + 40):
        n, k = exhaustive_trial(seed)
        checks += n
        kinds |= k
    assert checks >= 40 * 15
    assert "mixed" in kinds  # the enumeration exercised mixed winners


# -------------------------------------------------------------- a small rig


def roofline_ms(d: GraphDescriptor) -> float:
    """A roofline-like cost: overhead + max(weights and KV bytes, prompt-token FLOPs).

    A few decode rows riding on a compute-bound prompt chunk cost almost
    nothing, as on a GPU.
    """
    tokens = d.prompt_capacity + (d.batch_capacity if d.kind is not GraphKind.PREFILL else 0)
    return 0.8 + max(1.0 + 0.02 * d.batch_capacity, tokens * 0.0045)


def started(streams: int = 3, prompt_len: int = 1000):
    """``streams`` decoders streaming on a measured catalog, then a long prompt."""
    descs = full_catalog()
    costs = {d: roofline_ms(d) for d in descs}
    drv = Driver(descs, table_cost(costs))
    observe_all(drv, costs)
    handles = [drv.admit(64, 10_000) for _ in range(streams)]
    for _ in range(streams + 2):
        drv.step()
    assert all(drv.sched.request(h).phase is Phase.DECODE for h in handles)
    prompt = drv.admit(prompt_len, 50)
    return drv, handles, prompt


def mixed_plan(drv: Driver):
    plan = drv.plan()
    for _ in range(40):
        if plan.graph.kind is GraphKind.MIXED and plan.prompt_row >= 0:
            return plan
        drv.run(plan)
        plan = drv.plan()
    raise AssertionError("no mixed plan with a prompt row came")


def test_mixed_plan_shape_roles_and_completion_by_phase():
    drv, _handles, prompt = started()
    plan = mixed_plan(drv)
    assert plan.prompt_row == 0
    row = plan.lanes[0]
    assert row.phase is LanePhase.PREFILL and row.handle == prompt
    assert row.prompt_tokens <= plan.graph.prompt_capacity
    decode_lanes = plan.lanes[1:]
    assert all(la.phase is LanePhase.DECODE and la.max_tokens == 1 for la in decode_lanes)
    assert len(plan.lanes) <= plan.graph.batch_capacity
    assert plan.requires_empty_window  # mixed programs drain the window

    r = drv.sched.request(prompt)
    before_prompt = r.consumed_prompt
    outputs = {la.handle.id: drv.sched.request(la.handle).committed_output for la in decode_lanes}
    fence = drv.commit(plan)
    assert drv.sched.plan() is None  # nothing queues behind a mixed frame
    out = drv.complete(fence, plan)
    # Completion by phase: the prompt row commits its whole extent, decoders one token.
    assert r.consumed_prompt == before_prompt + row.prompt_tokens
    for la in decode_lanes:
        assert drv.sched.request(la.handle).committed_output == outputs[la.handle.id] + 1
    firsts = [g for g in out if g.handle == prompt]
    if row.max_tokens:
        assert r.phase is Phase.DECODE and r.committed_output == 1
        assert firsts and firsts[0].first and firsts[0].tokens == (TOKEN,)
    else:
        assert not firsts and r.committed_output == 0

    trace = drv.sched.drain_trace()
    record = next(t for t in trace if t.fence == fence)
    assert record.kind == "mixed" and record.prompt_row == 0
    assert record.prompt_tokens == row.prompt_tokens
    assert record.decode_rows == len(decode_lanes)
    assert record.prompt_capacity == plan.graph.prompt_capacity
    assert drv.sched.executions[SelectionReason.ORDINARY] >= 1


def test_long_prompt_rides_with_the_decoders():
    """Four decoders and a 2,500-token prompt under roofline-like measured costs:
    the prompt is consumed only by mixed frames, never by a prefill frame that
    stalls every decoder, and no decoder misses two frames in a row.

    Not every mixed frame carries all four decoders.  The first chunk's
    decision (docs/scheduler.md, "Mixed programs"): B=4 C=1024 with three
    decoders scores 33,443.8 / 5.426 ms = 6,163/ms; B=8 C=1024 with all four
    scores 33,545.0 / 5.444 ms = 6,161/ms.  The fourth decoder adds about 101
    value but needs the next batch bucket, whose padded rows add 0.018 ms:
    5,600/ms at the margin, below the frame's rate, so value per time leaves it
    for the next frame.
    """
    descs = full_catalog(buckets=(64, 128, 256, 512, 1024), batches=(1, 2, 4, 8))
    costs = {d: roofline_ms(d) for d in descs}
    drv = Driver(descs, table_cost(costs))
    observe_all(drv, costs)
    streams = [drv.admit(64, 10_000) for _ in range(4)]
    for _ in range(8):
        drv.step()
    assert all(drv.sched.request(h).phase is Phase.DECODE for h in streams)
    long = drv.admit(2500, 20)
    consumed = 0
    missed = dict.fromkeys(streams, 0)
    full_frames = 0
    for _ in range(200):
        if drv.sched.request(long).phase is not Phase.PREFILL:
            break
        plan = drv.plan()
        served = {la.handle for la in plan.lanes if la.phase is LanePhase.DECODE}
        for h in streams:
            missed[h] = 0 if h in served else missed[h] + 1
            assert missed[h] <= 1, f"stream {h.id} missed two frames in a row"
        row = plan.prompt_row
        if row >= 0 and plan.lanes[row].handle == long:
            assert plan.graph.kind is GraphKind.MIXED, plan.graph.describe()
            assert len(served) >= 3
            full_frames += served == set(streams)
            consumed += plan.lanes[row].prompt_tokens
        drv.run(plan)
    assert consumed == 2500
    assert full_frames >= 1


# ----------------------------------------------------- malformed completions


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        ("prompt_token", "commits exactly"),  # a token on a prompt row short of the end
        ("decoder_missing", "commits exactly"),
        ("swapped", "record names slot"),
        ("short", "records for"),
        ("bad_reason", "bad finish_reason"),
    ],
)
def test_malformed_mixed_completion_is_refused_with_no_state_change(mutate, match):
    drv, _handles, prompt = started()
    drv.sched.request(prompt)
    plan = mixed_plan(drv)
    if plan.lanes[0].max_tokens:  # make sure the prompt row stops short of the end
        pytest.fail("the 1000-token prompt finished in one mixed chunk of a <= 256 shape")
    fence = drv.commit(plan)
    records = [
        CompletionRecord(la.slot, la.generation, (TOKEN,) * la.max_tokens) for la in plan.lanes
    ]
    if mutate == "prompt_token":
        records[0] = CompletionRecord(records[0].slot, records[0].generation, (TOKEN,))
    elif mutate == "decoder_missing":
        records[1] = CompletionRecord(records[1].slot, records[1].generation, ())
    elif mutate == "swapped":
        records[0], records[1] = records[1], records[0]
    elif mutate == "short":
        records = records[:-1]
    elif mutate == "bad_reason":
        records[0] = CompletionRecord(records[0].slot, records[0].generation, (), "stop")

    def state():
        out = []
        for la in plan.lanes:
            r = drv.sched.request(la.handle)
            out.append(
                (r.consumed_prompt, r.committed_output, r.inflight_prompt, r.inflight_output,
                 tuple(r.inflight_fences), r.token_rate, r.delivery_rate)
            )  # fmt: skip
        estimates = dict(drv.sched.catalog.estimates())
        return out, estimates, drv.sched.queue_fences, dict(drv.sched.executions)

    before = state()
    drv.advance(5 * MS)
    with pytest.raises(CompletionError, match=match):
        drv.sched.complete(fence, records, ExecutionTiming((5 * MS,), host_wall_ns=5 * MS))
    assert state() == before
    drv.sched.complete(  # the well-formed completion still applies
        fence,
        [CompletionRecord(la.slot, la.generation, (TOKEN,) * la.max_tokens) for la in plan.lanes],
        ExecutionTiming((5 * MS,), host_wall_ns=5 * MS),
    )
    assert drv.sched.request(prompt).consumed_prompt == plan.lanes[0].prompt_tokens


# ----------------------------------------------------------- role validation


def _lane(plan_lane: LaneWork, **changes) -> LaneWork:
    fields = dict(plan_lane.__dict__)
    fields.update(changes)
    return LaneWork(**fields)


def test_commit_refuses_plans_whose_roles_do_not_fit_the_program():
    from dataclasses import replace

    drv, _handles, _prompt = started(streams=2)
    second = drv.admit(200, 10)
    plan = mixed_plan(drv)
    row = plan.lanes[0]
    other = drv.sched.request(second)
    extra = LaneWork(
        second, other.slot, other.generation, LanePhase.PREFILL, 0, 64, 0, 0, 0.0, 0.0, 1.0
    )
    two_rows = replace(plan, lanes=(row, extra, *plan.lanes[2:]))
    with pytest.raises(CommitError, match="at most one prompt row"):
        drv.sched.commit(two_rows, drv.fence + 1)
    as_decode = replace(plan, graph=decode(8))
    with pytest.raises(CommitError, match="decode plan has no prompt row"):
        drv.sched.commit(as_decode, drv.fence + 1)
    as_prefill = replace(plan, graph=prefill(256), lanes=plan.lanes[1:2])  # a decode lane
    with pytest.raises(CommitError, match="every lane of a prefill plan is a prompt row"):
        drv.sched.commit(as_prefill, drv.fence + 1)
    wrong_token = replace(plan, lanes=(_lane(row, max_tokens=1), *plan.lanes[1:]))
    with pytest.raises(CommitError, match="when it ends the prompt"):
        drv.sched.commit(wrong_token, drv.fence + 1)
    decode_with_prompt = replace(
        plan, lanes=(row, _lane(plan.lanes[1], prompt_tokens=3), *plan.lanes[2:])
    )
    with pytest.raises(CommitError, match="decode row takes no prompt tokens"):
        drv.sched.commit(decode_with_prompt, drv.fence + 1)
    assert drv.sched.queue_fences == []
    drv.commit(plan)  # the plan itself is fine
    assert drv.sched.queue_fences == [drv.fence]


# --------------------------------------------------------- independent expiry


def test_mixed_estimate_expires_independently_of_the_separate_shapes():
    drv, _handles, _prompt = started()
    catalog = drv.sched.catalog
    plan = mixed_plan(drv)
    shape = plan.graph
    entry = catalog.entry(shape)
    separate = [prefill(256), decode(4)]
    drv.run(plan, 7 * MS)
    assert entry.estimate_ns == 7 * MS or entry.samples[-1] == 7 * MS
    # Time passes; only the separate shapes get fresh observations.
    drv.advance(TTL_NS + S)
    for d in separate:
        catalog.observe(d, catalog.entry(d).estimate_ns, drv.now)
    now = drv.now
    assert entry.stale(now, TTL_NS) and entry.known
    assert all(catalog.entry(d).fresh(now, TTL_NS) for d in separate)
    kept = entry.estimate_ns
    # The stale shape keeps its measured cost for ranking; its next observation
    # replaces the estimate directly, leaving the separate shapes alone.
    before = {d: catalog.entry(d).estimate_ns for d in separate}
    catalog.observe(shape, 3 * MS, now)
    assert kept > 0 and entry.estimate_ns == 3 * MS and entry.fresh(now, TTL_NS)
    assert {d: catalog.entry(d).estimate_ns for d in separate} == before


def test_stale_mixed_winner_keeps_its_cost_and_waits_for_an_empty_window():
    drv, _handles, _prompt = started()
    plan = mixed_plan(drv)
    shape = plan.graph
    estimate = plan.estimated_duration_ns
    # Refresh every other shape, past the mixed shape's freshness interval.
    drv.advance(TTL_NS + S)
    for d in drv.sched.catalog.descriptors:
        if d != shape:
            e = drv.sched.catalog.entry(d)
            drv.sched.catalog.observe(d, e.estimate_ns, drv.now)
    again = drv.plan()
    assert again.graph == shape  # ranked by its kept measured cost
    assert again.estimated_duration_ns == estimate
    assert again.requires_empty_window and again.reason is SelectionReason.ORDINARY
    entry = drv.sched.catalog.entry(shape)
    drv.run(again, 4 * MS)
    assert entry.estimate_ns == 4 * MS and entry.fresh(drv.now, TTL_NS)


# ------------------------------------------------------------ queue gating


def test_mixed_winner_is_gated_behind_queued_decode_work():
    """A mixed winner waits (plan() is None) while a decode frame is queued, and
    nothing is queued behind a committed mixed frame."""
    descs = full_catalog()
    costs = {d: roofline_ms(d) for d in descs}
    drv = Driver(descs, table_cost(costs))
    observe_all(drv, costs)
    for _ in range(3):
        drv.admit(64, 10_000)
    for _ in range(5):
        drv.step()
    head = drv.plan()
    assert head.graph.kind is GraphKind.DECODE and not head.requires_empty_window
    fence = drv.commit(head)
    assert drv.sched.plan() is not None  # decode work may queue behind decode work
    prompt = drv.admit(1000, 50)
    assert drv.sched.plan() is None  # the mixed winner needs an empty window
    drv.complete(fence, head)
    plan = drv.plan()
    assert plan.graph.kind is GraphKind.MIXED and plan.lanes[plan.prompt_row].handle == prompt
    fence = drv.commit(plan)
    assert drv.sched.plan() is None  # nothing queues behind a mixed frame
    drv.complete(fence, plan)
    assert drv.sched.plan() is not None


def test_throughput_preset_also_selects_mixed_programs():
    descs = full_catalog()
    costs = {d: roofline_ms(d) for d in descs}
    drv = Driver(descs, table_cost(costs), PolicyConfig.preset("throughput"))
    observe_all(drv, costs)
    for _ in range(3):
        drv.admit(64, 10_000)
    for _ in range(6):
        drv.step()
    drv.admit(500, 5)
    kinds = {drv.step().graph.kind for _ in range(20)}
    assert GraphKind.MIXED in kinds
