"""DirectScheduler through its public API: FCFS prefills, decode value per time,
discovery, lane invariants, cancellation, fairness, commit and completion checks."""

from __future__ import annotations

import random

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.errors import CommitError, CompletionError, SchedulerError
from runtime.coordinator.plan import LanePhase, SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.direct import DirectScheduler
from tests.support.direct_rig import MS, Rig, S, catalog, decode, prefill, records_for, timing


def table(ms: dict[GraphDescriptor, float]):
    ns = {d.key: round(t * MS) for d, t in ms.items()}
    return lambda g: ns[g.key]


def decode_costs(**batches: float):
    """Cost function: prefills 2 ms, decode B=b costs batches[f"b{b}"] ms."""
    return lambda g: (
        2 * MS if g.kind is GraphKind.PREFILL else round(batches[f"b{g.batch_capacity}"] * MS)
    )


def prompts_done(rig: Rig) -> None:
    """Run frames until no resident request is in its prompt."""
    while True:
        plan = rig.s.plan()
        assert plan is not None
        if plan.graph.kind is not GraphKind.PREFILL:
            return
        rig.complete(rig.commit(plan), plan)


# ------------------------------------------------------------------ prefill
def test_prefills_are_first_come_first_served_on_the_smallest_fitting_program() -> None:
    rig = Rig(catalog(prompts=(64, 256)))
    a, b, c = rig.admit(100, 3), rig.admit(30, 3), rig.admit(300, 3)
    plans = rig.run()
    prefills = [p for p in plans if p.graph.kind is GraphKind.PREFILL]
    assert all(p.graph.kind is GraphKind.DECODE for p in plans[len(prefills) :])
    got = [
        (p.lanes[0].handle, p.graph.prompt_capacity, p.lanes[0].prompt_start,
         p.lanes[0].prompt_tokens, p.lanes[0].max_tokens)
        for p in prefills
    ]  # fmt: skip
    assert got == [
        (a, 256, 0, 100, 1),  # the smallest program holding the whole prompt
        (b, 64, 0, 30, 1),
        (c, 256, 0, 256, 0),  # nothing holds 300: the largest, a chunk, no token
        (c, 64, 256, 44, 1),  # the rest: the prompt row commits its first token
    ]
    assert all(p.requires_empty_window and len(p.lanes) == 1 for p in prefills)


def test_a_new_prompt_goes_before_further_decode_rounds_and_waits_for_the_window() -> None:
    rig = Rig(catalog(batches=(1, 2)), cost=decode_costs(b1=1, b2=1.5))
    rig.measure_all()
    old = [rig.admit(10, 50) for _ in range(4)]
    prompts_done(rig)
    first = rig.s.plan()
    f1 = rig.commit(first)
    second = rig.s.plan()
    assert second is not None and second.graph.kind is GraphKind.DECODE
    f2 = rig.commit(second)  # two decode rounds in flight
    assert rig.s.in_flight == 2 and rig.s.plan() is None
    late = rig.admit(20, 5)
    rig.complete(f1, first)
    assert rig.s.plan() is None  # the prompt waits for an empty window; no decode meanwhile
    rig.complete(f2, second)
    plan = rig.s.plan()
    assert plan.graph.kind is GraphKind.PREFILL and plan.lanes[0].handle == late
    assert {lane.handle for lane in first.lanes + second.lanes} == set(old)


def test_boundaries_limit_a_chunk() -> None:
    rig = Rig(catalog(prompts=(64, 256)))
    h = rig.admit(100, 2, boundaries=(40,))
    plan = rig.s.plan()
    assert (plan.lanes[0].prompt_tokens, plan.graph.prompt_capacity, plan.lanes[0].max_tokens) == (
        40, 64, 0,
    )  # fmt: skip
    rig.complete(rig.commit(plan), plan)
    plan = rig.s.plan()
    assert (plan.lanes[0].handle, plan.lanes[0].prompt_start, plan.lanes[0].prompt_tokens) == (
        h, 40, 60,
    )  # fmt: skip


# ------------------------------------------------------------------- decode
def best_rate(decoders: int, costs_ms: dict[int, float]) -> int:
    """The batch capacity the spec's decode rule picks: most lanes per ms, among the
    programs smaller than the decoders and the smallest one holding them all."""
    fitting = [b for b in costs_ms if b >= decoders]
    competing = [b for b in costs_ms if b < decoders] + ([min(fitting)] if fitting else [])
    return max(competing, key=lambda b: (min(b, decoders) / costs_ms[b], min(b, decoders)))


@pytest.mark.parametrize("decoders", [1, 2, 3, 4, 5, 8, 12])
def test_decode_picks_the_most_lanes_per_estimated_time(decoders: int) -> None:
    costs = {1: 1.0, 2: 1.5, 4: 5.0, 8: 6.0}
    cost = decode_costs(**{f"b{b}": t for b, t in costs.items()})
    rig = Rig(catalog(batches=tuple(costs)), cost=cost, max_slots=16)
    rig.measure_all()
    for _ in range(decoders):
        rig.admit(10, 30)
    prompts_done(rig)
    plan = rig.s.plan()
    want = best_rate(decoders, costs)
    assert plan.graph == decode(want) and plan.reason is SelectionReason.ORDINARY
    assert len(plan.lanes) == min(want, decoders)
    assert plan.estimated_duration_ns == round(costs[want] * MS)
    assert plan.value_rate_scaled == pytest.approx(len(plan.lanes) / costs[want])
    assert not plan.requires_empty_window


def test_equal_rates_prefer_more_lanes_then_the_smaller_program() -> None:
    rig = Rig(catalog(batches=(2, 4, 8)), cost=decode_costs(b2=2, b4=4, b8=4))
    rig.measure_all()
    for _ in range(4):
        rig.admit(10, 5)
    prompts_done(rig)
    assert rig.s.plan().graph == decode(4)  # 4 lanes / 4 ms: B=2 ties on rate, B=8 pads


def test_padding_never_wins_even_when_estimated_faster() -> None:
    rig = Rig(catalog(batches=(2, 4)), cost=decode_costs(b2=3, b4=2))
    rig.measure_all()
    for _ in range(2):
        rig.admit(10, 5)
    prompts_done(rig)
    assert rig.s.plan().graph == decode(2)  # B=4 serves the same two lanes, padded


def test_discovery_takes_unmeasured_programs_first_serving_the_most_decoders() -> None:
    rig = Rig(catalog(batches=(1, 2, 4, 8)))
    for _ in range(3):
        rig.admit(10, 40)
    prompts_done(rig)
    order = []
    for _ in range(3):
        plan = rig.s.plan()
        assert plan.reason is SelectionReason.DISCOVERY and plan.requires_empty_window
        assert plan.estimated_duration_ns == 0
        order.append((plan.graph.batch_capacity, len(plan.lanes)))
        fence = rig.commit(plan)
        assert rig.s.plan() is None  # nothing goes behind a discovery frame
        rig.complete(fence, plan)
    # The smallest fitting all three (4), then those serving the most: 2, then 1.
    # B=8 serves the same three as B=4, padded: it never competes.
    assert order == [(4, 3), (2, 2), (1, 1)]
    plan = rig.s.plan()
    assert plan.reason is SelectionReason.ORDINARY
    assert rig.s.catalog.estimates()["decode B=8"] == 0
    assert rig.s.executions[SelectionReason.DISCOVERY] == 3 + 1  # and the prefill program
    assert rig.s.execution_ns[SelectionReason.DISCOVERY] > 0


def test_discovery_with_more_decoders_than_any_program_takes_the_largest() -> None:
    rig = Rig(catalog(batches=(1, 2, 4)), max_slots=8)
    for _ in range(6):
        rig.admit(10, 40)
    prompts_done(rig)
    plan = rig.s.plan()
    assert (plan.graph, len(plan.lanes), plan.reason) == (decode(4), 4, SelectionReason.DISCOVERY)


def test_discovery_waits_for_an_empty_window() -> None:
    rig = Rig(catalog(batches=(1, 2)), cost=decode_costs(b1=1, b2=1.5))
    rig.measure_all()
    for _ in range(4):
        rig.admit(10, 40)
    prompts_done(rig)
    first = rig.s.plan()
    fence = rig.commit(first)
    rig.tick(30 * S)  # every estimate reverts meanwhile
    assert rig.s.plan() is None  # the other two decoders need a discovery round
    rig.complete(fence, first)
    plan = rig.s.plan()
    assert plan.reason is SelectionReason.DISCOVERY


def test_the_estimate_follows_the_7_8_average_of_completed_frames() -> None:
    samples = iter([8, 16, 4, 4, 12])
    rig = Rig(catalog(batches=(1,)))
    rig.admit(10, 6)
    prompts_done(rig)
    estimate = None
    for ms in samples:
        plan = rig.s.plan()
        assert plan.graph == decode(1)
        assert plan.estimated_duration_ns == (0 if estimate is None else round(estimate * MS))
        fence = rig.commit(plan)
        rig.tick(ms * MS)
        # rank 1 took 2 ms longer, waiting at the first collective: left out of the sample
        waited = ExecutionTiming(
            (ms * MS, (ms + 2) * MS), host_wall_ns=ms * MS, rank_launch_wait_ns=(0, 2 * MS)
        )
        rig.s.complete(fence, records_for(plan), waited)
        estimate = ms if estimate is None else 7 / 8 * estimate + ms / 8
        assert rig.s.catalog.estimates()["decode B=1"] == round(estimate * MS)
    trace = [r for r in rig.s.drain_trace() if r.kind == "decode"]
    assert [r.reason for r in trace] == ["discovery"] + ["ordinary"] * 4
    assert trace[1].selected_cost_ns == 8 * MS


def test_a_program_unused_for_30_s_is_rediscovered() -> None:
    rig = Rig(catalog(batches=(1,)))
    rig.admit(10, 10)
    prompts_done(rig)
    rig.step()
    assert rig.s.plan().reason is SelectionReason.ORDINARY
    rig.tick(30 * S)
    plan = rig.s.plan()
    assert plan.reason is SelectionReason.DISCOVERY and plan.estimated_duration_ns == 0


def test_no_decoder_starves_when_batches_are_smaller_than_the_decoders() -> None:
    rig = Rig(catalog(batches=(1, 2)), cost=decode_costs(b1=1, b2=1.9), max_slots=8)
    rig.measure_all()
    handles = [rig.admit(10, 25) for _ in range(5)]
    prompts_done(rig)
    served = dict.fromkeys(handles, 0)
    rounds = 0
    while (plan := rig.s.plan()) is not None:
        assert plan.graph == decode(2) and len(plan.lanes) == 2
        for lane in plan.lanes:
            served[lane.handle] += 1
        rig.complete(rig.commit(plan), plan)
        rounds += 1
        live = [served[h] for h in handles if rig.s.request(h) is not None]
        if live:
            assert max(live) - min(live) <= 1  # nobody falls a round behind
    assert rounds > 0 and set(served.values()) == {24}  # the prompt row gave the first token


def test_two_measured_decode_rounds_go_in_flight_for_different_requests() -> None:
    rig = Rig(catalog(batches=(1, 2)), cost=decode_costs(b1=1, b2=1.5))
    rig.measure_all()
    handles = [rig.admit(10, 9) for _ in range(5)]
    prompts_done(rig)
    first = rig.s.plan()
    f1 = rig.commit(first)
    second = rig.s.plan()
    rig.commit(second)
    assert rig.s.in_flight == 2 and rig.s.plan() is None
    lanes = [lane.handle for lane in first.lanes + second.lanes]
    assert len(set(lanes)) == 4 and set(lanes) <= set(handles)
    assert second.expected_start_ns == first.planned_at_ns + first.estimated_duration_ns
    with pytest.raises(CompletionError, match="expected fence"):
        rig.s.complete(f1 + 1, second, timing(MS))  # type: ignore[arg-type]
    rig.complete(f1, first)
    third = rig.s.plan()  # the fifth, least recently served, and one of the first frame's
    assert handles[4] in {lane.handle for lane in third.lanes}


# ------------------------------------------------------------- invariants
def test_random_workload_lanes_obey_the_invariants() -> None:
    rng = random.Random(5)
    rig = Rig(catalog(prompts=(64, 128), batches=(1, 2, 4)), max_slots=6, num_pages=64)
    expected: dict = {}
    consumed: dict = {}
    output: dict = {}
    for _ in range(200):
        if rng.random() < 0.3 and len(expected) < 30:
            spec = RequestSpec(rng.randint(1, 300), rng.randint(1, 12))
            h = rig.s.admit(spec)
            expected[h], consumed[h], output[h] = spec, 0, 0
        if rng.random() < 0.05 and expected:
            h = rng.choice(list(expected))
            rig.s.cancel(h)
        plan = rig.s.plan()
        if plan is None:
            rig.tick(MS)
            continue
        assert 0 < len(plan.lanes) <= plan.graph.batch_capacity
        assert len({lane.handle for lane in plan.lanes}) == len(plan.lanes)
        for lane in plan.lanes:
            spec = expected[lane.handle]
            request = rig.s.request(lane.handle)
            assert (lane.slot, lane.generation) == (request.slot, request.generation)
            assert lane.output_start == output[lane.handle]
            if plan.graph.kind is GraphKind.PREFILL:
                assert len(plan.lanes) == 1 and lane.phase is LanePhase.PREFILL
                assert lane.prompt_start == consumed[lane.handle]
                assert 0 < lane.prompt_tokens <= plan.graph.prompt_capacity
                ends = lane.prompt_start + lane.prompt_tokens == spec.prompt_len
                assert lane.max_tokens == (1 if ends else 0)
                assert not rig.s.in_flight
            else:
                assert lane.phase is LanePhase.DECODE and lane.prompt_tokens == 0
                assert consumed[lane.handle] == spec.prompt_len
                assert lane.max_tokens == 1 and output[lane.handle] < spec.max_output_tokens
        fence = rig.commit(plan)
        rig.complete(fence, plan)
        for lane in plan.lanes:
            consumed[lane.handle] += lane.prompt_tokens
            output[lane.handle] += lane.max_tokens
    while rig.step() is not None:
        pass
    for h in expected:
        assert rig.s.request(h) is None or rig.s.request(h).cancelled
    assert rig.s.running == rig.s.waiting == rig.s.in_flight == 0
    assert rig.s.free_pages == rig.s.config.num_pages


# ---------------------------------------------------------- lifecycle
def test_each_request_gets_exactly_its_tokens_and_retires() -> None:
    rig = Rig()
    h = rig.admit(70, 4)
    tokens = []
    while (plan := rig.s.plan()) is not None:
        tokens += [g for g in rig.complete(rig.commit(plan), plan) if g.handle == h]
    assert [len(g.tokens) for g in tokens] == [1, 1, 1, 1]
    assert tokens[0].first and not any(g.first for g in tokens[1:])
    assert [g.finished for g in tokens] == [False, False, False, True]
    assert tokens[-1].finish_reason == "length"
    assert rig.s.request(h) is None and rig.s.page_table(h) == []
    assert rig.s.published_output(h, 1) is False  # gone: accepted, no error


def test_a_stop_from_the_rank_finishes_the_request() -> None:
    rig = Rig()
    h = rig.admit(10, 50)
    plan = rig.s.plan()
    out = rig.complete(rig.commit(plan), plan)
    assert not out[0].finished
    plan = rig.s.plan()
    out = rig.complete(rig.commit(plan), plan, stop={h})
    assert out[0].finished and out[0].finish_reason == "stop"
    assert rig.s.request(h) is None and rig.s.plan() is None


def test_a_one_token_request_finishes_with_its_prompt() -> None:
    rig = Rig()
    h = rig.admit(5, 1)
    plan = rig.s.plan()
    (out,) = rig.complete(rig.commit(plan), plan)
    assert (out.handle, out.first, out.finished, out.finish_reason) == (h, True, True, "length")


def test_cancelled_requests_retire_waiting_idle_or_after_their_frame() -> None:
    rig = Rig(max_slots=2)
    a, b, c = rig.admit(10, 20), rig.admit(10, 20), rig.admit(10, 20)
    assert (rig.s.running, rig.s.waiting) == (2, 1)
    # Waiting: forgotten at once.
    assert rig.s.cancel(c) and rig.s.request(c) is None and rig.s.waiting == 0
    # In flight: stays until its frame completes, gets no tokens, then retires.
    plan = rig.s.plan()
    assert plan.lanes[0].handle == a
    fence = rig.commit(plan)
    free = rig.s.free_pages
    assert rig.s.cancel(a) and not rig.s.cancel(a)
    assert rig.s.request(a) is not None and rig.s.free_pages == free
    assert rig.s.published_output(a, fence) is False
    assert rig.complete(fence, plan) == []
    assert rig.s.request(a) is None and rig.s.free_pages > free
    # Resident with nothing in flight: retires at once; a new request takes the slot.
    d = rig.admit(10, 20)
    assert rig.s.cancel(b) and rig.s.request(b) is None
    assert rig.s.running == 1 and rig.s.request(d).resident
    plans = rig.run()
    assert {lane.handle for p in plans for lane in p.lanes} == {d}
    assert rig.s.free_pages == rig.s.config.num_pages


def test_residency_is_fcfs_without_skipping_and_refuses_what_never_fits() -> None:
    rig = Rig(num_pages=10, max_slots=4)  # 16-token pages
    with pytest.raises(SchedulerError, match="11 KV pages"):
        rig.admit(155, 10)
    big, small = rig.admit(100, 20), rig.admit(10, 6)  # 8 pages, then 1
    blocked, later = rig.admit(60, 20), rig.admit(5, 5)  # 5 pages: does not fit; 1 would
    assert [rig.s.request(h).resident for h in (big, small, blocked, later)] == [
        True, True, False, False,
    ]  # fmt: skip
    assert rig.s.waiting == 2
    rig.run()
    assert rig.s.free_pages == 10 and rig.s.waiting == 0


def test_commit_rechecks_and_refuses_without_changing_anything() -> None:
    rig = Rig()
    h = rig.admit(10, 5)
    plan = rig.s.plan()
    with pytest.raises(CommitError, match="fence"):
        rig.s.commit(plan, -1)
    fence = rig.commit(plan)
    with pytest.raises(CommitError, match="not newer"):
        rig.s.commit(plan, fence)
    with pytest.raises(CommitError):
        rig.s.commit(plan, fence + 1)  # the same request again, in flight
    rig.complete(fence, plan)
    with pytest.raises(CommitError, match="epoch changed"):
        rig.s.commit(plan, fence + 2)  # a stale plan: its prompt is consumed
    other = DirectScheduler([prefill(128), decode(1)], SchedulerConfig(4, 16, 64))
    other.admit(RequestSpec(3, 3))
    foreign = other.plan()
    with pytest.raises(CommitError, match="not in catalog"):
        rig.s.commit(foreign, fence + 3)
    assert rig.s.in_flight == 0 and rig.s.request(h).fence is None


def test_completion_is_validated_before_anything_changes() -> None:
    rig = Rig()
    rig.admit(10, 5)
    plan = rig.s.plan()
    fence = rig.commit(plan)
    lane = plan.lanes[0]
    with pytest.raises(CompletionError):
        rig.s.complete(fence, [CompletionRecord(lane.slot, lane.generation, (1, 2))], timing(MS))
    with pytest.raises(CompletionError):
        rig.s.complete(fence, [CompletionRecord(lane.slot + 1, lane.generation, (1,))], timing(MS))
    with pytest.raises(CompletionError):
        rig.s.complete(fence, records_for(plan), "timing")  # type: ignore[arg-type]
    assert rig.s.in_flight == 1 and not any(rig.s.catalog.estimates().values())
    rig.s.complete(fence, records_for(plan), timing(MS))
    assert rig.s.catalog.estimates()["prefill B=1 C=64"] == MS


def test_trace_records_one_line_per_commit() -> None:
    rig = Rig(catalog(batches=(1,)))
    rig.admit(10, 3)
    plans = rig.run()
    trace = rig.s.drain_trace()
    assert [r.fence for r in trace] == list(range(1, len(plans) + 1))
    assert [r.kind for r in trace] == ["prefill", "decode", "decode"]
    assert trace[0].prompt_row == 0 and trace[0].prompt_tokens == 10
    assert trace[1].decode_rows == 1 and trace[1].reason == "discovery"
    assert trace[2].reason == "ordinary" and trace[2].observation_age_ns is not None
    assert all(r.refresh_credit_ns == r.learning_credit_ns == 0 for r in trace)
    assert rig.s.drain_trace() == []
    assert rig.s.executions[SelectionReason.ORDINARY] == 1


def test_mixed_and_speculative_programs_are_never_chosen() -> None:
    descriptors = [
        *catalog(batches=(1,)),
        GraphDescriptor(GraphKind.MIXED, 4, prompt_capacity=64),
        GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=4, proposal_depth=3),
    ]
    rig = Rig(descriptors, cost=lambda g: MS)
    for _ in range(3):
        rig.admit(10, 5)
    plans = rig.run()
    assert {p.graph.kind for p in plans} == {GraphKind.PREFILL, GraphKind.DECODE}
    assert set(rig.s.catalog.estimates()) >= {"mixed B=4 D=0 W=1 P=4 C=64"}


def test_a_catalog_without_prefill_or_decode_is_refused() -> None:
    with pytest.raises(SchedulerError, match="prefill"):
        DirectScheduler([decode(1)])
    with pytest.raises(SchedulerError, match="decode"):
        DirectScheduler([prefill(64)])
