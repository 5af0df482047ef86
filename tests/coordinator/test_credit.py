"""Exploration credit ledgers (spec, "Funded timing refresh", "Funded acceptance
learning"; docs/design.md, "Credit arithmetic, worked")."""

from __future__ import annotations

import math
import random

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.credit import CAP_NS, CreditLedger
from runtime.coordinator.learning import ACCEPTANCE_LEARNING_RATE, acceptance_ledger
from runtime.coordinator.plan import SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.refresh import TIMING_REFRESH_RATE, timing_ledger
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler

MS = 1_000_000
TIMING_FUNDING_NS = 2_495 * MS  # spec: 2,495 ms of credited ordinary execution
LEARNING_FUNDING_NS = 495 * MS  # docs/design.md: 495 ms of ordinary execution

LEDGERS = [
    pytest.param(timing_ledger, TIMING_FUNDING_NS, id="timing-refresh"),
    pytest.param(acceptance_ledger, LEARNING_FUNDING_NS, id="acceptance-learning"),
]


def test_rates_and_cap():
    assert CAP_NS == 5 * MS
    assert math.isclose(TIMING_REFRESH_RATE, 0.002 / 0.998, rel_tol=1e-15)
    assert math.isclose(ACCEPTANCE_LEARNING_RATE, 0.01 / 0.99, rel_tol=1e-15)
    assert timing_ledger().rate == TIMING_REFRESH_RATE
    assert acceptance_ledger().rate == ACCEPTANCE_LEARNING_RATE
    assert timing_ledger().cap_ns == CAP_NS
    assert acceptance_ledger().cap_ns == CAP_NS


@pytest.mark.parametrize(("make", "funding"), LEDGERS)
def test_funding_in_one_credit(make, funding):
    ledger = make()
    ledger.earn(funding - 1)
    assert not ledger.full
    assert not ledger.can_open()
    ledger = make()
    ledger.earn(funding)
    assert ledger.full
    assert ledger.can_open()
    assert ledger.balance_ns == pytest.approx(CAP_NS)


@pytest.mark.parametrize(("make", "funding"), LEDGERS)
def test_just_below_funding_in_frames_is_not_full(make, funding):
    ledger = make()
    for _ in range(funding // MS - 1):
        ledger.earn(MS)
    ledger.earn(MS - 1_000)  # one microsecond short
    assert not ledger.full
    assert ledger.balance_ns < CAP_NS


@pytest.mark.parametrize("frame_ms", [1, 5, 499])
def test_timing_refresh_funded_by_2495ms_of_frames(frame_ms):
    """2,495 ms of credited ordinary execution funds the first refresh, however it is split."""
    ledger = timing_ledger()
    frames = TIMING_FUNDING_NS // (frame_ms * MS)
    assert frames * frame_ms * MS == TIMING_FUNDING_NS
    for _ in range(frames):
        ledger.earn(frame_ms * MS)
    assert ledger.earned_basis_ns == TIMING_FUNDING_NS
    assert ledger.full, f"balance {ledger.balance_ns!r} after {frames} frames of {frame_ms} ms"


@pytest.mark.parametrize("frame_ms", [1, 5, 9, 11, 99])
def test_acceptance_learning_funded_by_495ms_of_frames(frame_ms):
    """495 ms of ordinary execution funds the first probe, however it is split."""
    ledger = acceptance_ledger()
    frames = LEARNING_FUNDING_NS // (frame_ms * MS)
    assert frames * frame_ms * MS == LEARNING_FUNDING_NS
    for _ in range(frames):
        ledger.earn(frame_ms * MS)
    assert ledger.earned_basis_ns == LEARNING_FUNDING_NS
    assert ledger.full, f"balance {ledger.balance_ns!r} after {frames} frames of {frame_ms} ms"


@pytest.mark.parametrize(("make", "funding"), LEDGERS)
def test_balance_is_capped(make, funding):
    ledger = make()
    ledger.earn(100 * funding)
    assert ledger.balance_ns == CAP_NS
    ledger.earn(MS)
    assert ledger.balance_ns == CAP_NS
    assert ledger.earned_basis_ns == 100 * funding + MS


def test_earning_is_linear_below_cap():
    ledger = timing_ledger()
    ledger.earn(1_000 * MS)
    assert ledger.balance_ns == pytest.approx(1_000 * MS * 0.002 / 0.998)
    assert not ledger.full


@pytest.mark.parametrize("credited", [0, -MS])
def test_non_positive_credit_ignored(credited):
    ledger = timing_ledger()
    ledger.earn(10 * MS)
    balance = ledger.balance_ns
    ledger.earn(credited)
    assert ledger.balance_ns == balance
    assert ledger.earned_basis_ns == 10 * MS


def test_idle_zeroes_positive_balance():
    ledger = timing_ledger()
    ledger.earn(1_000 * MS)
    assert ledger.balance_ns > 0
    ledger.idle()
    assert ledger.balance_ns == 0
    assert ledger.earned_basis_ns == 1_000 * MS


def test_idle_keeps_debt():
    ledger = CreditLedger(0.5, cap_ns=10)
    ledger.earn(20)
    ledger.open_episode()
    ledger.close_episode(25)
    assert ledger.balance_ns == -15
    ledger.idle()
    assert ledger.balance_ns == -15


def test_episode_spends_actual_duration_into_debt():
    ledger = timing_ledger()
    ledger.earn(TIMING_FUNDING_NS)
    ledger.open_episode()
    assert ledger.episode_open
    assert not ledger.can_open()
    ledger.close_episode(12 * MS)
    assert not ledger.episode_open
    assert ledger.balance_ns == pytest.approx(-7 * MS)
    assert ledger.spent_ns == 12 * MS
    assert not ledger.can_open()
    # Debt is repaid before the next episode: 12 ms of credit are needed.
    ledger.earn(int(11.9 * MS / TIMING_REFRESH_RATE))
    assert not ledger.can_open()
    ledger.earn(int(0.2 * MS / TIMING_REFRESH_RATE))
    assert ledger.can_open()


def test_cannot_open_without_full_credit():
    ledger = acceptance_ledger()
    with pytest.raises(RuntimeError):
        ledger.open_episode()
    ledger.earn(LEARNING_FUNDING_NS // 2)
    with pytest.raises(RuntimeError):
        ledger.open_episode()
    assert not ledger.episode_open


def test_cannot_open_while_open():
    ledger = acceptance_ledger()
    ledger.earn(10 * LEARNING_FUNDING_NS)
    ledger.open_episode()
    ledger.earn(10 * LEARNING_FUNDING_NS)
    assert ledger.full
    assert not ledger.can_open()
    with pytest.raises(RuntimeError):
        ledger.open_episode()
    assert ledger.episode_open
    ledger.close_episode(MS)
    assert not ledger.episode_open
    assert not ledger.can_open()  # 1 ms spent: below full credit again
    ledger.earn(10 * LEARNING_FUNDING_NS)
    assert ledger.can_open()


def test_close_with_negative_duration_spends_nothing():
    ledger = CreditLedger(1.0, cap_ns=10)
    ledger.earn(10)
    ledger.open_episode()
    ledger.close_episode(-5)
    assert ledger.balance_ns == 10
    assert ledger.spent_ns == 0


@pytest.mark.parametrize("make", [timing_ledger, acceptance_ledger])
@pytest.mark.parametrize("seed", range(8))
def test_spend_bounded_by_rate_times_earned_plus_one_episode(make, seed):
    rng = random.Random(seed)
    ledger = make()
    earned = 0
    spent = 0
    largest = 0
    last = 0
    episodes = 0
    for _ in range(4_000):
        roll = rng.random()
        if roll < 0.7:
            credited = rng.choice([0, rng.randint(1, 40 * MS), rng.randint(1, 400 * MS)])
            ledger.earn(credited)
            earned += max(0, credited)
        elif roll < 0.97:
            if ledger.can_open():
                ledger.open_episode()
                duration = rng.choice([rng.randint(0, 2 * MS), rng.randint(0, 60 * MS)])
                ledger.close_episode(duration)
                episodes += 1
                spent += duration
                largest = max(largest, duration)
                last = duration
            else:
                with pytest.raises(RuntimeError):
                    ledger.open_episode()
        else:
            ledger.idle()
        assert ledger.earned_basis_ns == earned
        assert ledger.spent_ns == spent
        assert ledger.balance_ns <= ledger.cap_ns
        # The spec's bound, with D the last episode, and so with the largest one.
        assert spent <= ledger.rate * earned + last + 1e-6
        assert spent <= ledger.rate * earned + largest + 1e-6
    assert episodes > 0  # the loop exercised episodes


# --------------------------------------------------------- through the Scheduler


def _records(plan):
    return [
        CompletionRecord(lane.slot, lane.generation, (1,) * lane.max_tokens) for lane in plan.lanes
    ]


def test_discovery_earns_nothing_and_ordinary_earns_credited_time():
    scheduler = Scheduler([GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)])
    scheduler.admit(RequestSpec(prompt_len=64 * 4, max_output_tokens=4))
    plan = scheduler.plan()
    assert plan.reason is SelectionReason.DISCOVERY
    scheduler.commit(plan, 1)
    scheduler.complete(1, _records(plan), ExecutionTiming((2 * MS,), host_wall_ns=3 * MS))
    assert scheduler.refresh_ledger.balance_ns == 0
    assert scheduler.learning_ledger.balance_ns == 0
    plan = scheduler.plan()
    assert plan.reason is SelectionReason.ORDINARY
    scheduler.commit(plan, 2)
    # Isolated frame: timing refresh credits the larger of device and wall time;
    # acceptance learning earns raw device time ("exploration budgets use raw
    # physical time").
    scheduler.complete(2, _records(plan), ExecutionTiming((2 * MS,), host_wall_ns=3 * MS))
    assert scheduler.refresh_ledger.balance_ns == pytest.approx(3 * MS * TIMING_REFRESH_RATE)
    assert scheduler.learning_ledger.balance_ns == pytest.approx(2 * MS * ACCEPTANCE_LEARNING_RATE)
