"""The two-slot execution queue, its gates, and price projection over queued work
(spec, "Planning and the execution queue", "Duration estimates")."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PolicyConfig
from runtime.coordinator.errors import CommitError, CompletionError
from runtime.coordinator.plan import SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.service import update_rate
from runtime.coordinator.utility import decode_lane_value
from tests.support.coordinator_rig import BaseRig

MS = 1_000_000
TOKEN = 7

PREFILL_64 = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
PREFILL_128 = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=128)
DECODE_1 = GraphDescriptor(GraphKind.DECODE, 1)
DECODE_2 = GraphDescriptor(GraphKind.DECODE, 2)

# Device milliseconds each graph takes in these tests.
COSTS_MS = {
    PREFILL_64: 10,
    PREFILL_128: 15,
    DECODE_1: 100,
    DECODE_2: 120,
}


def records_for(plan) -> list[CompletionRecord]:
    return [
        CompletionRecord(lane.slot, lane.generation, (TOKEN,) * lane.max_tokens)
        for lane in plan.lanes
    ]


class Rig(BaseRig):
    """A Scheduler with a clock, fences, and frames that take ``costs_ms`` of device time."""

    def __init__(self, catalog, costs_ms=None, policy=None, max_slots: int = 8) -> None:
        super().__init__(catalog, policy, max_slots, num_pages=1024)
        self.costs_ms = dict(COSTS_MS if costs_ms is None else costs_ms)

    def cost_ns(self, graph) -> int:
        return self.costs_ms[graph] * MS

    def complete(self, fence, plan, *, device=None, wall=None, queued=False, publish=True):
        """Advance by the frame's wall time, complete it, publish its output at once."""
        device = self.cost_ns(plan.graph) if device is None else device
        wall = device if wall is None else wall
        self.tick(wall)
        timing = ExecutionTiming((device,), host_wall_ns=wall, queued=queued)
        out = self.s.complete(fence, records_for(plan), timing)
        if publish:
            for g in out:
                # A finished request retires at completion: its publication returns False.
                assert self.s.published_output(g.handle, g.fence) is not g.finished
        return out

    def step(self):
        plan = self.plan()
        self.complete(self.commit(plan), plan)
        return plan


def ordinary_decode(lanes: int | None = None):
    def predicate(plan) -> bool:
        return (
            plan.graph.kind is GraphKind.DECODE
            and plan.reason is SelectionReason.ORDINARY
            and (lanes is None or len(plan.lanes) == lanes)
        )

    return predicate


def single_decoder(catalog=(PREFILL_64, DECODE_1), costs_ms=None, policy=None, max_output=64):
    """One decoding request; its decode graph is measured and fresh."""
    rig = Rig(catalog, costs_ms, policy)
    handle = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=max_output))
    plan = rig.step_until(ordinary_decode())
    assert plan.lanes[0].handle == handle
    return rig, handle


def expected_end(rig: Rig, plan) -> int:
    return rig.now + rig.s.catalog.entry(plan.graph).estimate_ns


# ------------------------------------------------------------- two frame slots


def test_two_decode_frames_queue_back_to_back_and_a_third_is_refused():
    rig, handle = single_decoder()
    first = rig.plan()
    assert not first.requires_empty_window
    assert first.expected_start_ns == rig.now
    end_first = expected_end(rig, first)
    f1 = rig.commit(first)
    assert rig.s.in_flight == 1

    second = rig.s.plan()
    assert second is not None, "a fresh measured decode frame may be queued behind another"
    assert second.graph == DECODE_1 and second.reason is SelectionReason.ORDINARY
    assert not second.requires_empty_window
    assert second.lanes[0].handle == handle
    assert second.lanes[0].output_start == first.lanes[0].output_start + 1
    assert second.expected_start_ns == end_first
    f2 = rig.commit(second)
    assert rig.s.queue_fences == [f1, f2]

    assert rig.s.plan() is None, "only two frame slots"
    assert rig.s.in_flight == 2


def test_completions_must_come_in_fence_order():
    rig, handle = single_decoder()
    first = rig.plan()
    f1 = rig.commit(first)
    second = rig.plan()
    f2 = rig.commit(second)
    rig.tick(rig.cost_ns(DECODE_1))
    with pytest.raises(CompletionError):
        rig.s.complete(f2, records_for(second), ExecutionTiming((100 * MS,), queued=True))
    assert rig.s.queue_fences == [f1, f2]
    r = rig.s.request(handle)
    committed = r.committed_output
    out = rig.s.complete(f1, records_for(first), ExecutionTiming((100 * MS,)))
    assert [g.fence for g in out] == [f1]
    assert r.committed_output == committed + 1
    with pytest.raises(CompletionError):
        rig.s.complete(f1, records_for(first), ExecutionTiming((100 * MS,)))
    rig.tick(rig.cost_ns(DECODE_1))
    out = rig.s.complete(f2, records_for(second), ExecutionTiming((100 * MS,), queued=True))
    assert [g.fence for g in out] == [f2]
    assert r.committed_output == committed + 2
    assert rig.s.queue_fences == []


def test_second_slot_frees_after_head_completion():
    rig, _ = single_decoder()
    first = rig.plan()
    f1 = rig.commit(first)
    second = rig.plan()
    rig.commit(second)
    assert rig.s.plan() is None
    rig.complete(f1, first)
    third = rig.s.plan()
    assert third is not None
    # Planned behind the remaining frame: it starts at that frame's expected end.
    assert third.expected_start_ns == first.planned_at_ns + 2 * rig.cost_ns(DECODE_1)
    assert third.lanes[0].output_start == second.lanes[0].output_start + 1


# -------------------------------------------- only ordinary decode may queue


def decoder_and_prefill():
    """A measured decoder with a decode plan in hand, then a new prompt whose prefill wins."""
    rig, decoder = single_decoder()
    decode_plan = rig.plan()
    assert decode_plan.graph == DECODE_1 and not decode_plan.requires_empty_window
    newcomer = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    prefill_plan = rig.plan()
    assert prefill_plan.graph == PREFILL_64
    assert prefill_plan.reason is SelectionReason.ORDINARY
    assert prefill_plan.lanes[0].handle == newcomer
    assert prefill_plan.requires_empty_window, "prefill drains the window"
    return rig, decoder, newcomer, decode_plan, prefill_plan


def test_nothing_is_planned_while_a_prefill_frame_is_in_flight():
    rig, decoder, _, _, prefill_plan = decoder_and_prefill()
    fence = rig.commit(prefill_plan)
    assert rig.s.request(decoder).runnable
    assert rig.s.plan() is None
    rig.tick(MS)
    assert rig.s.plan() is None
    rig.complete(fence, prefill_plan)
    assert rig.s.plan() is not None


def test_prefill_plan_cannot_be_committed_behind_a_decode_frame():
    rig, _, _, decode_plan, prefill_plan = decoder_and_prefill()
    fence = rig.commit(decode_plan)
    rig.s.drain_trace()
    with pytest.raises(CommitError):
        rig.s.commit(prefill_plan, fence + 1)
    assert rig.s.queue_fences == [fence]
    assert rig.s.drain_trace() == []
    # Once the window drains, the same prefill plan commits.
    rig.complete(fence, decode_plan)
    rig.s.commit(prefill_plan, fence + 1)
    assert rig.s.queue_fences == [fence + 1]


def test_decode_plan_cannot_be_committed_behind_a_prefill_frame():
    rig, _, _, decode_plan, prefill_plan = decoder_and_prefill()
    fence = rig.commit(prefill_plan)
    with pytest.raises(CommitError):
        rig.s.commit(decode_plan, fence + 1)
    assert rig.s.queue_fences == [fence]


def test_queued_decode_yields_to_a_better_prefill_gate():
    """A winner that needs an empty window blocks queueable but lower-value decode work."""
    rig, _, newcomer, decode_plan, _ = decoder_and_prefill()
    fence = rig.commit(decode_plan)
    assert rig.s.plan() is None
    rig.complete(fence, decode_plan)
    plan = rig.plan()
    assert plan.graph == PREFILL_64 and plan.lanes[0].handle == newcomer


# ------------------------------------------------------- unknown graph gate


def test_unknown_winner_waits_for_an_empty_queue_and_discovers_then():
    rig, decoder = single_decoder(catalog=(PREFILL_64, PREFILL_128, DECODE_1))
    assert not rig.s.catalog.entry(PREFILL_128).known
    queued_decode = rig.plan()
    fence = rig.commit(queued_decode)
    before_admission = rig.s.plan()
    assert before_admission is not None and before_admission.graph == DECODE_1
    assert not before_admission.requires_empty_window

    newcomer = rig.s.admit(RequestSpec(prompt_len=128, max_output_tokens=8))
    # The unmeasured prefill-128 wins; it needs completion feedback, so nothing is
    # submitted while the decode frame is queued, although decode could queue.
    assert rig.s.plan() is None
    rig.tick(10 * MS)
    assert rig.s.plan() is None
    rig.complete(fence, queued_decode)

    discovery = rig.plan()
    assert discovery.graph == PREFILL_128
    assert discovery.reason is SelectionReason.DISCOVERY
    assert discovery.requires_empty_window
    assert discovery.estimated_duration_ns == 0
    assert discovery.lanes[0].handle == newcomer
    assert discovery.lanes[0].prompt_tokens == 128
    rig.commit(discovery)
    assert rig.s.plan() is None, "a discovery frame blocks queueing behind it"
    assert rig.s.request(decoder).runnable


def test_discovery_plan_cannot_be_committed_behind_a_queued_frame():
    rig, _ = single_decoder(catalog=(PREFILL_64, PREFILL_128, DECODE_1))
    decode_plan = rig.plan()
    rig.s.admit(RequestSpec(prompt_len=128, max_output_tokens=8))
    discovery = rig.plan()
    assert discovery.reason is SelectionReason.DISCOVERY
    assert discovery.requires_empty_window
    fence = rig.commit(decode_plan)
    with pytest.raises(CommitError):
        rig.s.commit(discovery, fence + 1)
    assert rig.s.queue_fences == [fence]
    rig.complete(fence, decode_plan)
    rig.s.commit(discovery, fence + 1)
    assert rig.s.queue_fences == [fence + 1]


# ------------------------------------------------------------------- overrun


def test_overrun_suspends_queueing_until_completion():
    rig, _ = single_decoder()
    first = rig.plan()
    end = expected_end(rig, first)
    fence = rig.commit(first)
    rig.s.advance_to(end)
    saved = rig.s.plan()
    assert saved is not None, "reaching the expected end is not yet an overrun"
    assert saved.expected_start_ns == end
    rig.s.advance_to(end + 1)
    rig.now = end + 1
    assert rig.s.plan() is None
    rig.tick(50 * MS)
    assert rig.s.plan() is None
    with pytest.raises(CommitError):
        rig.s.commit(saved, fence + 1)
    assert rig.s.queue_fences == [fence]

    rig.s.complete(fence, records_for(first), ExecutionTiming((150 * MS,), host_wall_ns=151 * MS))
    after = rig.plan()
    assert after.graph == DECODE_1, "an overrun does not make the graph ineligible"
    assert after.reason is SelectionReason.ORDINARY
    assert not after.requires_empty_window
    f2 = rig.commit(after)
    again = rig.s.plan()
    assert again is not None and again.graph == DECODE_1  # queueing resumed
    assert rig.s.queue_fences == [f2]


def test_no_millisecond_cap_on_frames_or_queue():
    costs = {**COSTS_MS, DECODE_1: 20_000}  # a 20-second decode frame
    rig, _ = single_decoder(costs_ms=costs)
    assert rig.s.catalog.entry(DECODE_1).estimate_ns == 20_000 * MS
    first = rig.plan()
    rig.commit(first)
    second = rig.s.plan()
    assert second is not None
    assert second.expected_start_ns == rig.now + 20_000 * MS
    rig.commit(second)
    assert rig.s.in_flight == 2


# ------------------------------------------------------------- host feedback


def decoder_then_limited(spec: RequestSpec):
    """A decoder on the measured two-row decode graph, then ``spec`` also decoding."""
    rig = Rig((PREFILL_64, DECODE_2))
    steady = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=64))
    rig.step_until(ordinary_decode(1))
    special = rig.s.admit(spec)
    plan = rig.step_until(ordinary_decode(2))
    assert {lane.handle for lane in plan.lanes} == {steady, special}
    return rig, steady, special, plan


@pytest.mark.parametrize("flag", ["host_stop", "grammar"])
def test_host_stop_request_waits_for_its_in_flight_frame(flag):
    rig, steady, special, first = decoder_then_limited(
        RequestSpec(prompt_len=64, max_output_tokens=64, **{flag: True})
    )
    fence = rig.commit(first)
    second = rig.plan()
    assert [lane.handle for lane in second.lanes] == [steady]
    rig.complete(fence, first)
    third = rig.plan()
    assert special in {lane.handle for lane in third.lanes}


def test_request_at_its_output_limit_after_in_flight_frame_is_not_queued():
    # The final prefill chunk commits the first token; one decode token remains.
    rig, steady, special, first = decoder_then_limited(
        RequestSpec(prompt_len=64, max_output_tokens=2)
    )
    r = rig.s.request(special)
    assert r.committed_output == 1
    fence = rig.commit(first)
    second = rig.plan()
    assert [lane.handle for lane in second.lanes] == [steady]
    second_fence = rig.commit(second)
    out = rig.complete(fence, first)
    finished = next(g for g in out if g.handle == special)
    assert finished.finished and finished.finish_reason == "length"
    rig.complete(second_fence, second, queued=True)
    assert rig.s.request(special) is None  # retired


# ----------------------------------------------------------------- projection


def decoders_on(graph, costs_ms=None):
    """Two decoding requests with published output, rates, and ``graph`` measured."""
    rig = Rig((PREFILL_64, graph), costs_ms)
    a = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=200))
    b = rig.s.admit(RequestSpec(prompt_len=64, max_output_tokens=200))
    rig.step_until(ordinary_decode())
    for _ in range(3):
        rig.step_until(ordinary_decode())
        rig.step()
    for h in (a, b):
        r = rig.s.request(h)
        assert r.token_rate is not None and r.delivery_rate is not None
        assert r.last_visible_ns is not None
    rig.tick(7 * MS)  # some output age before the next plan
    return rig, (a, b)


def projected_lane_values(rig: Rig, first, handles) -> dict:
    """By hand: each decoder's lane value at the queued frame's expected end."""
    s = rig.s
    pol = s.policy
    tau = pol.adaptation_ms
    t_ms = s.catalog.entry(first.graph).estimate_ns / 1e6
    # One decode graph in these catalogs: the normalizers are its per-stream rate.
    ref = 1.0 / t_ms
    # sigma = K * T / min(B, K) for K decoders.
    k = len(handles)
    sigma = k * t_ms / min(first.graph.batch_capacity, k)
    slope = pol.decode_age_price * sigma
    start = rig.now + s.catalog.entry(first.graph).estimate_ns
    served = {lane.handle: lane for lane in first.lanes}
    out = {}
    for h in handles:
        r = s.request(h)
        lane = served.get(h)
        tokens = lane.expected_tokens if lane else 0.0
        deliveries = lane.expected_deliveries if lane else 0.0
        x = update_rate(r.token_rate, ref, t_ms, tokens, tau)
        z = update_rate(r.delivery_rate, ref, t_ms, deliveries, tau)
        last_visible = start if lane else r.last_visible_ns  # the queued expected delivery
        age_ms = (start - last_visible) / 1e6
        value = decode_lane_value(
            1.0, 1.0, pol.token_fairness / x, pol.delivery_fairness / z, pol.output_token_value
        )
        out[h] = value + slope * age_ms + slope * t_ms
    return out


def unprojected_lane_value(rig: Rig, graph, handle, k: int) -> float:
    s = rig.s
    pol = s.policy
    r = s.request(handle)
    t_ms = s.catalog.entry(graph).estimate_ns / 1e6
    sigma = k * t_ms / min(graph.batch_capacity, k)
    slope = pol.decode_age_price * sigma
    age_ms = (rig.now - r.last_visible_ns) / 1e6
    value = decode_lane_value(
        1.0,
        1.0,
        pol.token_fairness / r.token_rate,
        pol.delivery_fairness / r.delivery_rate,
        pol.output_token_value,
    )
    return value + slope * age_ms + slope * t_ms


def test_projection_of_served_lanes_prices_and_ages():
    rig, handles = decoders_on(DECODE_2)
    first = rig.plan()
    assert len(first.lanes) == 2
    # The unqueued plan values lanes at now, from the observed prices and ages.
    for lane in first.lanes:
        assert lane.value == pytest.approx(
            unprojected_lane_value(rig, DECODE_2, lane.handle, 2), rel=1e-12
        )
    rates = {h: (rig.s.request(h).token_rate, rig.s.request(h).delivery_rate) for h in handles}
    visible = {h: rig.s.request(h).last_visible_ns for h in handles}
    expected = projected_lane_values(rig, first, handles)
    rig.commit(first)

    second = rig.plan()
    assert second.expected_start_ns == first.planned_at_ns + 120 * MS
    assert len(second.lanes) == 2
    for lane in second.lanes:
        assert lane.value == pytest.approx(expected[lane.handle], rel=1e-12)
        # Projection really changed the value: not the observed prices and ages.
        assert lane.value != pytest.approx(
            unprojected_lane_value(rig, DECODE_2, lane.handle, 2), rel=1e-9
        )
    # Projection works on copies: nothing observed changed.
    for h in handles:
        r = rig.s.request(h)
        assert (r.token_rate, r.delivery_rate) == rates[h]
        assert r.last_visible_ns == visible[h]


def test_projection_starves_an_unserved_decoder_and_keeps_its_observed_age():
    rig, handles = decoders_on(DECODE_1)
    first = rig.plan()
    assert len(first.lanes) == 1
    expected = projected_lane_values(rig, first, handles)
    served = first.lanes[0].handle
    (unserved,) = [h for h in handles if h != served]
    rig.commit(first)

    second = rig.plan()
    assert second.expected_start_ns == first.planned_at_ns + 100 * MS
    (lane,) = second.lanes
    assert lane.handle == max(expected, key=expected.get)
    assert lane.value == pytest.approx(expected[lane.handle], rel=1e-12)
    # The unserved decoder is starved by the queued interval and aged from its
    # last actual publication to the queue's expected end.
    assert lane.handle == unserved
    assert lane.value > unprojected_lane_value(rig, DECODE_1, unserved, 2)


# ------------------------------------------------------ commit rechecks freshness


def test_commit_rechecks_freshness_of_a_saved_plan():
    policy = PolicyConfig(estimate_ttl_ns=50 * MS)
    costs = {**COSTS_MS, DECODE_1: 200}  # the frame outlasts the freshness interval
    rig, handle = single_decoder(costs_ms=costs, policy=policy)
    entry = rig.s.catalog.entry(DECODE_1)
    first = rig.plan()
    assert not first.requires_empty_window
    fence = rig.commit(first)
    saved = rig.plan()  # planned while fresh, queueable
    assert not saved.requires_empty_window and saved.reason is SelectionReason.ORDINARY
    observed_at = entry.last_valid_ns

    rig.tick(60 * MS)  # stale now, but well before the head frame's expected end
    assert not entry.fresh(rig.now, policy.estimate_ttl_ns)
    assert rig.now < first.planned_at_ns + 200 * MS
    rig.s.drain_trace()
    with pytest.raises(CommitError):
        rig.s.commit(saved, fence + 1)
    assert rig.s.queue_fences == [fence]
    assert rig.s.drain_trace() == []

    # The head completes without a valid device interval: the graph stays stale.
    rig.tick(140 * MS)
    rig.s.complete(fence, records_for(first), ExecutionTiming((0,), host_wall_ns=200 * MS))
    assert entry.last_valid_ns == observed_at
    assert rig.s.request(handle).committed_output == saved.lanes[0].output_start

    # Into an empty queue the saved plan is accepted, as a frame needing feedback.
    rig.s.commit(saved, fence + 1)
    assert rig.s.queue_fences == [fence + 1]
    assert rig.s.plan() is None


def test_completion_rebases_expected_ends_so_an_early_overrun_does_not_suspend_the_next():
    """The head overran by 3 ms; once it completes, the frame behind it has only
    just started, so queueing resumes (no false overrun, no accumulated drift)."""
    rig, _ = single_decoder(max_output=200)
    first = rig.plan()
    f1 = rig.commit(first)
    second = rig.plan()
    f2 = rig.commit(second)
    estimate = second.estimated_duration_ns
    rig.complete(f1, first, device=estimate + 3 * MS, wall=estimate + 3 * MS)
    head = rig.s._queue.head
    assert head.fence == f2
    assert head.expected_end_ns == rig.now + estimate
    assert rig.s.plan() is not None  # queueing behind the new head is allowed
