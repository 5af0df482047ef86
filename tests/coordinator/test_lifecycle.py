"""Request lifecycle through the public Scheduler API: completion validation, commit
rechecks, cancellation, time, policy configuration and publication (spec, "Service
accounting and publication", "Planning and the execution queue")."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PolicyConfig
from runtime.coordinator.errors import (
    CommitError,
    CompletionError,
    PublicationError,
    SchedulerError,
)
from runtime.coordinator.plan import LanePhase, SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import Phase, RequestSpec
from runtime.coordinator.scheduler import Scheduler
from tests.support.coordinator_rig import BaseRig

MS = 1_000_000
TOKEN = 7
CATALOG = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.DECODE, 1),
    GraphDescriptor(GraphKind.DECODE, 2),
)
TIMING = ExecutionTiming((2 * MS,), host_wall_ns=2_500_000)


def records_for(plan, token: int = TOKEN) -> list[CompletionRecord]:
    return [
        CompletionRecord(lane.slot, lane.generation, (token,) * lane.max_tokens)
        for lane in plan.lanes
    ]


class Harness(BaseRig):
    """Drives a Scheduler with well-formed plans, fences and completions."""

    def __init__(self, catalog=CATALOG, max_slots: int = 4) -> None:
        super().__init__(catalog, None, max_slots, num_pages=256)

    def tick(self, ns: int = 3 * MS) -> None:
        super().tick(ns)

    def complete(self, fence: int, plan, timing: ExecutionTiming = TIMING, publish: bool = True):
        self.tick()
        out = self.s.complete(fence, records_for(plan), timing)
        if publish:
            for g in out:
                self.s.published_output(g.handle, g.fence)
        return out

    def step(self):
        plan = self.plan()
        fence = self.commit(plan)
        return plan, self.complete(fence, plan)

    def step_until(self, predicate, limit: int = 40):
        """Execute plans until ``predicate(plan)``; return that plan uncommitted."""
        for _ in range(limit):
            plan = self.plan()
            if predicate(plan):
                return plan
            self.complete(self.commit(plan), plan)
        raise AssertionError("setup did not reach the wanted plan")


def snapshot(s: Scheduler) -> dict:
    requests = {}
    for r in s.active_requests():
        requests[r.handle.id] = (
            r.slot,
            r.generation,
            r.resident,
            r.phase,
            r.consumed_prompt,
            r.committed_output,
            r.inflight_prompt,
            r.inflight_output,
            tuple(r.inflight_fences),
            r.token_rate,
            r.delivery_rate,
            r.finish_reason,
            r.cancelled,
            dict(r.unpublished),
            r.pending_delivery,
            r.last_visible_ns,
            r.became_decoder_ns,
            r.last_selected,
        )
    return {
        "requests": requests,
        "queue": s.queue_fences,
        "in_flight": s.in_flight,
        "estimates": s.catalog.estimates(),
        "catalog_version": s.catalog.version,
        "refresh": (s.refresh_ledger.balance_ns, s.refresh_ledger.earned_basis_ns),
        "learning": (s.learning_ledger.balance_ns, s.learning_ledger.earned_basis_ns),
        "executions": dict(s.executions),
        "execution_ns": dict(s.execution_ns),
        "free_pages": s.free_pages,
        "running": s.running,
        "waiting": s.waiting,
        "now": s.now_ns,
    }


def is_ordinary_pair_decode(plan) -> bool:
    return (
        plan.graph.kind is GraphKind.DECODE
        and len(plan.lanes) == 2
        and plan.reason is SelectionReason.ORDINARY
    )


def is_ordinary_decode(plan) -> bool:
    return plan.graph.kind is GraphKind.DECODE and plan.reason is SelectionReason.ORDINARY


@pytest.fixture
def pair_in_flight():
    """Two decoding requests with an ordinary two-lane decode frame in flight."""
    h = Harness()
    h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=32))
    h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=32))
    plan = h.step_until(is_ordinary_pair_decode)
    fence = h.commit(plan)
    h.tick()
    assert h.s.queue_fences == [fence]
    assert all(lane.max_tokens == 1 for lane in plan.lanes)
    return h, plan, fence


def single_decoder(max_output_tokens: int = 32, max_slots: int = 4):
    """One decoding request whose decode graph is measured; returns (harness, handle)."""
    h = Harness(catalog=CATALOG[:2], max_slots=max_slots)
    handle = h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=max_output_tokens))
    h.step_until(is_ordinary_decode)
    assert h.s.request(handle).phase is Phase.DECODE
    return h, handle


# ------------------------------------------------------ malformed completions


def _swap(records, i, **changes):
    out = list(records)
    out[i] = dataclasses.replace(out[i], **changes)
    return out


# Each case maps (plan, fence, good records) to (fence, records, timing) for complete().
MALFORMED = {
    "fence-newer": lambda p, f, r: (f + 1, r, TIMING),
    "fence-older": lambda p, f, r: (f - 1, r, TIMING),
    "records-short": lambda p, f, r: (f, r[:1], TIMING),
    "records-long": lambda p, f, r: (f, [*r, r[0]], TIMING),
    "records-empty": lambda p, f, r: (f, [], TIMING),
    "records-swapped": lambda p, f, r: (f, r[::-1], TIMING),
    "not-a-record": lambda p, f, r: (f, [r[0], (r[1].slot, r[1].generation, (TOKEN,))], TIMING),
    "wrong-slot": lambda p, f, r: (f, _swap(r, 1, slot=r[1].slot + 2), TIMING),
    "wrong-generation": lambda p, f, r: (f, _swap(r, 1, generation=r[1].generation + 1), TIMING),
    "old-generation": lambda p, f, r: (f, _swap(r, 1, generation=r[1].generation - 1), TIMING),
    "token-str": lambda p, f, r: (f, _swap(r, 1, tokens=("7",)), TIMING),
    "token-float": lambda p, f, r: (f, _swap(r, 1, tokens=(7.0,)), TIMING),
    "token-bool": lambda p, f, r: (f, _swap(r, 1, tokens=(True,)), TIMING),
    "token-none": lambda p, f, r: (f, _swap(r, 1, tokens=(None,)), TIMING),
    "token-negative": lambda p, f, r: (f, _swap(r, 1, tokens=(-1,)), TIMING),
    "tokens-not-sequence": lambda p, f, r: (f, _swap(r, 1, tokens=TOKEN), TIMING),
    "tokens-too-many": lambda p, f, r: (f, _swap(r, 1, tokens=(TOKEN, TOKEN)), TIMING),
    "tokens-none-for-decode": lambda p, f, r: (f, _swap(r, 1, tokens=()), TIMING),
    "finish-unknown": lambda p, f, r: (f, _swap(r, 1, finish_reason="eos"), TIMING),
    "finish-case": lambda p, f, r: (f, _swap(r, 1, finish_reason="STOP"), TIMING),
    "finish-empty": lambda p, f, r: (f, _swap(r, 1, finish_reason=""), TIMING),
    "finish-cancelled": lambda p, f, r: (f, _swap(r, 0, finish_reason="cancelled"), TIMING),
    "timing-ranks-list": lambda p, f, r: (f, r, ExecutionTiming([2 * MS], host_wall_ns=MS)),
    "timing-ranks-empty": lambda p, f, r: (f, r, ExecutionTiming((), host_wall_ns=MS)),
    "timing-ranks-int": lambda p, f, r: (f, r, ExecutionTiming(2 * MS)),
    "timing-rank-negative": lambda p, f, r: (f, r, ExecutionTiming((2 * MS, -1))),
    "timing-rank-float": lambda p, f, r: (f, r, ExecutionTiming((2e6,))),
    "timing-rank-bool": lambda p, f, r: (f, r, ExecutionTiming((True,))),
    "timing-readiness-negative": lambda p, f, r: (
        f,
        r,
        ExecutionTiming((2 * MS,), readiness_delay_ns=-1),
    ),
    "timing-wall-negative": lambda p, f, r: (f, r, ExecutionTiming((2 * MS,), host_wall_ns=-MS)),
    "timing-wall-float": lambda p, f, r: (f, r, ExecutionTiming((2 * MS,), host_wall_ns=1.5)),
    "timing-not-timing": lambda p, f, r: (f, r, {"rank_device_ns": (2 * MS,)}),
    "timing-none": lambda p, f, r: (f, r, None),
    "finish-unhashable": lambda p, f, r: (f, _swap(r, 1, finish_reason=["stop"]), TIMING),
    "records-iterator": lambda p, f, r: (f, iter(r), TIMING),
    "timing-queued-not-bool": lambda p, f, r: (f, r, ExecutionTiming((2 * MS,), queued="yes")),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_completion_raises_and_changes_nothing(pair_in_flight, case):
    h, plan, fence = pair_in_flight
    good = records_for(plan)
    bad_fence, bad_records, bad_timing = MALFORMED[case](plan, fence, good)
    h.s.drain_trace()
    before = snapshot(h.s)
    with pytest.raises(CompletionError):
        h.s.complete(bad_fence, bad_records, bad_timing)
    assert snapshot(h.s) == before
    assert h.s.drain_trace() == []
    # The correct completion still succeeds afterwards.
    out = h.s.complete(fence, good, ExecutionTiming((3 * MS,), host_wall_ns=3 * MS))
    assert sorted(g.handle.id for g in out) == sorted(lane.handle.id for lane in plan.lanes)
    assert all(g.tokens == (TOKEN,) and g.fence == fence for g in out)
    assert h.s.queue_fences == []
    for lane in plan.lanes:
        r = h.s.request(lane.handle)
        assert r.committed_output == lane.output_start + 1
        assert r.inflight_fences == []


def test_completion_with_nothing_in_flight_rejected():
    h = Harness()
    h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=4))
    before = snapshot(h.s)
    with pytest.raises(CompletionError):
        h.s.complete(1, [], TIMING)
    assert snapshot(h.s) == before


def test_non_finishing_prefill_chunk_commits_no_tokens():
    h = Harness()
    handle = h.s.admit(RequestSpec(prompt_len=128, max_output_tokens=4))
    plan = h.plan()
    assert plan.graph.kind is GraphKind.PREFILL
    (lane,) = plan.lanes
    assert lane.phase is LanePhase.PREFILL and lane.max_tokens == 0
    fence = h.commit(plan)
    before = snapshot(h.s)
    bad = [
        # A token the chunk cannot commit; a finish without a token.
        [CompletionRecord(lane.slot, lane.generation, (TOKEN,))],
        [CompletionRecord(lane.slot, lane.generation, (), finish_reason="stop")],
    ]
    for records in bad:
        with pytest.raises(CompletionError):
            h.s.complete(fence, records, TIMING)
        assert snapshot(h.s) == before
    out = h.s.complete(fence, [CompletionRecord(lane.slot, lane.generation)], TIMING)
    assert out == []
    assert h.s.request(handle).consumed_prompt == 64


def test_stop_finish_reason_finishes_request(pair_in_flight):
    h, plan, fence = pair_in_flight
    records = _swap(records_for(plan), 0, finish_reason="stop")
    out = h.s.complete(fence, records, TIMING)
    stopped = next(g for g in out if g.handle == plan.lanes[0].handle)
    assert stopped.finished and stopped.finish_reason == "stop"
    other = next(g for g in out if g.handle == plan.lanes[1].handle)
    assert not other.finished


# ------------------------------------------------------------- commit rechecks


def test_reused_fence_rejected():
    h, _ = single_decoder()
    plan = h.plan()
    fence = h.commit(plan)
    h.complete(fence, plan)
    plan = h.plan()
    before = snapshot(h.s)
    for stale_fence in (fence, fence - 1, 0):
        with pytest.raises(CommitError):
            h.s.commit(plan, stale_fence)
        assert snapshot(h.s) == before
    h.s.commit(plan, fence + 1)
    assert h.s.queue_fences == [fence + 1]


@pytest.mark.parametrize("bad", [-1, True, 1.0, "3", None])
def test_malformed_fence_rejected(bad):
    h, _ = single_decoder()
    plan = h.plan()
    before = snapshot(h.s)
    with pytest.raises(CommitError):
        h.s.commit(plan, bad)
    assert snapshot(h.s) == before


def test_failed_commit_does_not_consume_the_fence():
    h, handle = single_decoder()
    plan = h.plan()
    h.s.cancel(handle)
    with pytest.raises(CommitError):
        h.s.commit(plan, 100)
    other = h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=4))
    plan = h.plan()
    assert plan.lanes[0].handle == other
    h.s.commit(plan, 100)  # the rejected commit did not advance the fence
    assert h.s.queue_fences == [100]


def test_plan_of_cancelled_request_rejected():
    h, handle = single_decoder()
    plan = h.plan()
    assert plan.lanes[0].handle == handle
    assert h.s.cancel(handle) is True
    before = snapshot(h.s)
    with pytest.raises(CommitError):
        h.s.commit(plan, h.fence + 1)
    assert snapshot(h.s) == before
    assert h.s.queue_fences == []


def test_stale_decode_epoch_rejected_after_other_plan_completes():
    h, handle = single_decoder()
    old = h.plan()
    newer = h.plan()
    assert old.lanes[0].handle == newer.lanes[0].handle == handle
    assert old.lanes[0].output_start == newer.lanes[0].output_start
    h.complete(h.commit(newer), newer)
    before = snapshot(h.s)
    with pytest.raises(CommitError, match="epoch"):
        h.s.commit(old, h.fence + 1)
    assert snapshot(h.s) == before
    # A fresh plan for the same request commits.
    h.commit(h.plan())


def test_stale_decode_epoch_rejected_while_other_plan_in_flight():
    h, _ = single_decoder()
    old = h.plan()
    newer = h.plan()
    h.commit(newer)
    assert old.graph.queueable and old.reason is SelectionReason.ORDINARY
    before = snapshot(h.s)
    with pytest.raises(CommitError, match="epoch"):
        h.s.commit(old, h.fence + 1)
    assert snapshot(h.s) == before


def test_stale_prefill_epoch_rejected():
    h = Harness()
    handle = h.s.admit(RequestSpec(prompt_len=192, max_output_tokens=4))
    old = h.plan()
    newer = h.plan()
    assert old.lanes[0].phase is LanePhase.PREFILL
    assert old.lanes[0].prompt_start == newer.lanes[0].prompt_start == 0
    h.complete(h.commit(newer), newer)
    assert h.s.request(handle).consumed_prompt == 64
    before = snapshot(h.s)
    with pytest.raises(CommitError, match="epoch"):
        h.s.commit(old, h.fence + 1)
    assert snapshot(h.s) == before


def test_committed_plan_cannot_be_committed_twice():
    h, _ = single_decoder()
    plan = h.plan()
    h.commit(plan)
    before = snapshot(h.s)
    with pytest.raises(CommitError):
        h.s.commit(plan, h.fence + 1)
    assert snapshot(h.s) == before


# ---------------------------------------------------------------- cancellation


def test_cancelled_in_flight_request_keeps_slot_until_last_fence():
    h, a = single_decoder(max_slots=1)
    ra = h.s.request(a)
    slot, generation = ra.slot, ra.generation
    first = h.plan()
    f1 = h.commit(first)
    second = h.plan()  # queued behind the first frame
    assert second.lanes[0].handle == a
    f2 = h.commit(second)
    assert h.s.queue_fences == [f1, f2]
    pages = h.s.free_pages

    assert h.s.cancel(a) is True
    assert h.s.cancel(a) is False  # already cancelled
    committed = ra.committed_output
    assert h.s.plan() is None  # cancellation stops selection immediately
    b = h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    assert h.s.waiting == 1  # the only slot is still owned through fence f2
    assert h.s.free_pages == pages

    h.tick()
    assert h.s.complete(f1, records_for(first), TIMING) == []  # no tokens for a cancelled handle
    assert h.s.waiting == 1
    assert h.s.free_pages == pages
    assert h.s.request(b).phase is Phase.WAITING

    h.tick()
    assert h.s.complete(f2, records_for(second), ExecutionTiming((2 * MS,), queued=True)) == []
    assert h.s.request(a) is None  # retired after its last fence
    assert h.s.waiting == 0
    rb = h.s.request(b)
    assert rb.resident and rb.phase is Phase.PREFILL
    assert rb.slot == slot
    assert rb.generation == generation + 1
    assert committed == ra.committed_output  # nothing was committed for the cancelled handle
    assert h.s.published_output(a, f2) is False

    # The new tenant's frames carry the new generation; the old one is rejected.
    plan = h.plan()
    (lane,) = plan.lanes
    assert (lane.handle, lane.slot, lane.generation) == (b, slot, generation + 1)
    fence = h.commit(plan)
    old_gen = [CompletionRecord(slot, generation, (TOKEN,) * lane.max_tokens)]
    with pytest.raises(CompletionError):
        h.s.complete(fence, old_gen, TIMING)
    out = h.s.complete(fence, records_for(plan), TIMING)
    assert [g.handle for g in out] == [b]


def test_cancel_without_in_flight_work_frees_slot_at_once():
    h, a = single_decoder(max_slots=1)
    slot = h.s.request(a).slot
    b = h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    assert h.s.waiting == 1
    assert h.s.cancel(a) is True
    assert h.s.request(a) is None
    assert h.s.waiting == 0
    assert h.s.request(b).slot == slot


def test_cancel_waiting_request():
    h = Harness(max_slots=1)
    a = h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    b = h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    assert h.s.waiting == 1
    assert h.s.cancel(b) is True
    assert h.s.waiting == 0
    assert h.s.request(b) is None
    assert all(lane.handle == a for lane in h.plan().lanes)


# ------------------------------------------------------- time and configuration


def test_advance_to_backwards_raises():
    h = Harness()
    h.s.advance_to(10 * MS)
    h.s.advance_to(10 * MS)  # standing still is fine
    with pytest.raises(SchedulerError):
        h.s.advance_to(10 * MS - 1)
    assert h.s.now_ns == 10 * MS


def test_configure_policy_before_admission():
    h = Harness()
    policy = PolicyConfig.preset("throughput", estimate_ttl_ns=5_000_000_000)
    h.s.configure_policy(policy)
    assert h.s.policy is policy
    assert h.s.catalog.ttl_ns == 5_000_000_000


def test_configure_policy_after_admit_raises():
    h = Harness()
    handle = h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=4))
    original = h.s.policy
    with pytest.raises(SchedulerError):
        h.s.configure_policy(PolicyConfig.preset("throughput"))
    assert h.s.policy is original
    # Still refused once the admitted request is gone.
    h.s.cancel(handle)
    with pytest.raises(SchedulerError):
        h.s.configure_policy(PolicyConfig())


def test_configure_policy_takes_a_policy():
    with pytest.raises(TypeError):
        Harness().s.configure_policy({"token_fairness": 1.0})


# ----------------------------------------------------------------- publication


def test_published_output_of_never_produced_fence_raises():
    h = Harness()
    handle = h.s.admit(RequestSpec(prompt_len=128, max_output_tokens=4))
    plan = h.plan()
    fence = h.commit(plan)
    with pytest.raises(PublicationError):
        h.s.published_output(handle, fence)  # still in flight
    h.complete(fence, plan, publish=False)  # a non-finishing chunk: no output
    before = snapshot(h.s)
    for never in (fence, fence + 1, 999):
        with pytest.raises(PublicationError):
            h.s.published_output(handle, never)
        assert snapshot(h.s) == before


def test_published_output_sets_last_visible_at_publication_time():
    h = Harness()
    handle = h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    plan = h.plan()
    fence = h.commit(plan)
    h.complete(fence, plan, publish=False)
    r = h.s.request(handle)
    assert r.last_visible_ns is None
    h.tick(5 * MS)
    assert h.s.published_output(handle, fence, at_ns=h.now - MS) is True
    assert r.last_visible_ns == h.now - MS
    # Without at_ns the publication is at the scheduler's current time.
    plan = h.plan()
    fence = h.commit(plan)
    h.complete(fence, plan, publish=False)
    assert h.s.published_output(handle, fence) is True
    assert r.last_visible_ns == h.s.now_ns


@pytest.mark.parametrize(
    ("device_ns", "wall_ns"),
    [(2 * MS, 2_500_000), (4 * MS, MS)],
    ids=["wall-longer", "device-longer"],
)
def test_first_published_burst_initializes_delivery_rate(device_ns, wall_ns):
    h = Harness()
    handle = h.s.admit(RequestSpec(prompt_len=64, max_output_tokens=8))
    plan = h.plan()
    fence = h.commit(plan)
    out = h.complete(fence, plan, ExecutionTiming((device_ns,), host_wall_ns=wall_ns), False)
    assert [g.first for g in out] == [True]
    r = h.s.request(handle)
    assert r.delivery_rate is None  # completion alone records no delivery
    h.s.published_output(handle, fence)
    frame_ms = max(device_ns, wall_ns) / MS  # isolated frame: the larger interval
    assert r.delivery_rate == pytest.approx(1.0 / frame_ms)
