"""Speculative rounds in the scheduler: candidates, allocation, commit checks,
completion with variable token counts, acceptance observations, fixed width and
funded acceptance learning, driven through the Scheduler's public API."""

from __future__ import annotations

import random

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import ConfigError, SchedulerConfig
from runtime.coordinator.errors import CommitError, CompletionError
from runtime.coordinator.plan import SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler

MS = 1_000_000


def spec(b: int, w: int, p: int | None = None) -> GraphDescriptor:
    return GraphDescriptor(
        GraphKind.SPECULATIVE, b, token_capacity=w, proposal_depth=w - 1, target_capacity=p or 0
    )


def catalog(widths=(2, 4, 8), batches=(1, 2, 4, 8), ragged=()) -> list[GraphDescriptor]:
    out = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)]
    for b in batches:
        out.append(GraphDescriptor(GraphKind.DECODE, b))
        out += [spec(b, w) for w in widths]
    out += [spec(b, w, p) for b, w, p in ragged]
    return out


def cost_ms(desc: GraphDescriptor) -> float:
    """A synthetic cost: a fixed floor, target rows, and the draft's depth."""
    if desc.kind is GraphKind.PREFILL:
        return 8.0
    return 5.0 + 0.05 * desc.target_capacity + 0.6 * desc.proposal_depth


def isolated_timing(device_ns: int) -> ExecutionTiming:
    """One rank, host wall time equal to the device interval, isolated."""
    return ExecutionTiming((device_ns,), host_wall_ns=device_ns, queued=False)


class Rig:
    """Drives a Scheduler with synthetic costs; speculative lanes accept each
    proposal with the request's probability.  ``timing`` turns a frame's device
    interval into what the rig reports; ``completed`` keeps each completed
    frame's plan and reported timing, in completion order."""

    def __init__(
        self,
        config: SchedulerConfig,
        descs=None,
        seed: int = 0,
        cost=cost_ms,
        timing=isolated_timing,
    ) -> None:
        self.s = Scheduler(descs or catalog(), config)
        self.cost = cost
        self.timing = timing
        self.completed: list[tuple] = []
        self.now = 0
        self.fence = 0
        self.inflight: list = []
        self.rng = random.Random(seed)
        self.accept: dict[int, float] = {}
        self.plans: list = []
        self.tokens: dict[int, int] = {}

    def admit(self, n: int, p: float, out: int = 200, prompt: int = 64) -> list:
        handles = [self.s.admit(RequestSpec(prompt, out)) for _ in range(n)]
        for h in handles:
            self.accept[h.id] = p
        return handles

    def measure_all(self) -> None:
        """Give every program a cost so selection is ordinary (no discovery)."""
        for entry in self.s.catalog._entries.values():
            self.s.catalog.observe(entry.descriptor, int(self.cost(entry.descriptor) * MS), 0)

    def step(self) -> bool:
        self.s.advance_to(self.now)
        while (plan := self.s.plan()) is not None:
            self.fence += 1
            self.s.commit(plan, self.fence)
            start = max([self.now] + [end for *_, end in self.inflight])
            self.inflight.append((self.fence, plan, start, start + int(self.cost(plan.graph) * MS)))
            self.plans.append(plan)
        if not self.inflight:
            return False
        fence, plan, start, end = self.inflight.pop(0)
        self.now = max(self.now, end)
        self.s.advance_to(self.now)
        records = []
        for lane in plan.lanes:
            count = lane.max_tokens
            if plan.graph.kind is GraphKind.SPECULATIVE:
                count = 1
                while count < lane.max_tokens and self.rng.random() < self.accept[lane.handle.id]:
                    count += 1
            records.append(CompletionRecord(lane.slot, lane.generation, tuple(range(count))))
        timing = self.timing(end - start)
        self.completed.append((plan, timing))
        for g in self.s.complete(fence, records, timing):
            self.tokens[g.handle.id] = self.tokens.get(g.handle.id, 0) + len(g.tokens)
            self.s.published_output(g.handle, g.fence, self.now)
        return True

    def run(self, frames: int = 100_000) -> None:
        for _ in range(frames):
            if not self.step():
                return


def decode_plans(plans):
    return [p for p in plans if p.graph.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE)]


def test_preseeded_high_acceptance_picks_wide_rounds_and_low_picks_decode():
    for p, wide in ((0.95, True), (0.05, False)):
        rig = Rig(SchedulerConfig(16, 16, 4096))
        rig.s.speculation.preseed("draft", [p**d for d in range(1, 8)])
        rig.measure_all()
        rig.admit(4, p)
        rig.run(60)
        widths = [plan.graph.token_capacity for plan in decode_plans(rig.plans)[:20]]
        if wide:  # (the first 20 rounds: far from the output limits, where rounds narrow)
            assert min(widths) >= 4, widths
        else:
            assert max(widths) == 1, widths


def test_rectangular_rounds_give_complete_prefixes_shortened_by_the_output_limit():
    rig = Rig(SchedulerConfig(16, 16, 4096), catalog(widths=(8,)))
    rig.s.speculation.preseed("draft", [0.99**d for d in range(1, 8)])
    rig.measure_all()
    rig.admit(2, 0.0, out=10)  # every proposal rejected: one token per round
    rig.run()
    rounds = [p for p in rig.plans if p.graph.kind is GraphKind.SPECULATIVE]
    assert rounds
    for plan in rounds:
        for lane in plan.lanes:
            left = 10 - lane.output_start  # output_start counts committed and queued output
            assert lane.max_tokens == min(8, left)  # the complete prefix, or the limit
    assert all(n == 10 for n in rig.tokens.values())  # exactly the output limit


def test_ragged_programs_allocate_rows_to_the_likelier_prefixes():
    descs = catalog(widths=(), ragged=[(4, 8, 12)])
    rig = Rig(SchedulerConfig(16, 16, 4096), descs)
    rig.measure_all()
    high = rig.admit(2, 0.95, out=400)
    low = rig.admit(2, 0.05, out=400)
    for _ in range(100):  # long histories: the estimates sit near each request's rate
        for h in high:
            rig.s.request(h).speculation.acceptance("draft").observe_round(7, 7, False)
        for h in low:
            rig.s.request(h).speculation.acceptance("draft").observe_round(7, 0, False)
    rig.run(40)
    ragged = [p for p in rig.plans if p.graph.kind is GraphKind.SPECULATIVE and len(p.lanes) == 4]
    assert ragged
    for plan in ragged:
        by = {lane.handle.id: lane.max_tokens for lane in plan.lanes}
        assert sum(by.values()) <= 12  # within P
        assert min(by[h.id] for h in high) > max(by[h.id] for h in low)


def test_commit_refuses_query_lengths_beyond_p_or_the_depth():
    descs = catalog(widths=(), ragged=[(2, 4, 4)])
    rig = Rig(SchedulerConfig(16, 16, 4096), descs)
    rig.s.speculation.preseed("draft", [0.9, 0.8, 0.7])
    rig.measure_all()
    rig.admit(2, 0.9)
    while True:  # prefills first
        plan = rig.s.plan()
        if plan.graph.kind is GraphKind.SPECULATIVE:
            break
        rig.step()
    import dataclasses

    wide = [dataclasses.replace(lane, max_tokens=4) for lane in plan.lanes]
    with pytest.raises(CommitError, match="target capacity"):
        rig.s.commit(dataclasses.replace(plan, lanes=tuple(wide)), 99)
    deep = [dataclasses.replace(plan.lanes[0], max_tokens=5)]
    with pytest.raises(CommitError):
        rig.s.commit(dataclasses.replace(plan, lanes=tuple(deep)), 99)


def test_a_round_commits_one_to_q_tokens_and_observes_acceptance():
    rig = Rig(SchedulerConfig(16, 16, 4096), catalog(widths=(4,), batches=(1,)))
    rig.s.speculation.preseed("draft", [0.9, 0.8, 0.7])
    rig.measure_all()
    (h,) = rig.admit(1, 0.5, out=100)
    rig.step()  # the prefill
    rig.s.advance_to(rig.now)
    plan = rig.s.plan()
    assert plan.graph.kind is GraphKind.SPECULATIVE and plan.lanes[0].max_tokens == 4
    rig.fence += 1
    rig.s.commit(plan, rig.fence)
    lane = plan.lanes[0]
    acceptance = rig.s.request(h).speculation.acceptance("draft")
    before = acceptance.means(3)
    timing = ExecutionTiming((6 * MS,), host_wall_ns=6 * MS)
    with pytest.raises(CompletionError, match=r"commits 1\.\.4"):
        rig.s.complete(rig.fence, [CompletionRecord(lane.slot, lane.generation, ())], timing)
    with pytest.raises(CompletionError, match=r"commits 1\.\.4"):
        bad = CompletionRecord(lane.slot, lane.generation, (1, 2, 3, 4, 5))
        rig.s.complete(rig.fence, [bad], timing)
    # Two tokens: one proposal accepted, the second rejected, the third never verified
    # as a prefix survivor (a rejection gives zero to every longer offered prefix).
    out = rig.s.complete(rig.fence, [CompletionRecord(lane.slot, lane.generation, (7, 8))], timing)
    assert out[0].tokens == (7, 8)
    after = acceptance.means(3)
    assert after[0] == pytest.approx((2 * before[0] + 1) / 3)
    assert after[1] == pytest.approx((2 * before[1] + 0) / 3)
    assert after[2] == pytest.approx((2 * before[2] + 0) / 3)


def test_fixed_width_runs_only_that_width_and_never_probes():
    rig = Rig(SchedulerConfig(16, 16, 4096, fixed_speculative_width=4))
    rig.measure_all()
    rig.admit(4, 0.9, out=400)
    rig.run()
    kinds = {(p.graph.kind, p.graph.token_capacity) for p in decode_plans(rig.plans)}
    assert kinds == {(GraphKind.SPECULATIVE, 4)}
    assert all(p.reason is not SelectionReason.ACCEPTANCE_LEARNING for p in rig.plans)
    assert rig.s.learning_ledger.spent_ns == 0
    ordinary = Rig(SchedulerConfig(16, 16, 4096, fixed_speculative_width=1))
    ordinary.measure_all()
    ordinary.admit(2, 0.9, out=50)
    ordinary.run()
    assert {p.graph.kind for p in decode_plans(ordinary.plans)} == {GraphKind.DECODE}


def stalled_timing(device_ns: int) -> ExecutionTiming:
    """Two ranks; the longer interval holds a readiness stall of a tenth of it,
    and the host observes completion 2 ms after the device finished (isolated)."""
    return ExecutionTiming(
        (device_ns, device_ns - MS // 10),
        readiness_delay_ns=device_ns // 10,
        host_wall_ns=device_ns + 2 * MS,
        queued=False,
    )


def probe_run() -> tuple[Rig, list[int], int]:
    """Four requests the prior (0.5^d) underrates, 1,500 frames with
    :func:`stalled_timing`: the rig, the raw device interval (the longest rank's,
    its readiness stall included) it reported for each completed acceptance
    probe, in order, and the sum of those it reported for ordinary frames.
    (Acceptance 0.7 keeps deeper prefixes worth probing: several episodes.)"""
    rig = Rig(SchedulerConfig(16, 16, 4096), timing=stalled_timing)
    rig.measure_all()
    rig.admit(4, 0.7, out=3000)
    rig.run(1500)
    probes = [
        max(timing.rank_device_ns)
        for plan, timing in rig.completed
        if plan.reason is SelectionReason.ACCEPTANCE_LEARNING
    ]
    ordinary = sum(
        max(timing.rank_device_ns)
        for plan, timing in rig.completed
        if plan.reason is SelectionReason.ORDINARY
    )
    return rig, probes, ordinary


def test_funded_probes_offer_deeper_prefixes_and_respect_the_ledger_bound():
    """The spec's bound P <= 0.01/0.99 * O + D on what the rig reported: P the
    probes' raw device intervals, O the ordinary frames' raw device intervals,
    D the last completed probe's (the episode that may overrun its credit)."""
    rig, probes, ordinary = probe_run()
    assert len(probes) >= 5, f"{len(probes)} acceptance probes: the bound would be idle"
    assert ordinary >= 495 * MS
    # Exact: 99 P <= O + 99 D.
    assert 99 * sum(probes) <= ordinary + 99 * probes[-1], (sum(probes), ordinary, probes[-1])
    # Learning moved the choice: later rounds run wider than the prior alone allowed.
    first = decode_plans(rig.plans)[:5]
    last = decode_plans(rig.plans)[-50:]
    assert max(p.graph.token_capacity for p in last) > max(p.graph.token_capacity for p in first)


def test_an_acceptance_probe_pays_its_raw_device_interval_including_readiness_stalls():
    """Spec: "An acceptance episode pays one complete graph interval, including
    readiness stalls" and "exploration budgets use raw physical time": each probe
    costs the learning ledger the longest rank interval the rig reported (not
    less its readiness stall, not the longer host wall interval)."""
    rig, probes, _ = probe_run()
    assert probes
    assert rig.s.executions[SelectionReason.ACCEPTANCE_LEARNING] == len(probes)
    assert rig.s.learning_ledger.spent_ns == sum(probes)


def test_device_allocation_admits_the_best_causal_frontier_within_p():
    from runtime.coordinator.rounds import device_allocation

    joint = [[0.9, 0.8, 0.7], [0.6, 0.3, 0.1], [0.95, 0.9, 0.85]]
    # 3 pending rows, then 4 more: 0.95 (lane 2), 0.9 (lane 2, depth 2; ties with
    # lane 0 depth 1 go to the shorter prefix: lane 0 first), then 0.9 (lane 2), 0.85.
    assert device_allocation(joint, [4, 4, 4], [0, 1, 2], 7) == [2, 1, 4]
    assert device_allocation(joint, [4, 4, 2], [0, 1, 2], 7) == [4, 1, 2]  # ceilings hold
    assert device_allocation(joint, [4, 4, 4], [0, 1, 2], 3) == [1, 1, 1]  # pending rows only
    tie = [[0.5], [0.5]]
    assert device_allocation(tie, [2, 2], [5, 3], 3) == [1, 2]  # equal: the lower slot


def device_rig(p_accept: float = 0.9) -> tuple[Rig, list]:
    descs = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
             GraphDescriptor(GraphKind.DECODE, 2),
             GraphDescriptor(GraphKind.SPECULATIVE, 2, token_capacity=4, proposal_depth=3,
                             target_capacity=5, device_allocated=True)]  # fmt: skip
    rig = Rig(SchedulerConfig(16, 16, 4096), descs)
    rig.s.speculation.preseed("draft", [0.95, 0.9, 0.85])
    rig.measure_all()
    handles = rig.admit(2, p_accept, out=100)
    while rig.s.plan() is None or rig.s.plan().graph.kind is not GraphKind.SPECULATIVE:
        assert rig.step()
    return rig, handles


def test_a_device_allocated_round_completes_with_its_confidence_sidecar():
    rig, handles = device_rig()
    plan = rig.s.plan()
    assert [lane.max_tokens for lane in plan.lanes] == [4, 4]  # ceilings: sum 8 > P = 5
    rig.fence += 1
    rig.s.commit(plan, rig.fence)
    lanes = plan.lanes
    timing = ExecutionTiming((9 * MS,), host_wall_ns=9 * MS)
    records = [CompletionRecord(lane.slot, lane.generation, (1, 2)) for lane in lanes]
    with pytest.raises(CompletionError, match="complete_packed_round"):
        rig.s.complete(rig.fence, records, timing)
    joint = [[0.9, 0.5, 0.2], [0.8, 0.6, 0.1]]  # the device gave lane 0 two rows, lane 1 three
    conditional = [[0.9, 0.55, 0.4], [0.8, 0.75, 0.17]]
    for bad in ([conditional], [conditional, [[0.9, 1.5, 0.2], [0.8, 0.6, 0.1]]],
                [conditional, [[0.9, float("nan"), 0.2], [0.8, 0.6, 0.1]]],
                [conditional, [[0.9, 0.5], [0.8, 0.6, 0.1]]]):  # fmt: skip
        with pytest.raises(CompletionError):
            rig.s.complete_packed_round(rig.fence, records, timing, bad)
    too_many = [CompletionRecord(lanes[0].slot, lanes[0].generation, (1, 2, 3)), records[1]]
    with pytest.raises(CompletionError, match="from 2 allocated rows"):
        rig.s.complete_packed_round(rig.fence, too_many, timing, [conditional, joint])
    first = rig.s.request(handles[0]).speculation
    second = rig.s.request(handles[1]).speculation
    before = first.acceptance("draft").means(3), second.acceptance("draft").means(3)
    forecast_before, w = first.forecast.means(3), first.forecast.weight(1)  # aged by the prefill
    out = rig.s.complete_packed_round(rig.fence, records, timing, [conditional, joint])
    assert [g.tokens for g in out] == [(1, 2), (1, 2)]
    # Lane 0 offered one proposal (two rows) and it survived; lane 1 offered two and
    # the second was rejected: zero at depth 2, nothing at depth 3.
    after0, after1 = first.acceptance("draft").means(3), second.acceptance("draft").means(3)
    assert after0[0] == pytest.approx((2 * before[0][0] + 1) / 3)
    assert after0[1] == pytest.approx(before[0][1])  # not offered: unobserved
    assert after1[0] == pytest.approx((2 * before[1][0] + 1) / 3)
    assert after1[1] == pytest.approx((2 * before[1][1] + 0) / 3)
    # The forecast averages in the completed joint probabilities up to the ceiling
    # (4 rows: depths 1..3).
    expected = (w * forecast_before[0] + 0.9) / (w + 1)
    assert first.forecast.means(3)[0] == pytest.approx(expected)


def test_forecast_observes_to_min_d_plus_1_w_even_when_the_output_limit_caps_the_lane():
    """Spec: "Forecast observations stop at each lane's frozen min(D + 1, W)
    ceiling."  A device-allocated round with D = 3 whose lane has only 2 output
    tokens left still produced all three proposals: its forecast observes depths
    1..3, not only depth 1."""
    descs = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
             GraphDescriptor(GraphKind.DECODE, 1),
             GraphDescriptor(GraphKind.SPECULATIVE, 1, token_capacity=4, proposal_depth=3,
                             target_capacity=4, device_allocated=True)]  # fmt: skip
    rig = Rig(SchedulerConfig(16, 16, 4096), descs)
    rig.s.speculation.preseed("draft", [0.95, 0.9, 0.85])
    rig.measure_all()
    (handle,) = rig.admit(1, 0.9, out=3)  # the prefill commits one: 2 left
    while rig.s.plan() is None or rig.s.plan().graph.kind is not GraphKind.SPECULATIVE:
        assert rig.step()
    plan = rig.s.plan()
    assert [lane.max_tokens for lane in plan.lanes] == [2]  # capped by the output limit
    rig.fence += 1
    rig.s.commit(plan, rig.fence)
    (lane,) = plan.lanes
    forecast = rig.s.request(handle).speculation.forecast
    before = forecast.means(3)
    weights = [forecast.weight(d) for d in (1, 2, 3)]
    joint = [[0.7, 0.4, 0.2]]
    conditional = [[0.7, 4 / 7, 0.5]]
    timing = ExecutionTiming((9 * MS,), host_wall_ns=9 * MS)
    records = [CompletionRecord(lane.slot, lane.generation, (1, 2))]
    rig.s.complete_packed_round(rig.fence, records, timing, [conditional, joint])
    after = forecast.means(3)
    for d in range(3):
        assert after[d] == pytest.approx((weights[d] * before[d] + joint[0][d]) / (weights[d] + 1))
        assert after[d] != pytest.approx(before[d])


def test_survival_rows_replace_the_binary_observations():
    rig = Rig(SchedulerConfig(16, 16, 4096), catalog(widths=(4,), batches=(1,)))
    rig.s.speculation.preseed("draft", [0.9, 0.8, 0.7])
    rig.measure_all()
    (h,) = rig.admit(1, 0.5, out=100)
    rig.step()
    rig.s.advance_to(rig.now)
    plan = rig.s.plan()
    rig.fence += 1
    rig.s.commit(plan, rig.fence)
    lane = plan.lanes[0]
    acceptance = rig.s.request(h).speculation.acceptance("draft")
    before = acceptance.means(3)
    record = CompletionRecord(lane.slot, lane.generation, (1, 2))
    timing = ExecutionTiming((6 * MS,), host_wall_ns=6 * MS)
    with pytest.raises(CompletionError, match="must not increase"):
        rig.s.complete_with_survival(rig.fence, [record], timing, [[0.5, 0.7]])
    rig.s.complete_with_survival(rig.fence, [record], timing, [[0.8, 0.3, 0.1]])
    after = acceptance.means(3)
    assert after[0] == pytest.approx((2 * before[0] + 0.8) / 3)
    assert after[1] == pytest.approx((2 * before[1] + 0.3) / 3)
    assert after[2] == pytest.approx((2 * before[2] + 0.1) / 3)


def test_wide_mixed_programs_compete_like_speculative_rounds():
    mixed = [
        GraphDescriptor(GraphKind.MIXED, 4, token_capacity=4, proposal_depth=3, prompt_capacity=64),
        GraphDescriptor(GraphKind.MIXED, 4, token_capacity=1, prompt_capacity=64),
    ]
    descs = [*catalog(widths=(4,), batches=(1, 2, 4)), *mixed]

    def cost(desc: GraphDescriptor) -> float:  # proposals nearly free on the mixed program
        wide = desc.kind is GraphKind.MIXED and desc.token_capacity == 4
        return 5.5 if wide else cost_ms(desc)

    rig = Rig(SchedulerConfig(16, 16, 4096), descs, cost=cost)
    rig.s.speculation.preseed("draft", [0.95, 0.9, 0.85])
    rig.measure_all()
    rig.admit(2, 0.95, out=300)
    rig.run(20)  # two decoders running
    rig.admit(1, 0.95, out=300, prompt=64)  # a prompt arrives during decode
    rig.run(40)
    wide = [p for p in rig.plans if p.graph.kind is GraphKind.MIXED and p.graph.token_capacity == 4]
    assert wide, [p.graph.describe() for p in rig.plans]
    for plan in wide:
        rows = [lane.max_tokens for lane in plan.lanes if lane.phase.value == "decode"]
        assert rows and all(1 <= q <= 4 for q in rows) and sum(rows) <= plan.graph.target_capacity
        assert plan.prompt_row in (-1, 0)
    # Fixed width 4: decode rows run at width 4 only (a width-one mixed shape may
    # still carry a prompt row alone).
    fixed = Rig(SchedulerConfig(16, 16, 4096, fixed_speculative_width=4), descs, cost=cost)
    fixed.measure_all()
    fixed.admit(2, 0.95, out=300)
    fixed.run(20)
    fixed.admit(1, 0.95, out=300)
    fixed.run(40)
    for plan in fixed.plans:
        decoding = any(lane.phase.value == "decode" for lane in plan.lanes)
        if decoding:
            assert plan.graph.token_capacity == 4, plan.graph.describe()


def test_a_timing_refresh_runs_one_complete_speculative_program_paid_once():
    # Only speculative programs decode, so the stale alternative is one of them.
    descs = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)]
    descs += [spec(b, 4) for b in (1, 2, 4)]
    rig = Rig(SchedulerConfig(16, 16, 65536), descs)
    rig.s.speculation.preseed("draft", [0.95, 0.9, 0.85])
    rig.measure_all()
    rig.admit(4, 0.95, out=60_000)
    refreshes = []
    while not refreshes:
        assert rig.step()
        refreshes = [p for p in rig.plans if p.reason is SelectionReason.TIMING_REFRESH]
        if rig.now > 120_000 * MS:
            break
    assert refreshes, "no timing refresh within 120 s of simulated execution"
    ordinary = rig.s.execution_ns[SelectionReason.ORDINARY]
    assert ordinary >= 2_495 * MS  # the spec's funding of the first refresh
    plan = refreshes[0]
    rig.step()  # the refresh completes (the rig runs one frame at a time once it is out)
    while rig.inflight:
        rig.step()
    ledger = rig.s.refresh_ledger
    # Paid once, its whole interval (proposals and verification together).
    assert rig.s.executions[SelectionReason.TIMING_REFRESH] == 1
    assert ledger.spent_ns == int(cost_ms(plan.graph) * MS)
    assert plan.graph.kind is GraphKind.SPECULATIVE and plan.graph.batch_capacity < 4
    assert all(lane.max_tokens >= 1 for lane in plan.lanes)


def test_the_envelope_drops_wider_programs_at_load():
    descs = catalog(widths=(2, 4, 8), batches=(1, 2, 4, 8))
    s = Scheduler(descs, SchedulerConfig(16, 16, 4096, speculative_token_capacity=16))
    kept = [d for d in s.catalog.descriptors if d.kind is GraphKind.SPECULATIVE]
    assert kept and all(d.batch_capacity * d.token_capacity <= 16 for d in kept)
    assert spec(8, 2) in kept and spec(4, 8) not in kept and spec(2, 8) in kept
    decode = [d for d in s.catalog.descriptors if d.kind is GraphKind.DECODE]
    assert len(decode) == 4  # ordinary programs are not bounded
    with pytest.raises(ConfigError, match="speculative_token_capacity"):
        SchedulerConfig(speculative_token_capacity=-1)


# -- cohorts of ragged programs, evaluated against an exhaustive oracle ------------


def _lane_views(lanes: list[tuple[float, list[float], float, int]]):
    """LaneViews over stand-in requests: (decode value, survival, delivery price,
    output left) per lane, slots in order."""
    from types import SimpleNamespace

    from runtime.coordinator.policy import LaneView

    views, survival = [], {}
    for slot, (base, means, delivery, left) in enumerate(lanes):
        request = SimpleNamespace(
            slot=slot, remaining_output=left, inflight_output=0,
            handle=SimpleNamespace(id=slot),
        )  # fmt: skip
        view = LaneView(request, 0.0, delivery, 64, 0, 0, 0, base, slot)
        views.append(view)
        survival[slot] = means
    return views, lambda view, depth: survival[view.request.slot][:depth]


def _context(descs: list[GraphDescriptor], views):
    from runtime.coordinator.cost import CostCatalog
    from runtime.coordinator.policy import SelectionContext

    costs = CostCatalog(descs, ttl_ns=30_000 * MS)
    for desc in descs:
        costs.observe(desc, int(cost_ms(desc) * MS), 0)
    return SelectionContext(0, 0, 64.0, 30_000 * MS, costs, [], views, 0.0, 0.0)


def _round_value(views, survival, queries, beta=64.0) -> float:
    """A cohort's value at ``queries`` rows each: base + (beta + f/x) * s_1..s_(q-1)."""
    return sum(
        v.decode_value + sum(beta * s for s in survival(v, q - 1)[: q - 1])
        for v, q in zip(views, queries)
    )


def _causal_best(views, survival, b, w, p) -> float:
    """Exhaustive: every cohort of at most B lanes, each priced with its best
    causal allocation of P rows (pending rows, then the largest gains)."""
    from itertools import combinations

    best = 0.0
    for n in range(1, min(b, len(views)) + 1):
        if n > p:
            break
        for cohort in combinations(views, n):
            gains = sorted(
                (
                    64.0 * s
                    for v in cohort
                    for s in survival(v, w - 1)[: min(w, v.request.remaining_output) - 1]
                ),
                reverse=True,
            )
            value = sum(v.decode_value for v in cohort) + sum(gains[: p - n])
            best = max(best, value)
    return best


def test_a_ragged_program_evaluates_every_cohort_prefix_not_powers_of_two():
    """B = 4, W = 4, P = 6: three starving high-acceptance lanes and one low one.
    The 3-lane prefix (3 pending rows, one proposal each) beats both the 2-lane
    (two proposals each) and the 4-lane (the low lane takes a row) cohorts; a
    search over sizes 1, 2, 4 misses it."""
    from runtime.coordinator.rounds import speculative_candidates

    high = [0.95, 0.9, 0.85]
    views, survival = _lane_views(
        [(2000.0, high, 9.0, 100), (2000.0, high, 8.0, 100), (2000.0, high, 7.0, 100),
         (30.0, [0.05, 0.01, 0.0], 1.0, 100)]
    )  # fmt: skip
    ragged = spec(4, 4, 6)
    out = []
    speculative_candidates(_context([ragged], views), out, survival, 1.0)
    (cand,) = out
    assert len(cand.lanes) == 3 and cand.queries == [2, 2, 2]
    assert cand.value == pytest.approx(_causal_best(views, survival, 4, 4, 6))
    four = _round_value(views, survival, [2, 2, 1, 1])
    assert cand.value > four  # what the powers-of-two search picked


@pytest.mark.parametrize("seed", range(40))
def test_a_ragged_candidate_is_worth_at_least_every_prefix_of_the_value_order(seed):
    """Random lanes (values, survival, output limits) on a random ragged program:
    the candidate is never worth less than any cohort prefix of the total-value
    ordering, each priced with its best causal allocation."""
    from runtime.coordinator.rounds import speculative_candidates

    rng = random.Random(seed)
    lanes = []
    for _ in range(rng.randint(2, 7)):
        s, means = 1.0, []
        for _ in range(3):
            s *= rng.random()
            means.append(s)
        lanes.append((rng.uniform(0, 300), means, rng.uniform(0, 10), rng.randint(1, 6)))
    views, survival = _lane_views(lanes)
    b = rng.choice((2, 4))
    p = max(b, min(rng.randint(2, 12), b * 4 - 1))
    out = []
    speculative_candidates(_context([spec(b, 4, p)], views), out, survival, 1.0)
    (cand,) = out
    order = sorted(
        views, key=lambda v: -_round_value([v], survival, [min(4, v.request.remaining_output)])
    )
    for n in range(1, min(b, len(views), p) + 1):
        cohort = order[:n]
        gains = sorted(
            (
                64.0 * s
                for v in cohort
                for s in survival(v, 3)[: min(4, v.request.remaining_output) - 1]
            ),
            reverse=True,
        )
        value = sum(v.decode_value for v in cohort) + sum(gains[: p - n])
        assert cand.value >= value - 1e-9


def test_fixed_width_ragged_programs_keep_complete_prefixes_and_the_best_fitting_cohort():
    """Spec: fixed host allocation retains complete prefixes, shortened only by
    request limits; a constrained ragged graph selects the highest-value cohort
    fitting both B and P (no causal allocation)."""
    from itertools import combinations

    from runtime.coordinator.rounds import speculative_candidates

    high = [0.95, 0.9, 0.85]
    # Lane 3 has two tokens left: its complete prefix is 2 rows.
    views, survival = _lane_views(
        [(500.0, high, 3.0, 100), (400.0, high, 2.0, 100), (300.0, high, 1.0, 100),
         (350.0, high, 1.0, 2)]
    )  # fmt: skip
    ragged = spec(4, 4, 10)  # B x W = 16 > P = 10
    out = []
    speculative_candidates(_context([ragged], views), out, survival, 1.0, fixed_width=4)
    (cand,) = out
    limits = {v.request.slot: min(4, v.request.remaining_output) for v in views}
    assert cand.queries == [limits[v.request.slot] for v in cand.lanes]  # complete prefixes
    best = max(
        _round_value(c, survival, [limits[v.request.slot] for v in c])
        for n in range(1, 5)
        for c in combinations(views, n)
        if sum(limits[v.request.slot] for v in c) <= 10
    )
    assert cand.value == pytest.approx(best)
    assert sorted(v.request.slot for v in cand.lanes) == [0, 1, 3]  # 4 + 4 + 2 rows
