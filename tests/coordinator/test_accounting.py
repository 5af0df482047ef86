"""Funded timing refresh, execution counters, service accounting, publication and the
commit trace (spec, "Funded timing refresh", "Service accounting and publication";
docs/design.md, "Credit arithmetic, worked")."""

from __future__ import annotations

import math

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PolicyConfig, SchedulerConfig
from runtime.coordinator.credit import CAP_NS
from runtime.coordinator.errors import CommitError, PublicationError
from runtime.coordinator.plan import SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.refresh import TIMING_REFRESH_RATE
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from runtime.coordinator.service import update_rate
from scripts.scheduling_sim import Simulation, WorkloadConfig, make_workload
from tests.support.coordinator_rig import BaseRig

MS = 1_000_000
TOKEN = 7
FUNDING_NS = 2_495 * MS  # spec: credited ordinary execution that funds the first refresh
ORDINARY = SelectionReason.ORDINARY
DISCOVERY = SelectionReason.DISCOVERY
REFRESH = SelectionReason.TIMING_REFRESH

PREFILL_64 = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
DECODE_1 = GraphDescriptor(GraphKind.DECODE, 1)
DECODE_2 = GraphDescriptor(GraphKind.DECODE, 2)
DECODE_4 = GraphDescriptor(GraphKind.DECODE, 4)

COSTS_MS = {PREFILL_64: 50, DECODE_1: 250, DECODE_2: 150, DECODE_4: 120}


def records_for(plan) -> list[CompletionRecord]:
    return [
        CompletionRecord(lane.slot, lane.generation, (TOKEN,) * lane.max_tokens)
        for lane in plan.lanes
    ]


def credited_ns(timing: ExecutionTiming) -> int:
    """By hand: queued frames credit the max device interval, isolated ones max(device, wall)."""
    device = max(timing.rank_device_ns)
    return device if timing.queued else max(device, timing.host_wall_ns)


class Rig(BaseRig):
    """A Scheduler with a clock and fences; tallies what each completion should charge."""

    def __init__(self, catalog, costs_ms=None, policy=None, max_slots: int = 8) -> None:
        super().__init__(catalog, policy, max_slots, num_pages=4096)
        self.costs_ms = dict(COSTS_MS if costs_ms is None else costs_ms)
        self.charged = {reason: 0 for reason in SelectionReason}
        self.counts = {reason: 0 for reason in SelectionReason}
        self.ordinary_credit_ns = 0  # credited ordinary time with a positive device interval

    def complete(self, fence, plan, timing=None, *, publish=True):
        """Advance by the frame's wall time, complete it, publish its output at once."""
        if timing is None:
            device = self.costs_ms[plan.graph] * MS
            timing = ExecutionTiming((device,), host_wall_ns=device)
        self.tick(timing.host_wall_ns)
        out = self.s.complete(fence, records_for(plan), timing)
        raw = max(timing.rank_device_ns)
        self.counts[plan.reason] += 1
        self.charged[plan.reason] += credited_ns(timing) if raw > 0 else timing.host_wall_ns
        if plan.reason is ORDINARY and raw > 0:
            self.ordinary_credit_ns += credited_ns(timing)
        if publish:
            for g in out:
                # A finished request retires at completion: its publication returns False.
                assert self.s.published_output(g.handle, g.fence) is not g.finished
        return out

    def step(self, timing=None):
        plan = self.plan()
        self.complete(self.commit(plan), plan, timing)
        return plan


def is_ordinary_decode(plan) -> bool:
    return plan.graph.kind is GraphKind.DECODE and plan.reason is ORDINARY


# ------------------------------------------------------------- timing refresh

TTL_NS = 1_000 * MS


def three_decode_graphs():
    """Four decoders; decode B=1, B=2 and B=4 measured in that order, B=4 the winner.

    B=1 (one lane in 250 ms) ranks below B=2 (two lanes in 150 ms) but was measured
    earlier, so age and ordinary ranking disagree about which stale graph to refresh.
    """
    rig = Rig(
        (PREFILL_64, DECODE_1, DECODE_2, DECODE_4), policy=PolicyConfig(estimate_ttl_ns=TTL_NS)
    )
    for _ in range(4):
        rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=2_000))
    plan = rig.step_until(lambda p: p.graph == DECODE_4 and p.reason is ORDINARY)
    cat = rig.s.catalog
    assert len(plan.lanes) == 4
    assert cat.entry(DECODE_1).last_valid_ns < cat.entry(DECODE_2).last_valid_ns
    assert all(cat.entry(g).known for g in (DECODE_1, DECODE_2, DECODE_4))
    # Nothing but discovery and ordinary execution so far; discovery earned nothing.
    assert rig.s.refresh_ledger.earned_basis_ns == rig.ordinary_credit_ns
    return rig


def run_ordinary(rig: Rig, total_ns: int) -> None:
    """Execute ordinary measured frames totalling exactly ``total_ns`` of credited time."""
    left = total_ns
    while left > 0:
        plan = rig.plan()
        assert plan.reason is ORDINARY and plan.graph == DECODE_4, plan
        device = min(left, rig.costs_ms[plan.graph] * MS)
        rig.complete(rig.commit(plan), plan, ExecutionTiming((device,), host_wall_ns=device))
        left -= device


def fund_refresh(rig: Rig, needed_ns: int):
    """Run ``needed_ns`` of ordinary credit, checking the refresh waits for its last ns."""
    run_ordinary(rig, needed_ns - 1)
    assert not rig.s.refresh_ledger.full
    assert rig.plan().reason is ORDINARY
    run_ordinary(rig, 1)
    assert rig.s.refresh_ledger.full
    plan = rig.plan()
    assert plan.reason is REFRESH
    return plan


def test_refresh_fires_after_2495ms_of_credited_ordinary_execution():
    rig = three_decode_graphs()
    plan = fund_refresh(rig, FUNDING_NS - rig.ordinary_credit_ns)
    assert rig.s.refresh_ledger.earned_basis_ns == FUNDING_NS
    assert rig.s.refresh_ledger.balance_ns == CAP_NS
    assert plan.reason.value == "timing-refresh"
    assert plan.requires_empty_window
    # The stale alternative whose last touch is oldest, not the best-ranked one.
    assert plan.graph == DECODE_1
    assert plan.estimated_duration_ns == 250 * MS
    assert len(plan.lanes) == 1
    assert rig.s.catalog.entry(DECODE_4).fresh(rig.now, TTL_NS)
    assert not rig.s.catalog.entry(DECODE_1).fresh(rig.now, TTL_NS)
    assert not rig.s.catalog.entry(DECODE_2).fresh(rig.now, TTL_NS)


def test_refresh_spends_its_duration_into_debt_and_the_next_waits_for_full_credit():
    rig = three_decode_graphs()
    refresh = fund_refresh(rig, FUNDING_NS - rig.ordinary_credit_ns)
    fence = rig.commit(refresh)
    assert rig.s.refresh_ledger.episode_open
    assert rig.s.plan() is None  # the refresh frame drains the window
    earned = rig.s.refresh_ledger.earned_basis_ns
    timing = ExecutionTiming((250 * MS, 240 * MS), host_wall_ns=251 * MS)  # isolated: 251 ms
    rig.complete(fence, refresh, timing)
    ledger = rig.s.refresh_ledger
    assert not ledger.episode_open
    assert ledger.balance_ns == CAP_NS - 251 * MS  # -246 ms: debt
    assert ledger.spent_ns == 251 * MS
    assert ledger.earned_basis_ns == earned, "a refresh earns no credit"
    assert rig.s.executions[REFRESH] == 1
    assert rig.s.execution_ns[REFRESH] == 251 * MS
    assert rig.s.catalog.entry(DECODE_1).last_valid_ns == rig.now  # refreshed

    # Repaying 246 ms of debt and refilling 5 ms takes 251 ms / (0.002/0.998) of credit.
    needed = int(251 * MS / TIMING_REFRESH_RATE)
    assert needed == 251 * 499 * MS
    second = fund_refresh(rig, needed)
    # B=1 was just observed; B=2 now has the oldest last touch.
    assert second.graph == DECODE_2


def test_refresh_attempt_without_valid_timing_counts_as_a_touch_and_pays_wall_time():
    rig = three_decode_graphs()
    refresh = fund_refresh(rig, FUNDING_NS - rig.ordinary_credit_ns)
    assert refresh.graph == DECODE_1
    entry = rig.s.catalog.entry(DECODE_1)
    observed_at, estimate = entry.last_valid_ns, entry.estimate_ns
    fence = rig.commit(refresh)
    attempted_at = rig.now
    rig.complete(fence, refresh, ExecutionTiming((0, 0), host_wall_ns=40 * MS))
    # No valid observation: still stale with its old estimate, but attempted.
    assert (entry.last_valid_ns, entry.estimate_ns) == (observed_at, estimate)
    assert entry.last_attempt_ns == attempted_at
    assert not entry.fresh(rig.now, TTL_NS)
    # Its isolated wall time pays for the attempt.
    assert rig.s.refresh_ledger.balance_ns == CAP_NS - 40 * MS
    assert rig.s.execution_ns[REFRESH] == 40 * MS

    second = fund_refresh(rig, 40 * 499 * MS)
    # Ordered by the later of last valid observation and last attempt: B=2 is older now.
    assert second.graph == DECODE_2


def test_idle_zeroes_positive_credit_and_keeps_debt():
    rig = three_decode_graphs()
    assert rig.s.refresh_ledger.balance_ns > 0
    handles = [lane.handle for lane in rig.plan().lanes]
    # Cancelling everything while a frame is in flight is not idle.
    plan = rig.plan()
    fence = rig.commit(plan)
    balance = rig.s.refresh_ledger.balance_ns
    learning = rig.s.learning_ledger.balance_ns
    assert learning > 0
    for h in handles:
        assert rig.s.cancel(h)
    rig.tick(MS)
    assert rig.s.refresh_ledger.balance_ns == balance
    assert rig.s.learning_ledger.balance_ns == learning
    rig.complete(fence, plan)  # nothing runnable, nothing in flight: idle
    assert rig.s.refresh_ledger.balance_ns == 0
    assert rig.s.learning_ledger.balance_ns == 0
    assert rig.s.refresh_ledger.earned_basis_ns == rig.ordinary_credit_ns


def test_idle_keeps_refresh_debt():
    rig = three_decode_graphs()
    refresh = fund_refresh(rig, FUNDING_NS - rig.ordinary_credit_ns)
    rig.complete(rig.commit(refresh), refresh, ExecutionTiming((30 * MS,), host_wall_ns=30 * MS))
    assert rig.s.refresh_ledger.balance_ns == CAP_NS - 30 * MS
    for r in list(rig.s.active_requests()):
        assert rig.s.cancel(r.handle)
    rig.tick(10 * MS)
    assert rig.s.running == 0 and rig.s.in_flight == 0
    assert rig.s.refresh_ledger.balance_ns == CAP_NS - 30 * MS
    assert rig.s.learning_ledger.balance_ns == 0  # positive learning credit discarded


def test_discovery_earns_no_credit():
    rig = Rig((PREFILL_64, DECODE_1, DECODE_2))
    rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=100))
    rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=100))
    seen = 0
    for _ in range(4):
        plan = rig.plan()
        if plan.reason is DISCOVERY:
            seen += 1
            before = (rig.s.refresh_ledger.balance_ns, rig.s.learning_ledger.balance_ns)
            rig.complete(rig.commit(plan), plan)
            after = (rig.s.refresh_ledger.balance_ns, rig.s.learning_ledger.balance_ns)
            assert after == before
        else:
            rig.complete(rig.commit(plan), plan)
    assert seen >= 2
    assert rig.s.refresh_ledger.earned_basis_ns == rig.ordinary_credit_ns


def test_queued_frame_credits_max_device_and_isolated_frame_max_device_wall():
    rig = Rig((PREFILL_64, DECODE_1))
    rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=100))
    rig.step_until(is_ordinary_decode)
    basis = rig.s.refresh_ledger.earned_basis_ns
    balance = rig.s.refresh_ledger.balance_ns
    first = rig.plan()
    f1 = rig.commit(first)
    second = rig.plan()
    f2 = rig.commit(second)
    isolated = ExecutionTiming((90 * MS, 100 * MS), host_wall_ns=130 * MS)
    queued = ExecutionTiming((80 * MS, 110 * MS), host_wall_ns=250 * MS, queued=True)
    rig.complete(f1, first, isolated)
    assert rig.s.refresh_ledger.earned_basis_ns == basis + 130 * MS
    rig.s.advance_to(rig.now - 130 * MS + 250 * MS)  # wall of the queued frame since dispatch
    rig.now = rig.s.now_ns
    rig.s.complete(f2, records_for(second), queued)
    assert rig.s.refresh_ledger.earned_basis_ns == basis + 240 * MS
    assert rig.s.refresh_ledger.balance_ns == pytest.approx(
        balance + float(240 * MS * TIMING_REFRESH_RATE), rel=1e-12
    )
    assert rig.s.execution_ns[ORDINARY] == rig.charged[ORDINARY] + 110 * MS


def test_execution_counters_by_reason():
    rig = three_decode_graphs()
    refresh = fund_refresh(rig, FUNDING_NS - rig.ordinary_credit_ns)
    rig.complete(rig.commit(refresh), refresh)
    # An ordinary frame without a positive device interval: counted, charged its wall
    # time, and earning nothing.
    plan = rig.plan()
    basis = rig.s.refresh_ledger.earned_basis_ns
    rig.complete(rig.commit(plan), plan, ExecutionTiming((0,), host_wall_ns=7 * MS))
    assert rig.s.refresh_ledger.earned_basis_ns == basis
    rig.step()
    assert rig.counts[DISCOVERY] == 4  # prefill, decode B=1, B=2, B=4
    assert rig.counts[REFRESH] == 1
    assert rig.s.executions == rig.counts
    assert rig.s.execution_ns == rig.charged
    assert rig.s.executions[SelectionReason.ACCEPTANCE_LEARNING] == 0
    assert rig.s.execution_ns[REFRESH] == 250 * MS


def _sim_duration_ns(graph: GraphDescriptor) -> int:
    if graph.kind is GraphKind.PREFILL:
        return 8 * MS + graph.prompt_capacity // 64 * 2 * MS
    return 20 * MS + 2 * MS * graph.batch_capacity


@pytest.mark.parametrize("seed", [0, 1])
def test_refresh_spend_bound_over_a_simulated_run(seed):
    """P <= 0.002/0.998 * O + D with graphs going stale (a 400 ms freshness interval)."""
    catalog = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=c) for c in (64, 128, 256)]
    catalog += [GraphDescriptor(GraphKind.DECODE, b) for b in (1, 2, 4, 8)]
    scheduler = Scheduler(
        catalog, SchedulerConfig(max_slots=8), PolicyConfig(estimate_ttl_ns=400 * MS)
    )
    workload = make_workload(
        WorkloadConfig(
            requests=24,
            arrival_rate_per_s=3.0,
            prompt_len=(64, 256),
            output_len=(50, 400),
            seed=seed,
        )
    )
    sim = Simulation(scheduler, _sim_duration_ns, workload, jitter=0.1, seed=seed)
    state = {"P": 0, "D": 0, "checks": 0}
    rate = float(TIMING_REFRESH_RATE)

    def check(_sim) -> bool:
        p = scheduler.execution_ns[REFRESH]
        if p != state["P"]:
            state["D"] = p - state["P"]  # the last refresh episode's actual duration
            state["P"] = p
        o = scheduler.execution_ns[ORDINARY]
        assert scheduler.refresh_ledger.earned_basis_ns == o  # every frame had device time
        assert scheduler.refresh_ledger.spent_ns == p
        assert p <= rate * o + state["D"] + 1e-3
        state["checks"] += 1
        return False

    sim.run(until_ns=120_000 * MS, stop=check)
    check(sim)
    assert sim.done
    assert scheduler.executions[REFRESH] >= 2, "the run exercised refresh episodes"
    assert state["checks"] > 500
    refreshes = [t for t in sim.trace if t["reason"] == "timing-refresh"]
    assert len(refreshes) == scheduler.executions[REFRESH]
    assert all(t["refresh_credit_ns"] >= CAP_NS for t in refreshes)


# --------------------------------------------------------- service accounting

DECODE_COSTS = {PREFILL_64: 10, DECODE_1: 100}


def two_decoders():
    """Two decoders on one measured decode graph (B=1), both with token and delivery rates."""
    rig = Rig((PREFILL_64, DECODE_1), DECODE_COSTS)
    a = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=200))
    b = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=200))
    rig.step_until(is_ordinary_decode)
    for _ in range(4):
        rig.step_until(is_ordinary_decode)
        rig.step()
    for h in (a, b):
        r = rig.s.request(h)
        assert r.token_rate is not None and r.delivery_rate is not None
    return rig, (a, b)


def rates(rig: Rig, handle) -> tuple:
    r = rig.s.request(handle)
    return r.token_rate, r.delivery_rate


@pytest.mark.parametrize(
    ("timing", "dt_ns"),
    [
        (ExecutionTiming((130 * MS, 90 * MS), host_wall_ns=150 * MS), 150 * MS),
        (ExecutionTiming((130 * MS, 90 * MS), host_wall_ns=110 * MS), 130 * MS),
    ],
    ids=["isolated-wall-longer", "isolated-device-longer"],
)
def test_unselected_participant_is_starved_and_selected_one_served(timing, dt_ns):
    rig, handles = two_decoders()
    plan = rig.plan()
    (lane,) = plan.lanes
    served = lane.handle
    (unserved,) = [h for h in handles if h != served]
    ref = 1.0 / (rig.s.catalog.entry(DECODE_1).estimate_ns / 1e6)  # normalizer at commit
    tau = rig.s.policy.adaptation_ms
    x_s, z_s = rates(rig, served)
    x_u, z_u = rates(rig, unserved)
    fence = rig.commit(plan)
    rig.complete(fence, plan, timing, publish=False)
    # The 130 ms sample moves the estimate; the interval still uses commit's normalizer.
    dt = dt_ns / 1e6
    new_x_u, new_z_u = rates(rig, unserved)
    assert 1.0 / new_x_u == pytest.approx(1.0 / x_u + dt / (tau * ref), rel=1e-12)
    assert 1.0 / new_z_u == pytest.approx(1.0 / z_u + dt / (tau * ref), rel=1e-12)
    new_x_s, new_z_s = rates(rig, served)
    assert new_x_s == pytest.approx(update_rate(x_s, ref, dt, 1.0, tau), rel=1e-12)
    # Completion records zero deliveries.
    assert new_z_s == pytest.approx(update_rate(z_s, ref, dt, 0.0, tau), rel=1e-12)
    # The first publication replaces that with one delivery: a factor exp(1/(tau*dref)).
    assert rig.s.published_output(served, fence) is True
    assert rates(rig, served)[1] == pytest.approx(new_z_s * math.exp(1.0 / (tau * ref)), rel=1e-12)
    assert rates(rig, unserved) == (new_x_u, new_z_u)


def test_queued_frame_interval_is_max_device_interval():
    rig, handles = two_decoders()
    first = rig.plan()
    f1 = rig.commit(first)
    second = rig.plan()
    f2 = rig.commit(second)
    ref = 1.0 / (rig.s.catalog.entry(DECODE_1).estimate_ns / 1e6)
    tau = rig.s.policy.adaptation_ms
    rig.complete(f1, first, ExecutionTiming((100 * MS,), host_wall_ns=100 * MS))
    # The participant left out of the second frame is starved by its device interval.
    (idle,) = [h for h in handles if h != second.lanes[0].handle]
    x, z = rates(rig, idle)
    timing = ExecutionTiming((70 * MS, 95 * MS), host_wall_ns=400 * MS, queued=True)
    rig.s.advance_to(rig.now + 95 * MS)
    rig.s.complete(f2, records_for(second), timing)
    new_x, new_z = rates(rig, idle)
    assert 1.0 / new_x == pytest.approx(1.0 / x + 95.0 / (tau * ref), rel=1e-12)
    assert 1.0 / new_z == pytest.approx(1.0 / z + 95.0 / (tau * ref), rel=1e-12)


def test_service_comes_from_committed_counter_differences():
    """Two queued frames serving one decoder: each completion credits one token."""
    rig = Rig((PREFILL_64, DECODE_1), DECODE_COSTS)
    handle = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=200))
    rig.step_until(is_ordinary_decode)
    rig.step()
    ref = 1.0 / (rig.s.catalog.entry(DECODE_1).estimate_ns / 1e6)
    tau = rig.s.policy.adaptation_ms
    first = rig.plan()
    f1 = rig.commit(first)
    second = rig.plan()
    f2 = rig.commit(second)
    x0 = rig.s.request(handle).token_rate
    rig.complete(f1, first, ExecutionTiming((100 * MS,), host_wall_ns=100 * MS))
    x1 = rig.s.request(handle).token_rate
    assert x1 == pytest.approx(update_rate(x0, ref, 100.0, 1.0, tau), rel=1e-12)
    rig.complete(f2, second, ExecutionTiming((100 * MS,), host_wall_ns=100 * MS, queued=True))
    x2 = rig.s.request(handle).token_rate
    # One token, not the two committed since the second frame's commit.
    assert x2 == pytest.approx(update_rate(x1, ref, 100.0, 1.0, tau), rel=1e-12)


def prompt_rig():
    """A measured decoder, then a 192-token prompt (three 64-token chunks)."""
    rig = Rig((PREFILL_64, DECODE_1), DECODE_COSTS)
    rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=200))
    rig.step_until(is_ordinary_decode)  # decode measured: stream normalizers exist
    long = rig.s.admit(RequestSpec(prompt_len=192, max_output_tokens=8))
    return rig, long


def next_chunk(rig: Rig, long):
    """Run other work until the long prompt's next chunk is planned; return it uncommitted."""
    return rig.step_until(lambda p: p.graph == PREFILL_64 and p.lanes[0].handle == long)


def test_prompt_service_is_charged_when_the_prompt_completes():
    """docs/scheduling-utility.md, "Prompt service": chunks that do not finish
    the prompt starve the request like any unserved interval; the chunk that
    finishes it charges the whole prompt and its first output token."""
    rig, long = prompt_rig()
    tref = 1.0 / 100.0  # decode B=1: one token per 100 ms
    pref = 64 / 10.0  # prefill: 64 prompt tokens per 10 ms
    tau = rig.s.policy.adaptation_ms
    r = rig.s.request(long)
    first = next_chunk(rig, long)
    rig.complete(rig.commit(first), first)
    assert r.consumed_prompt == 64 and r.token_rate is not None
    assert r.accounted_prompt == 0  # nothing charged yet
    for consumed, output, charged in ((128, 0, 0), (192, 1, 192)):
        plan = next_chunk(rig, long)
        x = r.token_rate
        rig.complete(rig.commit(plan), plan)
        assert r.consumed_prompt == consumed and r.committed_output == output
        expected = update_rate(x, tref, 10.0, output, tau, charged, pref)
        assert r.token_rate == pytest.approx(expected, rel=1e-12)
        assert r.accounted_prompt == charged
    starved = update_rate(x, tref, 10.0, 0, tau)
    assert r.token_rate > starved * 2  # the whole prompt lowered the price at once


def test_a_started_prompt_is_not_outbid_by_a_newer_one():
    """Issue 26, "Nothing finishes a started prompt": two equal prompts of three
    chunks, the second arriving once the first has run one chunk.  The started
    one has waited longer and (its service charged only at its end) kept its
    price, so its chunks win until it finishes: first come, first finished.
    Charged per chunk instead, its first chunk lowered its price below the
    newcomer's starting price and the two interleaved."""
    rig = Rig((PREFILL_64, DECODE_1))
    first = rig.s.admit(RequestSpec(prompt_len=192, max_output_tokens=4))
    plan = rig.step_until(lambda p: p.graph == PREFILL_64)
    assert plan.lanes[0].handle == first
    rig.complete(rig.commit(plan), plan)
    second = rig.s.admit(RequestSpec(prompt_len=192, max_output_tokens=4))
    order = []
    for _ in range(4):
        plan = rig.step_until(lambda p: p.graph == PREFILL_64)
        order.append(plan.lanes[0].handle)
        rig.complete(rig.commit(plan), plan)
    assert order == [first, first, second, second]


def test_prompt_service_uses_the_normalizer_recorded_at_commit():
    """docs/scheduling-utility.md: "Normalizers are recorded at commit." """
    rig, long = prompt_rig()
    tau = rig.s.policy.adaptation_ms
    r = rig.s.request(long)
    first = next_chunk(rig, long)
    # Prefill samples become [10, 30] ms: estimate 20 ms.
    rig.complete(rig.commit(first), first, ExecutionTiming((30 * MS,), host_wall_ns=30 * MS))
    second = next_chunk(rig, long)
    rig.complete(rig.commit(second), second)  # samples [10, 30, 10]: estimate 10 ms
    last = next_chunk(rig, long)  # the chunk that finishes the prompt
    at_commit = 64 / (rig.s.catalog.entry(PREFILL_64).estimate_ns / 1e6)
    assert at_commit == pytest.approx(6.4)
    x = r.token_rate
    rig.commit(last)
    # Its own 100 ms sample moves the estimate to the median of [10, 30, 10, 100] = 20 ms.
    rig.complete(rig.fence, last, ExecutionTiming((100 * MS,), host_wall_ns=100 * MS))
    assert rig.s.catalog.entry(PREFILL_64).estimate_ns == 20 * MS
    expected = update_rate(x, 1.0 / 100.0, 100.0, 1, tau, 192, at_commit)
    at_completion = update_rate(x, 1.0 / 100.0, 100.0, 1, tau, 192, 64 / 20.0)
    assert r.token_rate == pytest.approx(expected, rel=1e-12), (
        f"normalized by the catalog at completion ({at_completion!r}), not at commit"
    )


def test_requests_admitted_after_commit_are_not_participants():
    rig, _ = two_decoders()
    plan = rig.plan()
    early = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    fence = rig.commit(plan)
    late = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    assert rig.s.request(early).resident and rig.s.request(late).resident
    rig.complete(fence, plan)
    # Resident at commit and unselected: a participant, starved from its starting rate.
    assert rig.s.request(early).token_rate is not None
    # Admitted after the commit: untouched by the frame's completion.
    r = rig.s.request(late)
    assert (r.token_rate, r.delivery_rate) == (None, None)


def test_zero_device_interval_contributes_no_service_and_no_cost_observation():
    rig, handles = two_decoders()
    plan = rig.plan()
    served = plan.lanes[0].handle
    entry = rig.s.catalog.entry(DECODE_1)
    before_rates = {h: rates(rig, h) for h in handles}
    before_cost = (entry.estimate_ns, entry.last_valid_ns, list(entry.samples))
    version = rig.s.catalog.version
    fence = rig.commit(plan)
    out = rig.complete(fence, plan, ExecutionTiming((0, 0), host_wall_ns=100 * MS), publish=False)
    assert [g.handle for g in out] == [served]  # the tokens themselves are committed
    assert {h: rates(rig, h) for h in handles} == before_rates
    assert (entry.estimate_ns, entry.last_valid_ns, list(entry.samples)) == before_cost
    assert rig.s.catalog.version == version
    # Its publication corrects no delivery but still resets the output age.
    rig.tick(3 * MS)
    assert rig.s.published_output(served, fence) is True
    assert {h: rates(rig, h) for h in handles} == before_rates
    assert rig.s.request(served).last_visible_ns == rig.now


def test_zero_device_first_burst_does_not_initialize_delivery_history():
    """Spec: only a frame with a positive device interval contributes a measured interval
    to service history; a first burst initializes z over its *measured* frame duration."""
    rig = Rig((PREFILL_64, DECODE_1), DECODE_COSTS)
    rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=200))
    rig.step_until(is_ordinary_decode)
    handle = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    plan = rig.step_until(lambda p: p.lanes[0].handle == handle)
    assert plan.graph == PREFILL_64  # its final chunk commits the first token
    fence = rig.commit(plan)
    rig.complete(fence, plan, ExecutionTiming((0,), host_wall_ns=40 * MS), publish=False)
    r = rig.s.request(handle)
    assert r.committed_output == 1
    token_rate = r.token_rate
    assert rig.s.published_output(handle, fence) is True
    assert r.last_visible_ns == rig.now
    assert r.token_rate == token_rate
    assert r.delivery_rate is None, (
        f"delivery history initialized to {r.delivery_rate!r} (1 / host wall ms) by a frame "
        "without a device interval"
    )


# ---------------------------------------------------------------- publication


def one_decoder():
    rig = Rig((PREFILL_64, DECODE_1), DECODE_COSTS)
    handle = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=200))
    rig.step_until(is_ordinary_decode)
    rig.step()
    assert rig.s.request(handle).delivery_rate is not None
    ref = 1.0 / (rig.s.catalog.entry(DECODE_1).estimate_ns / 1e6)
    return rig, handle, ref


def test_delivery_correction_applies_once_per_fence():
    rig, handle, ref = one_decoder()
    tau = rig.s.policy.adaptation_ms
    plan = rig.plan()
    fence = rig.commit(plan)
    rig.complete(fence, plan, publish=False)
    z = rates(rig, handle)[1]
    rig.tick(2 * MS)
    assert rig.s.published_output(handle, fence) is True
    corrected = rates(rig, handle)[1]
    assert corrected == pytest.approx(z * math.exp(1.0 / (tau * ref)), rel=1e-12)
    assert rig.s.request(handle).last_visible_ns == rig.now
    # A second publication of the same fence names output no longer unpublished:
    # the code raises PublicationError and changes nothing.
    rig.tick(2 * MS)
    with pytest.raises(PublicationError):
        rig.s.published_output(handle, fence)
    assert rates(rig, handle)[1] == corrected
    assert rig.s.request(handle).last_visible_ns == rig.now - 2 * MS


def test_publication_of_a_fence_already_covered_by_a_later_one_raises():
    """Publishing f2 covers the held-back f1; f1 named afterwards is no longer unpublished."""
    rig, handle, ref = one_decoder()
    tau = rig.s.policy.adaptation_ms
    first = rig.plan()
    f1 = rig.commit(first)
    rig.complete(f1, first, publish=False)
    second = rig.plan()
    f2 = rig.commit(second)
    rig.complete(f2, second, publish=False)
    z = rates(rig, handle)[1]
    assert rig.s.published_output(handle, f2) is True
    assert rates(rig, handle)[1] == pytest.approx(z * math.exp(1.0 / (tau * ref)), rel=1e-12)
    corrected, visible = rates(rig, handle)[1], rig.s.request(handle).last_visible_ns
    rig.tick(MS)
    with pytest.raises(PublicationError):
        rig.s.published_output(handle, f1)
    assert rates(rig, handle)[1] == corrected
    assert rig.s.request(handle).last_visible_ns == visible


def test_publication_after_the_next_completion_only_resets_age():
    rig, handle, _ = one_decoder()
    first = rig.plan()
    f1 = rig.commit(first)
    rig.complete(f1, first, publish=False)
    second = rig.plan()
    f2 = rig.commit(second)
    rig.complete(f2, second, publish=False)
    z = rates(rig, handle)[1]
    rig.tick(MS)
    assert rig.s.published_output(handle, f1) is True
    assert rates(rig, handle)[1] == z  # too late to correct fence f1's interval
    assert rig.s.request(handle).last_visible_ns == rig.now


def test_late_publication_of_an_older_fence_keeps_the_latest_fence_correctable():
    """The latest completion's first publication still counts its delivery."""
    rig, handle, ref = one_decoder()
    tau = rig.s.policy.adaptation_ms
    first = rig.plan()
    f1 = rig.commit(first)
    rig.complete(f1, first, publish=False)
    second = rig.plan()
    f2 = rig.commit(second)
    rig.complete(f2, second, publish=False)
    z = rates(rig, handle)[1]
    assert rig.s.published_output(handle, f1) is True  # late: no correction
    assert rates(rig, handle)[1] == z
    assert rig.s.published_output(handle, f2) is True  # f2's first publication
    assert rates(rig, handle)[1] == pytest.approx(z * math.exp(1.0 / (tau * ref)), rel=1e-12)


def test_cancelled_handle_publication_returns_false():
    rig, handle, _ = one_decoder()
    plan = rig.plan()
    fence = rig.commit(plan)
    rig.complete(fence, plan, publish=False)
    z = rates(rig, handle)
    plan2 = rig.plan()
    fence2 = rig.commit(plan2)
    assert rig.s.cancel(handle) is True
    # Still resident (in flight) but cancelled.
    assert rig.s.request(handle) is not None
    assert rig.s.published_output(handle, fence) is False
    assert rates(rig, handle) == z
    rig.complete(fence2, plan2, publish=False)
    assert rig.s.request(handle) is None
    assert rig.s.published_output(handle, fence) is False
    assert rig.s.published_output(handle, fence2) is False


def test_slot_reuse_gets_a_fresh_generation_and_is_not_charged_by_the_old_frame():
    rig = Rig((PREFILL_64, DECODE_1), DECODE_COSTS, max_slots=1)
    old = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=200))
    rig.step_until(is_ordinary_decode)
    rig.step()
    r_old = rig.s.request(old)
    slot, generation = r_old.slot, r_old.generation
    plan = rig.plan()
    fence = rig.commit(plan)
    assert rig.s.cancel(old) is True
    new = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    assert rig.s.waiting == 1
    out = rig.complete(fence, plan, publish=False)
    assert out == []  # nothing for the cancelled handle
    r_new = rig.s.request(new)
    assert r_new.resident and r_new.slot == slot
    assert r_new.generation == generation + 1
    assert (r_new.token_rate, r_new.delivery_rate) == (None, None)
    assert r_new.unpublished == {} and r_new.pending_delivery is None
    assert r_new.committed_output == 0 and r_new.consumed_prompt == 0
    assert rig.s.published_output(old, fence) is False
    nxt = rig.plan()
    assert [(lane.handle, lane.generation) for lane in nxt.lanes] == [(new, generation + 1)]


# ---------------------------------------------------------------------- trace


def test_each_commit_yields_one_trace_record():
    rig = three_decode_graphs()
    rig.s.drain_trace()
    refresh = fund_refresh(rig, FUNDING_NS - rig.ordinary_credit_ns)
    rig.s.drain_trace()
    plans = [refresh]
    fence = None
    for i in range(4):
        plan = plans[i] if i < len(plans) else rig.plan()
        entry = rig.s.catalog.entry(plan.graph)
        cost, last_valid = entry.estimate_ns, entry.last_valid_ns
        fence = rig.commit(plan)
        (record,) = rig.s.drain_trace()
        g = plan.graph
        assert record.fence == fence
        assert record.committed_at_ns == rig.now
        assert record.graph == g.describe()
        assert record.kind == g.kind.value
        assert (
            record.batch_capacity,
            record.token_capacity,
            record.proposal_depth,
            record.target_capacity,
            record.prompt_capacity,
        ) == (g.batch_capacity, g.token_capacity, g.proposal_depth, g.target_capacity, 0)
        assert record.active_rows == len(plan.lanes)
        assert record.requests == tuple(lane.handle.id for lane in plan.lanes)
        assert record.selected_cost_ns == cost == plan.estimated_duration_ns
        assert record.observation_age_ns == rig.now - last_valid
        assert record.reason == plan.reason.value
        assert record.refresh_credit_ns == rig.s.refresh_ledger.balance_ns
        assert record.learning_credit_ns == rig.s.learning_ledger.balance_ns
        assert record.value_rate_scaled == plan.value_rate_scaled
        assert record.log_scale == plan.log_scale
        assert record.to_json()["reason"] == plan.reason.value
        if plan.reason is REFRESH:
            assert record.refresh_credit_ns == CAP_NS  # full credit funds the episode
        rig.complete(fence, plan)
        assert rig.s.drain_trace() == []  # completion adds no record
    assert plans[0].reason is REFRESH


def test_trace_of_discovery_and_failed_commit():
    rig = Rig((PREFILL_64, DECODE_1), DECODE_COSTS)
    handle = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    plan = rig.plan()
    assert plan.reason is DISCOVERY
    fence = rig.commit(plan)
    (record,) = rig.s.drain_trace()
    assert record.reason == "discovery"
    assert record.selected_cost_ns == 0
    assert record.observation_age_ns is None
    assert record.prompt_capacity == 64 and record.kind == "prefill"
    assert record.refresh_credit_ns == 0
    rig.complete(fence, plan)
    stale = rig.plan()
    rig.s.cancel(handle)
    with pytest.raises(CommitError):
        rig.s.commit(stale, fence + 1)
    assert rig.s.drain_trace() == []


def test_prefill_frames_enter_history_before_any_decode_graph_is_measured():
    """Every measured frame is one interval for every participant, even before a
    generation graph is measured: both are starved; a chunk that does not finish
    its prompt is charged nothing yet (docs/scheduling-utility.md, "Prompt
    service")."""
    rig = Rig([PREFILL_64, DECODE_1])
    a = rig.s.admit(RequestSpec(prompt_len=256, max_output_tokens=8))
    b = rig.s.admit(RequestSpec(prompt_len=256, max_output_tokens=8))
    plan = rig.plan()
    assert plan.graph == PREFILL_64
    served = plan.lanes[0].handle
    idle = b if served == a else a
    rig.complete(rig.commit(plan), plan)
    rs, ri = rig.s.request(served), rig.s.request(idle)
    assert rs.token_rate is not None and ri.token_rate is not None
    # Neither prompt is complete: both are charged nothing and starved alike.
    assert (rs.accounted_prompt, ri.accounted_prompt) == (0, 0)
    assert rs.token_rate == ri.token_rate
    before = ri.token_rate
    plan = rig.plan()
    rig.complete(rig.commit(plan), plan)
    if plan.lanes[0].handle != idle:
        assert rig.s.request(idle).token_rate < before  # starved again, charged nothing
        assert rig.s.request(idle).accounted_prompt == 0
