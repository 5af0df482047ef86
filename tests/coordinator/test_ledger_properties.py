"""Property tests of the exploration ledgers (spec, "Funded timing refresh",
"Funded acceptance learning"; docs/design.md, "Credit arithmetic, worked"), driven
through the Scheduler's public API only (admit / advance_to / plan / commit /
complete / published_output / cancel) on random traces.

A trace is a list of operations: arrivals (random prompt and output lengths),
runs of frames on a simulated device (random actual durations around the
graph's synthetic cost, queued or isolated, occasionally a missing device
interval that only the host wall time pays for, random acceptance of every
speculative lane, occasional stop tokens), idle gaps (time advanced with
nothing runnable), stale intervals (over 30 s, so every estimate goes stale and
timing refresh becomes possible), drains and cancellations.  Fixed-width
configurations are drawn too.

The driver keeps its own books from what it fed in and checks, after every
completion:

* every execution is charged to exactly one class: per class, the scheduler's
  ``execution_ns`` / ``executions`` equal the driver's sums of the charged
  durations (credited time with a device interval, else host wall time) of the
  frames it committed with that reason; so the two ledgers never charge the
  same execution;
* the earn bases: the timing ledger earns on credited ordinary time (queued:
  the device interval; isolated: max(device, wall)), the learning ledger on raw
  ordinary device time, discovery and frames without a device interval earn
  nothing (``earned_basis_ns`` equals the driver's sums);
* timing refresh: P <= 0.002/0.998 * O + D, O the credited ordinary time, D the
  charged duration of the last refresh episode (exact rational arithmetic);
* acceptance learning: P <= 0.01/0.99 * O_raw + D on what the driver reported:
  P the probes' raw device intervals (the host wall time of one without a
  device interval), O_raw the ordinary frames' raw device intervals, D the
  last probe's interval: the spec's definition, not the scheduler's charge;
* the balances follow a shadow model of the spec (earn rate x credit capped at
  5 ms, an episode spends its actual duration, idle zeroes a positive balance
  and keeps debt); right after the scheduler goes idle (nothing runnable,
  nothing in flight) both balances are <= 0, equal to min(0, the balance the
  last event left), and an idle gap changes neither;

and at every commit of an exploration plan:

* a TIMING_REFRESH plan only at full credit, with no refresh frame in flight,
  and, when no refresh episode has closed since the last idle (or the start),
  only after 2,495 ms of credited ordinary execution since that idle;
* an ACCEPTANCE_LEARNING plan likewise at full credit, never with another probe
  in flight, after 495 ms of raw ordinary execution since the last idle when no
  probe has closed since, and never under ``fixed_speculative_width > 0``.
"""

from __future__ import annotations

import random
from collections import deque
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.plan import LanePhase, SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler

MS = 1_000_000
CAP_NS = 5 * MS
REFRESH_RATE = Fraction(2, 998)  # 0.002 / 0.998
LEARNING_RATE = Fraction(1, 99)  # 0.01 / 0.99
REFRESH_FUNDING_NS = 2_495 * MS
LEARNING_FUNDING_NS = 495 * MS
TTL_NS = 30_000 * MS
HOST_DELAY_NS = 50_000
ORDINARY = SelectionReason.ORDINARY
REFRESH = SelectionReason.TIMING_REFRESH
LEARNING = SelectionReason.ACCEPTANCE_LEARNING


def charged_ns(reason: SelectionReason, raw: int, credited: int, wall: int) -> int:
    """What the scheduler charges a completed frame (its ``execution_ns``, and an
    episode's ledger spend): credited time with a device interval (queued: the
    device interval; isolated: max(device, wall)), else the host wall time.

    An acceptance probe with a device interval pays ``raw`` (spec: "An
    acceptance episode pays one complete graph interval, including readiness
    stalls"; exploration budgets use raw physical time)."""
    if reason is LEARNING and raw > 0:
        return raw
    return credited if raw > 0 else wall


def spec(b: int, w: int, p: int = 0) -> GraphDescriptor:
    return GraphDescriptor(
        GraphKind.SPECULATIVE, b, token_capacity=w, proposal_depth=w - 1, target_capacity=p
    )


def catalog() -> list[GraphDescriptor]:
    out = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=c) for c in (64, 256)]
    for b in (1, 2, 4):
        out.append(GraphDescriptor(GraphKind.DECODE, b))
        out += [spec(b, w) for w in (2, 4)]
    out.append(spec(4, 4, 8))  # ragged: causal allocation under P
    return out


def cost_ns(desc: GraphDescriptor) -> int:
    """Synthetic costs of 19..58 ms: a few hundred frames fund a refresh."""
    if desc.kind is GraphKind.PREFILL:
        ms = 15 + desc.prompt_capacity / 16
    elif desc.kind is GraphKind.DECODE:
        ms = 20 + 2 * desc.batch_capacity
    else:
        ms = 22 + 0.5 * desc.target_capacity + 3 * desc.proposal_depth
    return int(ms * MS)


class Shadow:
    """The spec's ledger, kept by the driver from what it fed in."""

    def __init__(self, rate: Fraction) -> None:
        self.rate = rate
        self.balance = Fraction(0)

    def earn(self, ns: int) -> None:
        if ns > 0:
            self.balance = min(Fraction(CAP_NS), self.balance + self.rate * ns)

    def spend(self, ns: int) -> None:
        self.balance -= ns

    def idle(self) -> None:
        self.balance = min(self.balance, Fraction(0))


class Driver:
    def __init__(self, fixed_width: int, seed: int, stop_rate: float = 0.01) -> None:
        self.fixed = fixed_width
        self.stop_rate = stop_rate  # chance a decode lane reports a stop token
        config = SchedulerConfig(
            max_slots=8, page_size=16, num_pages=4096, fixed_speculative_width=fixed_width
        )
        self.s = Scheduler(catalog(), config)
        self.rng = random.Random(seed)
        self.now = 0
        self.device_free = 0
        self.fence = 0
        # (fence, plan, dispatch_ns, device end_ns, device_ns, queued)
        self.inflight: deque = deque()
        self.handles: list = []
        self.reasons: list[SelectionReason] = []  # committed plans' reasons, in order
        # The driver's books.
        self.charged = {r: 0 for r in SelectionReason}
        self.count = {r: 0 for r in SelectionReason}
        self.ordinary_credited = 0  # the timing ledger's earn basis
        self.ordinary_raw = 0  # the learning ledger's earn basis
        self.episode = {REFRESH: 0, LEARNING: 0}  # last episode's charged duration
        # Acceptance probes as reported: raw device intervals (host wall without one).
        self.probe_ns = 0
        self.last_probe_ns = 0
        self.credited_since_idle = 0
        self.raw_since_idle = 0
        self.closed_since_idle = {REFRESH: False, LEARNING: False}
        self.shadow = {REFRESH: Shadow(REFRESH_RATE), LEARNING: Shadow(LEARNING_RATE)}
        self.idle_events = 0

    # ---------------------------------------------------------------- helpers
    @property
    def idle(self) -> bool:
        return self.s.in_flight == 0 and self.s.running == 0

    def ledger(self, reason: SelectionReason):
        return self.s.refresh_ledger if reason is REFRESH else self.s.learning_ledger

    def after_call(self) -> None:
        """The scheduler checks idleness after advance_to, cancel and complete."""
        if self.idle:
            for reason in (REFRESH, LEARNING):
                before = self.shadow[reason].balance
                self.shadow[reason].idle()
                # Idle discards positive credit and keeps debt.
                assert self.ledger(reason).balance_ns == pytest.approx(
                    float(min(before, 0)), abs=1e-3
                )
                assert self.ledger(reason).balance_ns <= 0
            self.credited_since_idle = 0
            self.raw_since_idle = 0
            self.closed_since_idle = {REFRESH: False, LEARNING: False}
            self.idle_events += 1

    def advance(self, ns: int) -> None:
        before = (self.s.refresh_ledger.balance_ns, self.s.learning_ledger.balance_ns)
        was_idle = self.idle
        self.now += ns
        self.s.advance_to(self.now)
        self.after_call()
        if was_idle:  # an idle gap: nothing to earn, nothing to discard twice
            after = (self.s.refresh_ledger.balance_ns, self.s.learning_ledger.balance_ns)
            assert after == before
            assert all(b <= 0 for b in after)

    # ------------------------------------------------------------- operations
    def arrive(self, count: int, prompt: int, output: int) -> None:
        for _ in range(count):
            self.handles.append(self.s.admit(RequestSpec(prompt, output)))

    def cancel(self, pick: int) -> None:
        if self.handles:
            self.s.cancel(self.handles[pick % len(self.handles)])
            self.after_call()

    def dispatch(self) -> None:
        while (plan := self.s.plan()) is not None:
            self.check_commit(plan)
            self.fence += 1
            self.s.commit(plan, self.fence)
            self.reasons.append(plan.reason)
            device = max(1, int(cost_ns(plan.graph) * self.rng.uniform(0.7, 1.4)))
            start = max(self.now, self.device_free)
            self.device_free = start + device
            queued = bool(self.inflight)
            self.inflight.append((self.fence, plan, self.now, start + device, device, queued))

    def check_commit(self, plan) -> None:
        reason = plan.reason
        if reason not in (REFRESH, LEARNING):
            return
        if reason is LEARNING:
            assert self.fixed == 0, "an acceptance probe under fixed-width execution"
        assert all(f[1].reason is not reason for f in self.inflight), "two open episodes"
        assert self.shadow[reason].balance >= CAP_NS, "an episode without full credit"
        if reason is REFRESH:
            assert self.ordinary_credited >= REFRESH_FUNDING_NS
            if not self.closed_since_idle[REFRESH]:
                assert self.credited_since_idle >= REFRESH_FUNDING_NS, self.credited_since_idle
        else:
            assert self.ordinary_raw >= LEARNING_FUNDING_NS
            if not self.closed_since_idle[LEARNING]:
                assert self.raw_since_idle >= LEARNING_FUNDING_NS, self.raw_since_idle

    def step(self) -> bool:
        """Dispatch what the scheduler wants, then complete the head frame."""
        self.dispatch()
        if not self.inflight:
            return False
        fence, plan, dispatch_ns, end, device, queued = self.inflight.popleft()
        self.now = max(self.now, end + HOST_DELAY_NS)
        self.s.advance_to(self.now)
        self.after_call()
        rng = self.rng
        speculative = plan.graph.kind is GraphKind.SPECULATIVE
        records = []
        for lane in plan.lanes:
            count = lane.max_tokens
            if speculative:
                count = 1 + rng.randint(0, lane.max_tokens - 1)  # random acceptance
            stop = None
            if lane.phase is LanePhase.DECODE and rng.random() < self.stop_rate:
                stop = "stop"
            records.append(CompletionRecord(lane.slot, lane.generation, tuple(range(count)), stop))
        wall = self.now - dispatch_ns
        if rng.random() < 0.05:
            ranks = (0,)  # no device interval: the wall time pays, nothing is measured
        elif rng.random() < 0.3:
            ranks = (device, int(device * rng.uniform(0.8, 1.0)))
        else:
            ranks = (device,)
        timing = ExecutionTiming(ranks, host_wall_ns=wall, queued=queued)
        raw = max((r for r in ranks if r > 0), default=0)
        credited = raw if queued else max(raw, wall)
        charged = charged_ns(plan.reason, raw, credited, wall)

        generated = self.s.complete(fence, records, timing)
        for g in generated:
            if rng.random() < 0.9:
                self.s.published_output(g.handle, g.fence, self.now)

        reason = plan.reason
        self.charged[reason] += charged
        self.count[reason] += 1
        if reason is ORDINARY and raw > 0:
            self.ordinary_credited += credited
            self.ordinary_raw += raw
            self.credited_since_idle += credited
            self.raw_since_idle += raw
            self.shadow[REFRESH].earn(credited)
            self.shadow[LEARNING].earn(raw)
        elif reason in (REFRESH, LEARNING):
            self.shadow[reason].spend(charged)
            self.episode[reason] = charged
            self.closed_since_idle[reason] = True
        if reason is LEARNING:
            self.last_probe_ns = raw if raw > 0 else wall
            self.probe_ns += self.last_probe_ns
        self.after_call()
        self.check_books()
        return True

    def run(self, frames: int) -> None:
        for _ in range(frames):
            if not self.step():
                return

    def drain(self, limit: int = 20_000) -> None:
        for _ in range(limit):
            if not self.step():
                break
        assert self.idle or self.s.waiting == 0

    # ------------------------------------------------------------- properties
    def check_books(self) -> None:
        s = self.s
        # Each execution in exactly one class, charged once.
        assert s.execution_ns == self.charged
        assert s.executions == self.count
        assert sum(s.execution_ns.values()) == sum(self.charged.values())
        # Earn bases: credited (timing) and raw (learning) ordinary device time.
        assert s.refresh_ledger.earned_basis_ns == self.ordinary_credited
        assert s.learning_ledger.earned_basis_ns == self.ordinary_raw
        assert s.execution_ns[ORDINARY] >= self.ordinary_credited
        # Spending: each ledger pays for its own class only.
        assert s.refresh_ledger.spent_ns == self.charged[REFRESH]
        assert s.learning_ledger.spent_ns == self.charged[LEARNING]
        # The spec's bounds, exactly.
        assert (
            self.charged[REFRESH] <= REFRESH_RATE * self.ordinary_credited + self.episode[REFRESH]
        )
        assert self.probe_ns <= LEARNING_RATE * self.ordinary_raw + self.last_probe_ns
        # The balances follow the spec's ledger.
        for reason in (REFRESH, LEARNING):
            expected = float(self.shadow[reason].balance)
            assert self.ledger(reason).balance_ns == pytest.approx(expected, abs=1e-3)
        if self.fixed:
            assert s.executions[LEARNING] == 0
            assert s.learning_ledger.spent_ns == 0

    def apply(self, op: tuple) -> None:
        name = op[0]
        if name == "arrive":
            self.arrive(*op[1:])
        elif name == "run":
            self.run(op[1])
        elif name in ("gap", "stale"):
            self.advance(op[1])
        elif name == "cancel":
            self.cancel(op[1])
        elif name == "drain":
            self.drain()
        else:  # pragma: no cover
            raise AssertionError(op)


OPS = st.one_of(
    st.tuples(
        st.just("arrive"),
        st.integers(1, 4),  # requests
        st.integers(1, 300),  # prompt tokens
        st.integers(1, 2_000),  # output limit
    ),
    st.tuples(st.just("run"), st.integers(1, 300)),
    st.tuples(st.just("gap"), st.integers(0, 2_000 * MS)),
    st.tuples(st.just("stale"), st.integers(TTL_NS + 1, TTL_NS + 15_000 * MS)),
    st.tuples(st.just("cancel"), st.integers(0, 1_000)),
    st.tuples(st.just("drain")),
)


@settings(
    derandomize=True,
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    fixed=st.sampled_from([0, 0, 0, 1, 2, 4]),
    seed=st.integers(0, 2**32 - 1),
    first=st.tuples(st.integers(1, 8), st.integers(1, 300), st.integers(100, 3_000)),
    ops=st.lists(OPS, min_size=1, max_size=25),
)
def test_ledgers_on_random_traces(fixed, seed, first, ops):
    driver = Driver(fixed, seed)
    driver.arrive(*first)
    for op in ops:
        driver.apply(op)
    driver.drain()
    driver.check_books()
    event(f"frames {sum(driver.count.values()) // 100 * 100}+")
    for reason in (REFRESH, LEARNING):
        plans = driver.count[reason]
        event(f"{reason.value} plans: {'3+' if plans >= 3 else plans}")
    event(f"idle resets: {min(driver.idle_events, 3)}")
    target(float(driver.count[REFRESH] + driver.count[LEARNING]), label="episodes")


# ----------------------------------------------------------- fixed scenarios
# The random traces must not be vacuous: these scripted traces, checked by the
# same driver, reach a funded refresh, a funded probe, debt and idle resets.

SCENARIO = [
    ("arrive", 4, 100, 3000),
    ("run", 150),  # > 2,495 ms of credited ordinary execution
    ("stale", TTL_NS + MS),  # everything stale, credit kept (requests still runnable)
    ("run", 40),
    ("cancel", 0),
    ("run", 40),
    ("drain",),
    ("gap", 500 * MS),  # an idle gap
    ("arrive", 3, 300, 200),
    ("run", 60),
    ("stale", TTL_NS + MS),
    ("run", 60),
    ("drain",),
]


def test_scripted_trace_funds_refresh_and_probes():
    driver = Driver(0, 1, stop_rate=0.0)
    for op in SCENARIO:
        driver.apply(op)
    driver.check_books()
    assert REFRESH in driver.reasons, driver.count
    assert LEARNING in driver.reasons, driver.count
    assert driver.idle_events >= 2
    # The first refresh came only after 2,495 ms of credited ordinary execution.
    assert driver.s.executions[REFRESH] >= 1
    assert driver.s.refresh_ledger.earned_basis_ns >= REFRESH_FUNDING_NS


@pytest.mark.parametrize("fixed", [1, 2, 4])
def test_scripted_trace_never_probes_at_fixed_width(fixed):
    driver = Driver(fixed, 2, stop_rate=0.0)
    for op in SCENARIO:
        driver.apply(op)
    assert LEARNING not in driver.reasons
    assert driver.s.learning_ledger.spent_ns == 0
    assert driver.s.learning_ledger.earned_basis_ns >= LEARNING_FUNDING_NS  # it was funded


def test_idle_keeps_debt_from_a_refresh_overrun():
    """A refresh that completes with a long host wall interval (isolated: credited
    at the wall time) drives the balance into debt; the following idle keeps it."""
    driver = Driver(0, 3, stop_rate=0.0)
    driver.arrive(4, 64, 3000)
    driver.run(150)
    driver.advance(TTL_NS + MS)
    for _ in range(200):
        driver.dispatch()
        if driver.inflight and driver.inflight[0][1].reason is REFRESH:
            driver.advance(50 * MS)  # the host observes the refresh late: it costs more
            driver.step()
            break
        driver.step()
    assert driver.s.refresh_ledger.balance_ns < 0
    for h in driver.handles:
        driver.s.cancel(h)
        driver.after_call()  # checks min(0, balance) at the moment it goes idle
    driver.drain()
    assert driver.idle and driver.idle_events >= 1
    assert driver.s.refresh_ledger.balance_ns < 0  # still in debt: idle kept it
    driver.advance(10_000 * MS)
    assert driver.s.refresh_ledger.balance_ns == pytest.approx(
        float(driver.shadow[REFRESH].balance), abs=1e-3
    )
    assert driver.s.refresh_ledger.balance_ns < 0
