"""Prerequisite lookahead arithmetic (spec, "Prerequisites and completion").

* ``best_pair`` against exhaustive enumeration of every feasible cohort pair;
* the continuation index and chain score by hand;
* terminal contributions, the terminal age stopping at T and the saved waiting
  cost in a two-stage sequence, by hand;
* the spec's verification item in pure form: varying the snapshot (restore)
  cost, enabling a shared decode batch wins exactly when the whole sequence has
  the larger value per time, with the crossover found analytically.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.coordinator.prerequisites import (
    PairChoice,
    Score,
    best_pair,
    chain_score,
    continuation_contribution,
    following_contribution,
    graph_score,
    pair_values,
    saved_waiting_value,
    sequence_rate,
    sequence_score,
    terminal_contribution,
    terminal_sequence_contribution,
)

# ---------------------------------------------------------------------------
# best_pair: exactness against every subset


def _subsets(values: list[float]) -> list[tuple[int, float]]:
    """(size, sum) of every subset, the empty one included."""
    out = []
    for r in range(len(values) + 1):
        for combo in itertools.combinations(range(len(values)), r):
            out.append((r, math.fsum(values[i] for i in combo)))
    return out


def brute_force(newly, ready, terminal, prereq_capacity, follow_capacity) -> float | None:
    """The best total over all feasible (served newly ready, ready, terminal)
    subsets with at least one served newly ready row; None if infeasible."""
    best = None
    ready_sets = _subsets(ready)
    term_sets = _subsets(terminal)
    for k, a in _subsets(newly):
        if k < 1 or k > prereq_capacity or k > follow_capacity:
            continue
        for r, b in ready_sets:
            if k + r > follow_capacity:
                continue
            for m, c in term_sets:
                if k + m > prereq_capacity:
                    continue
                total = a + b + c
                if best is None or total > best:
                    best = total
    return best


def check_choice(choice: PairChoice, newly, ready, terminal, prereq_capacity, follow_capacity):
    assert choice.k >= 1
    assert len(choice.newly_ready) == choice.k
    for chosen, values in (
        (choice.newly_ready + choice.advanced, newly),
        (choice.ready, ready),
        (choice.terminal, terminal),
    ):
        assert len(set(chosen)) == len(chosen)
        assert all(0 <= i < len(values) for i in chosen)
    assert choice.prerequisite_rows <= prereq_capacity
    assert choice.following_rows <= follow_capacity
    total = math.fsum(
        [newly[i] for i in choice.newly_ready]
        + [ready[i] for i in choice.ready]
        + [terminal[i] for i in choice.terminal]
    )
    assert choice.value == pytest.approx(total, abs=1e-9)
    # Fill rows are worth taking; spare prerequisite rows are used when rows remain.
    assert all(ready[i] > 0.0 for i in choice.ready)
    assert all(terminal[i] > 0.0 for i in choice.terminal)
    if len(choice.newly_ready) + len(choice.advanced) < len(newly):
        assert choice.prerequisite_rows == prereq_capacity


values_st = st.one_of(
    st.floats(min_value=-10.0, max_value=10.0, allow_nan=False),
    st.integers(min_value=-3, max_value=6).map(float),  # exact ties
)
lists_st = st.lists(values_st, max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    newly=lists_st,
    ready=lists_st,
    terminal=lists_st,
    prereq_capacity=st.integers(min_value=0, max_value=4),
    follow_capacity=st.integers(min_value=0, max_value=4),
)
def test_best_pair_matches_exhaustive_search(
    newly, ready, terminal, prereq_capacity, follow_capacity
):
    expected = brute_force(newly, ready, terminal, prereq_capacity, follow_capacity)
    choice = best_pair(newly, ready, terminal, prereq_capacity, follow_capacity)
    if expected is None:
        assert choice is None
        assert pair_values(newly, ready, terminal, prereq_capacity, follow_capacity) == []
        return
    assert choice is not None
    assert choice.value == pytest.approx(expected, abs=1e-9)
    assert max(pair_values(newly, ready, terminal, prereq_capacity, follow_capacity)) == (
        choice.value
    )
    check_choice(choice, newly, ready, terminal, prereq_capacity, follow_capacity)
    plain = best_pair(newly, ready, terminal, prereq_capacity, follow_capacity, advance_spare=False)
    assert plain is not None and plain.advanced == ()
    assert plain.value == choice.value


@settings(max_examples=200, deadline=None)
@given(
    newly=lists_st,
    ready=lists_st,
    terminal=lists_st,
    prereq_capacity=st.integers(min_value=1, max_value=4),
    follow_capacity=st.integers(min_value=1, max_value=4),
)
def test_pair_values_per_k_match_exhaustive_search(
    newly, ready, terminal, prereq_capacity, follow_capacity
):
    """Every k, not only the best: the k largest newly ready rows plus the best fills."""
    per_k = pair_values(newly, ready, terminal, prereq_capacity, follow_capacity)
    for k in range(1, len(per_k)):
        best = None
        for combo in itertools.combinations(range(len(newly)), k):
            a = math.fsum(newly[i] for i in combo)
            rest = brute_force(
                [0.0], ready, terminal, prereq_capacity - k + 1, follow_capacity - k + 1
            )
            total = a + rest
            best = total if best is None or total > best else best
        assert per_k[k] == pytest.approx(best, abs=1e-9)


@pytest.mark.parametrize(
    ("newly", "ready", "terminal", "p", "f", "expect"),
    [
        # A negative newly ready row is forced: at least one must participate.
        ([-5.0], [3.0, 2.0], [], 1, 2, (1, (0,), (0,), (), (), -2.0)),
        # k = 1 keeps room for a ready and a terminal row: 10 + 5 + 4 > 10 + 1.
        ([10.0, 1.0], [5.0], [4.0], 2, 2, (1, (0,), (0,), (0,), (), 19.0)),
        # k = 2 (10 + 7 = 17) beats k = 1 (10 + 6 = 16); the spare
        # prerequisite row advances the third newly ready row.
        ([10.0, 7.0, 0.5], [5.0, 6.0], [], 3, 2, (2, (0, 1), (), (), (2,), 17.0)),
        # Non-positive fills are left out; the spare row advances newly ready row 1.
        ([3.0, -1.0], [0.0, -2.0], [0.0], 2, 3, (1, (0,), (), (), (1,), 3.0)),
        # Equal totals over k: both choices advance two requests; the larger k wins.
        ([5.0, 0.0], [], [], 2, 2, (2, (0, 1), (), (), (), 5.0)),
        # A terminal row worth more than a second served newly ready row.
        ([8.0, 2.0, 1.0], [], [3.0], 2, 4, (1, (0,), (), (0,), (), 11.0)),
    ],
)
def test_best_pair_cases(newly, ready, terminal, p, f, expect):
    choice = best_pair(newly, ready, terminal, p, f)
    assert choice is not None
    got = (choice.k, choice.newly_ready, choice.ready, choice.terminal, choice.advanced)
    assert got == expect[:5]
    assert choice.value == pytest.approx(expect[5])


@pytest.mark.parametrize(
    ("newly", "p", "f"),
    [([], 2, 2), ([1.0], 0, 2), ([1.0], 2, 0)],
)
def test_best_pair_infeasible(newly, p, f):
    assert best_pair(newly, [1.0], [1.0], p, f) is None
    assert pair_values(newly, [1.0], [1.0], p, f) == []


def test_equal_value_prefers_advancing_more_requests():
    # F = 1 allows only k = 1; the spare prerequisite rows advance row 1.
    choice = best_pair([5.0, 0.0], [], [], 3, 1)
    assert choice is not None
    assert (choice.k, choice.advanced, choice.requests) == (1, (1,), 2)
    plain = best_pair([5.0, 0.0], [], [], 3, 1, advance_spare=False)
    assert plain is not None and plain.requests == 1


# ---------------------------------------------------------------------------
# Continuations and chains


def test_continuation_index_by_hand():
    assert continuation_contribution(64.0, 10.0, 30.0) == 16.0
    assert continuation_contribution(64.0, 10.0, 0.0) == 64.0  # unknown F: optimistic
    assert continuation_contribution(64.0, 0.0, 30.0) == 64.0  # unknown T: optimistic
    # 64*10/40 + 30*10/20 = 16 + 15; / T = 3.1; minus T/2 * 0.02 = 0.1.
    parts = [
        continuation_contribution(64.0, 10.0, 30.0),
        continuation_contribution(30.0, 10.0, 10.0),
    ]
    assert chain_score(parts, 10.0, 0.02) == Score(pytest.approx(3.0), False)
    assert chain_score(parts, 0.0, 0.02) == Score(31.0, True)


# ---------------------------------------------------------------------------
# Terminal rows in a two-stage sequence


def test_terminal_contribution_by_hand():
    # 10 + 0.01 * 20 * (30 + 5) = 17
    assert terminal_contribution(10.0, 0.01, 20.0, 30.0, 5.0) == pytest.approx(17.0)
    # Unknown T: no duration invented, the age counts A alone.
    assert terminal_contribution(10.0, 0.01, 20.0, 30.0, 0.0) == pytest.approx(16.0)
    # No reference interval: no age value.
    assert terminal_contribution(10.0, 0.01, 0.0, 30.0, 5.0) == 10.0


def test_terminal_age_stops_at_t_in_a_sequence():
    """Prerequisite T = 5 ms finishes a terminal row (value 10, price p = 0.01,
    sigma 20, age 30); the following graph F = 15 ms serves one decoder
    (value 40, c*sigma = 0.5) with c = 0.02.  Active age price 0.03."""
    t, f, active = 5.0, 15.0, 0.03
    term = terminal_contribution(10.0, 0.01, 20.0, 30.0, t)
    assert term == pytest.approx(17.0)  # age stops at T: not 10 + 0.2 * 50 = 20
    # Waiting the row no longer pays over the remaining F: p ((T+F)^2 - T^2) / 2.
    saved = saved_waiting_value(0.01, t, f)
    assert saved == pytest.approx(0.01 * (20.0**2 - 5.0**2) / 2) == pytest.approx(1.875)
    assert terminal_sequence_contribution(10.0, 0.01, 20.0, 30.0, t, f) == pytest.approx(18.875)
    follow = following_contribution(40.0, 0.5, t, f)
    assert follow == pytest.approx(50.0)  # age resets at T + F = 20

    s = sequence_score(term, 0.01, 40.0, 0.5, t, f, active)
    # whole = (17 + 1.875 + 50) / 20 - 20/2 * 0.03 = 3.44375 - 0.3
    assert s.whole == Score(pytest.approx(3.14375), False)
    # prefix = 17 / 5 - 5/2 * 0.03 = 3.4 - 0.075
    assert s.prefix == Score(pytest.approx(3.325), False)
    assert s.prefix_wins and s.score == pytest.approx(3.325)

    # A more valuable following row: the complete sequence wins.
    s = sequence_score(term, 0.01, 70.0, 0.5, t, f, active)
    assert s.whole.score == pytest.approx((17 + 1.875 + 70 + 10) / 20 - 0.3)
    assert not s.prefix_wins and s.score == s.whole.score

    # The same numbers through best_pair's additive contributions.
    choice = best_pair(
        [following_contribution(40.0, 0.5, t, f)],
        [],
        [terminal_sequence_contribution(10.0, 0.01, 20.0, 30.0, t, f)],
        2,
        1,
    )
    assert choice is not None and choice.terminal == (0,)
    assert sequence_rate(choice.value, t, f, active) == pytest.approx(3.14375)

    # No terminal row: setup alone is not a productive prefix.
    s = sequence_score(0.0, 0.0, 40.0, 0.5, t, f, active)
    assert s.prefix is None and not s.prefix_wins
    assert s.score == pytest.approx(50.0 / 20 - 0.3)


def test_unknown_durations_compare_by_value():
    # Unknown F: the sequence is indeterminate (value 17 + 40) and ranks first.
    s = sequence_score(17.0, 0.01, 40.0, 0.5, 5.0, 0.0, 0.03)
    assert s.whole == Score(57.0, True) and s.prefix == Score(pytest.approx(3.325), False)
    assert (s.unknown, s.score, s.prefix_wins) == (True, 57.0, False)
    # Unknown T: both indeterminate, compared by value.
    s = sequence_score(17.0, 0.01, 40.0, 0.5, 0.0, 15.0, 0.03)
    assert s.prefix == Score(17.0, True) and s.whole == Score(57.0, True)
    assert not s.prefix_wins
    s = sequence_score(17.0, 0.01, -5.0, 0.0, 0.0, 15.0, 0.03)
    assert s.prefix_wins and s.score == 17.0
    assert graph_score(9.0, 1.0, 0.0, 0.5) == Score(9.0, True)
    assert following_contribution(40.0, 0.5, 5.0, 0.0) == 40.0


@settings(max_examples=200, deadline=None)
@given(
    decoders=st.lists(
        st.tuples(st.floats(0.0, 50.0), st.floats(0.0, 2.0), st.booleans()), min_size=1, max_size=6
    ),
    terminals=st.lists(
        st.tuples(st.floats(0.0, 20.0), st.floats(0.0, 0.05), st.floats(0.0, 100.0)), max_size=4
    ),
    t=st.floats(0.5, 50.0),
    f=st.floats(0.5, 50.0),
    sigma=st.floats(0.0, 40.0),
    prereq_capacity=st.integers(1, 4),
    follow_capacity=st.integers(1, 4),
)
def test_sequence_rate_of_best_pair_is_the_exhaustive_best_rate(
    decoders, terminals, t, f, sigma, prereq_capacity, follow_capacity
):
    """With contributions from the helpers, best_pair's value gives the best
    sequence rate over every cohort pair, and sequence_score agrees with it."""
    newly = [(v, s) for v, s, is_new in decoders if is_new]
    ready = [(v, s) for v, s, is_new in decoders if not is_new]
    active = 0.01 * len(decoders) + sum(p for _, p, _ in terminals)
    newly_c = [following_contribution(v, s, t, f) for v, s in newly]
    ready_c = [following_contribution(v, s, t, f) for v, s in ready]
    term_c = [terminal_sequence_contribution(tv, p, sigma, a, t, f) for tv, p, a in terminals]
    choice = best_pair(newly_c, ready_c, term_c, prereq_capacity, follow_capacity)
    expected = brute_force(newly_c, ready_c, term_c, prereq_capacity, follow_capacity)
    if expected is None:
        assert choice is None
        return
    assert choice is not None
    best_rate = sequence_rate(expected, t, f, active)
    assert sequence_rate(choice.value, t, f, active) == pytest.approx(best_rate, abs=1e-9)
    chosen = [newly[i] for i in choice.newly_ready] + [ready[i] for i in choice.ready]
    rows = [terminals[i] for i in choice.terminal]
    s = sequence_score(
        math.fsum(terminal_contribution(tv, p, sigma, a, t) for tv, p, a in rows),
        math.fsum(p for _, p, _ in rows),
        math.fsum(value for value, _ in chosen),
        math.fsum(slope for _, slope in chosen),
        t,
        f,
        active,
    )
    assert s.whole.score == pytest.approx(best_rate, rel=1e-9, abs=1e-9)
    assert s.score >= s.whole.score


# ---------------------------------------------------------------------------
# The spec's verification item: varying snapshot cost


def crossover_u(w: float, slope: float, rate0: float, c: float) -> float:
    """Horizon u where w/u + slope - u*c/2 = rate0 (the sequence's rate is
    decreasing in u): (c/2) u^2 + (rate0 - slope) u - w = 0."""
    b = rate0 - slope
    if c == 0.0:
        return w / b
    return (-b + math.sqrt(b * b + 2.0 * c * w)) / c


@pytest.mark.parametrize("active_c", [0.0, 0.004, 0.05])
@pytest.mark.parametrize("ready_rows", [3, 4])  # 4: the batch is full, a ready row is displaced
def test_enabling_a_shared_decode_batch_wins_only_with_enough_value_per_time(active_c, ready_rows):
    """A decode graph of batch B = 4, F = 8 ms; ``ready_rows`` decoders are
    ready, one more becomes ready only after a restore of T ms.  Candidates:
    the plain decode of the best ready rows, and the restore followed by a
    decode serving the restored row and the best ready rows (best_pair).
    Sweeping T, the sequence wins exactly when its whole-sequence value per
    time is larger, i.e. exactly below the analytic crossover T*."""
    batch, f = 4, 8.0
    ready = [(30.0, 0.4), (25.0, 0.4), (20.0, 0.4), (12.0, 0.4)][:ready_rows]
    new = (60.0, 0.4)
    # Common waiting: every decoder, the blocked one included.
    active = active_c * (ready_rows + 1)

    served = sorted(ready, reverse=True)[:batch]
    plain = graph_score(sum(v for v, _ in served), sum(s for _, s in served), f, active)
    assert not plain.unknown

    # The sequence's cohort: the new row plus the best ready rows fitting B - 1.
    seq_rows = [new, *sorted(ready, reverse=True)[: batch - 1]]
    w = sum(v for v, _ in seq_rows)
    slope = sum(s for _, s in seq_rows)
    u_star = crossover_u(w, slope, plain.score, active)
    t_star = u_star - f
    assert 1.0 < t_star < 200.0  # the scenario has a crossover inside the sweep

    def outcome(t: float) -> tuple[bool, float]:
        choice = best_pair(
            [following_contribution(*new, t, f)],
            [following_contribution(v, s, t, f) for v, s in ready],
            [],
            1,
            batch,
        )
        assert choice is not None and choice.k == 1
        assert len(choice.ready) == min(ready_rows, batch - 1)
        seq = sequence_score(
            0.0,
            0.0,
            new[0] + sum(ready[i][0] for i in choice.ready),
            new[1] + sum(ready[i][1] for i in choice.ready),
            t,
            f,
            active,
        )
        assert seq.prefix is None
        assert seq.score == pytest.approx(sequence_rate(choice.value, t, f, active))
        winner = max((seq, plain), key=lambda x: x.rank_key())
        return winner is seq, seq.score

    for t in [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, t_star * 0.5, t_star * 2]:
        wins, rate = outcome(t)
        assert wins == (rate > plain.score)
        assert wins == (t < t_star)
    # Both sides of the crossover.
    assert outcome(t_star * (1 - 1e-6))[0]
    assert not outcome(t_star * (1 + 1e-6))[0]
    # At the crossover itself the two rates agree.
    assert outcome(t_star)[1] == pytest.approx(plain.score, rel=1e-9)
