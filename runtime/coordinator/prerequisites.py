"""Prerequisite lookahead arithmetic (spec, "Prerequisites and completion").

Pure value arithmetic for a prerequisite graph (initialization, restore,
vision, snapshot) that immediately enables inference.  Nothing here knows
about requests, graphs or clocks: callers pass additive lane contributions
and durations in ms, in the units of ``docs/design.md`` (value in
prompt-token units, ``c`` in value/ms^2, ``sigma`` and ages in ms).

The fixed pair (spec):

    "When a prerequisite immediately enables inference, compare every pair of
    prepared prerequisite and following inference shapes. Both cohorts are
    selected jointly. The first graph can also finish terminal requests; the
    following graph can include already ready requests."

    "For fixed graph durations and capacities, lane values are additive.
    Enumerate the number k of newly ready rows served by the following graph.
    Choose the k largest such contributions, fill its remaining capacity with
    the largest already ready contributions, and fill the prerequisite's
    remaining capacity with the largest terminal-completion contributions.
    Sorted prefix sums give the best choice over all k without enumerating
    request subsets. [...] At least one newly ready row must participate in
    the following graph."

:func:`best_pair` is that calculation.  A newly ready row occupies one
prerequisite row and one following row, an already ready row one following
row, a terminal row one prerequisite row.  For a fixed ``k`` the three choices
are independent, so the top-``k`` newly ready rows plus the best fills are
optimal for that ``k``, and the maximum over ``k`` is the exact optimum over
every feasible cohort pair (``tests/coordinator/test_prerequisites.py`` checks
it against enumeration of all subsets).

Sequence score (spec):

    "Score the sequence using total duration T+F and expected useful service,
    with output ages resetting at the following graph's completion. Terminal
    requests completed in the first graph stop accumulating age at time T.
    Compare the productive first-stage prefix as well as the complete
    sequence. Unused prerequisite capacity can advance additional rows at no
    extra physical cost; equal value rates prefer advancing more requests."

With the single-graph objective of ``runtime/coordinator/utility.py``
(``(value + age_slope*T)/T - T/2 * sum_active c``) extended to the horizon
``U = T + F``:

    whole  = (terminal + saved + follow + follow_slope * U) / U - U/2 * sum_active c
    prefix = terminal / T - T/2 * sum_active c           (only if stage 1 finishes a row)

``terminal`` sums :func:`terminal_contribution` (age stopping at ``T``);
``saved = p * (U^2 - T^2) / 2`` is the waiting cost a terminal row of age price
``p`` no longer pays after it completes at ``T``: the common term charges every
active row ``c * U^2 / 2`` over the sequence, a row finished at ``T`` only
``p * T^2 / 2``.  For fixed ``T`` and ``F`` every piece is additive per row and
the common term is cohort-independent, so maximizing the summed contribution
(:func:`best_pair`) also maximizes the sequence rate.

Chains (spec): "an individual continuation supplies value V in a further F
milliseconds. Its cohort-ranking contribution is V*T/(T+F). Sum these
contributions, divide by T, and apply the cost of delaying active decoders."

Terminal lanes (spec): "For snapshot duration T, terminal age A, and the
snapshot family's batch-feasible reference interval sigma, the lane
contributes terminal_value + terminal_age_price * sigma * (A + T)."

Unknown durations (``<= 0`` ms) follow ``policy.Candidate``: an indeterminate
score is the useful value itself (no division by an unknown time), and an
indeterminate score ranks above every determinate one (``Score.rank_key``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PairChoice",
    "Score",
    "SequenceScore",
    "best_pair",
    "chain_score",
    "continuation_contribution",
    "following_contribution",
    "graph_score",
    "pair_values",
    "saved_waiting_value",
    "sequence_rate",
    "sequence_score",
    "terminal_contribution",
    "terminal_sequence_contribution",
]


# ---------------------------------------------------------------------------
# Lane contributions


def terminal_contribution(
    terminal_value: float,
    terminal_age_price: float,
    sigma_ms: float,
    age_ms: float,
    t_ms: float,
) -> float:
    """``terminal_value + terminal_age_price * sigma * (A + T)``: a terminal
    snapshot lane of a graph of duration ``t_ms`` (its age stops at ``T``).

    An unknown ``T`` (``<= 0``) or reference interval (``0``) invents nothing:
    the age part then counts ``A`` alone, or vanishes with ``sigma = 0``.
    """
    t = t_ms if t_ms > 0.0 else 0.0
    return terminal_value + terminal_age_price * sigma_ms * (age_ms + t)


def saved_waiting_value(terminal_age_price: float, t_ms: float, f_ms: float) -> float:
    """Waiting cost (value) a row finishing at ``T`` saves over a sequence of
    ``T + F``: ``p * ((T+F)^2 - T^2) / 2 = p * F * (2T + F) / 2``.

    The common waiting term charges each active row ``c * U / 2`` per ms of a
    horizon ``U``, i.e. ``c * U^2 / 2`` in value; a terminal row's age stops at
    ``T``, so it owes only ``p * T^2 / 2``.  Zero when either duration is unknown.
    """
    if t_ms <= 0.0 or f_ms <= 0.0:
        return 0.0
    return terminal_age_price * f_ms * (2.0 * t_ms + f_ms) / 2.0


def terminal_sequence_contribution(
    terminal_value: float,
    terminal_age_price: float,
    sigma_ms: float,
    age_ms: float,
    t_ms: float,
    f_ms: float,
) -> float:
    """A terminal row finished by the prerequisite of a two-stage sequence:
    :func:`terminal_contribution` at ``T`` plus :func:`saved_waiting_value`.
    This is the additive value :func:`best_pair` expects in ``terminal``."""
    return terminal_contribution(
        terminal_value, terminal_age_price, sigma_ms, age_ms, t_ms
    ) + saved_waiting_value(terminal_age_price, t_ms, f_ms)


def following_contribution(value: float, age_slope: float, t_ms: float, f_ms: float) -> float:
    """A row served by the following graph: its T-independent value (priced
    service + ``c * sigma * A``) plus ``c * sigma * (T + F)``, the output age
    resetting at the following graph's completion.  Unknown durations add no
    age (as ``policy.Candidate`` scores an unknown graph by its value alone)."""
    if t_ms <= 0.0 or f_ms <= 0.0:
        return value
    return value + age_slope * (t_ms + f_ms)


def continuation_contribution(value: float, t_ms: float, further_ms: float) -> float:
    """``V * T / (T + F)``: the cohort-ranking contribution of a continuation
    worth ``V`` that needs a further ``F`` ms after this stage's ``T`` ms.
    An unknown ``T`` or ``F`` (``<= 0``) compares optimistically: ``V``."""
    if t_ms <= 0.0 or further_ms <= 0.0:
        return value
    return value * t_ms / (t_ms + further_ms)


# ---------------------------------------------------------------------------
# Scores


@dataclass(frozen=True, slots=True)
class Score:
    """A candidate's selection score: a value rate, or (``unknown``) its
    optimistic useful value.  ``rank_key`` orders like ``policy.Candidate``:
    indeterminate first, then by score."""

    score: float
    unknown: bool

    def rank_key(self) -> tuple[bool, float]:
        return (self.unknown, self.score)


def graph_score(value: float, age_slope: float, t_ms: float, active_age_price: float) -> Score:
    """One graph: ``(value + age_slope * T) / T - T/2 * active_age_price``
    (``utility.value_rate``), or ``value`` when ``T`` is unknown."""
    if t_ms <= 0.0:
        return Score(value, True)
    return Score((value + age_slope * t_ms) / t_ms - 0.5 * t_ms * active_age_price, False)


def sequence_rate(total_value: float, t_ms: float, f_ms: float, active_age_price: float) -> float:
    """``total / (T+F) - (T+F)/2 * active_age_price`` for known ``T`` and ``F``;
    ``total`` is a :class:`PairChoice` value (contributions already include the
    age and saved-waiting terms).  Monotone in ``total`` for fixed shapes."""
    u = t_ms + f_ms
    return total_value / u - 0.5 * u * active_age_price


@dataclass(frozen=True, slots=True)
class SequenceScore:
    """The better of the complete sequence and its productive first stage.

    ``whole``: the sequence rate over ``T + F`` (or its value when a duration
    is unknown); ``prefix``: stage 1 alone over ``T``, ``None`` when stage 1
    finishes no terminal row (setup alone is not productive); ``prefix_wins``:
    the prefix strictly beat the sequence (ties keep the sequence, which
    advances more requests).  ``score``/``unknown`` are the winner's."""

    score: float
    unknown: bool
    whole: Score
    prefix: Score | None
    prefix_wins: bool

    def rank_key(self) -> tuple[bool, float]:
        return (self.unknown, self.score)


def sequence_score(
    terminal_value: float,
    terminal_age_price: float,
    follow_value: float,
    follow_age_slope: float,
    t_ms: float,
    f_ms: float,
    active_age_price: float,
) -> SequenceScore:
    """Score a prerequisite of ``t_ms`` followed by inference of ``f_ms``.

    ``terminal_value``: sum of :func:`terminal_contribution` (at ``T``) over
    the terminal rows the prerequisite finishes; ``terminal_age_price``: the sum
    of their age prices (their waiting stops at ``T``); ``follow_value``: the
    following graph's rows' T-independent value (priced service +
    ``c*sigma*A``); ``follow_age_slope``: their summed ``c*sigma`` (ages reset at
    ``T + F``); ``active_age_price``: sum of ``c`` over every active row,
    terminal rows included (the common waiting cost).

        whole  = (terminal + saved + follow + slope*(T+F)) / (T+F) - (T+F)/2 * active
        prefix = terminal / T - T/2 * active

    Unknown durations (``<= 0``): the sequence is indeterminate and scores its
    useful value ``terminal + follow``; the prefix is indeterminate only with
    ``T`` unknown.  The winner is chosen by ``Score.rank_key`` (indeterminate
    first), so an unknown following duration ranks the sequence first, as an
    unmeasured graph would.
    """
    if t_ms <= 0.0 or f_ms <= 0.0:
        whole = Score(terminal_value + follow_value, True)
    else:
        u = t_ms + f_ms
        total = (
            terminal_value
            + saved_waiting_value(terminal_age_price, t_ms, f_ms)
            + follow_value
            + follow_age_slope * u
        )
        whole = Score(sequence_rate(total, t_ms, f_ms, active_age_price), False)
    prefix: Score | None = None
    if terminal_value > 0.0:
        prefix = graph_score(terminal_value, 0.0, t_ms, active_age_price)
    if prefix is not None and prefix.rank_key() > whole.rank_key():
        return SequenceScore(prefix.score, prefix.unknown, whole, prefix, True)
    return SequenceScore(whole.score, whole.unknown, whole, prefix, False)


def chain_score(contributions: Sequence[float], t_ms: float, active_age_price: float) -> Score:
    """A stage of a longer chain: ``sum(contributions) / T - T/2 * active_age_price``
    with each contribution from :func:`continuation_contribution`; an unknown
    ``T`` scores the summed value optimistically (``unknown`` set)."""
    total = sum(contributions)
    if t_ms <= 0.0:
        return Score(total, True)
    return Score(total / t_ms - 0.5 * t_ms * active_age_price, False)


# ---------------------------------------------------------------------------
# The fixed-pair cohort choice


@dataclass(frozen=True, slots=True)
class PairChoice:
    """The jointly chosen cohorts of one prerequisite/following shape pair.

    Indices refer to the lists given to :func:`best_pair`, best first.
    ``newly_ready``: the ``k`` newly ready rows the following graph serves (each
    also takes a prerequisite row); ``ready``: already ready rows in the
    following graph; ``terminal``: rows the prerequisite finishes; ``advanced``:
    further newly ready rows put on spare prerequisite rows at no extra
    physical cost, not served by the following graph and worth nothing in this
    lookahead.  ``value``: the summed contributions of ``newly_ready``,
    ``ready`` and ``terminal``.
    """

    k: int
    newly_ready: tuple[int, ...]
    ready: tuple[int, ...]
    terminal: tuple[int, ...]
    advanced: tuple[int, ...]
    value: float

    @property
    def prerequisite_rows(self) -> int:
        return self.k + len(self.terminal) + len(self.advanced)

    @property
    def following_rows(self) -> int:
        return self.k + len(self.ready)

    @property
    def requests(self) -> int:
        return self.k + len(self.ready) + len(self.terminal) + len(self.advanced)


def _order(values: Sequence[float]) -> list[int]:
    """Indices by decreasing value, ties by index (deterministic)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def _positive_prefix(values: Sequence[float], order: list[int]) -> list[float]:
    """Prefix sums over the positive values in ``order`` (``[0.0, v1, v1+v2, ...]``)."""
    sums = [0.0]
    for i in order:
        if values[i] <= 0.0:
            break
        sums.append(sums[-1] + values[i])
    return sums


def pair_values(
    newly_ready: Sequence[float],
    ready: Sequence[float],
    terminal: Sequence[float],
    prereq_capacity: int,
    follow_capacity: int,
) -> list[float]:
    """The best total value for each ``k`` (index ``k``; index 0 is unused and
    ``-inf``).  Empty when no pair is feasible.  See :func:`best_pair`."""
    kmax = min(len(newly_ready), prereq_capacity, follow_capacity)
    if kmax < 1:
        return []
    new_sorted = [newly_ready[i] for i in _order(newly_ready)]
    ready_sums = _positive_prefix(ready, _order(ready))
    term_sums = _positive_prefix(terminal, _order(terminal))
    out = [float("-inf")]
    forced = 0.0
    for k in range(1, kmax + 1):
        forced += new_sorted[k - 1]
        r = min(follow_capacity - k, len(ready_sums) - 1)
        m = min(prereq_capacity - k, len(term_sums) - 1)
        out.append(forced + ready_sums[r] + term_sums[m])
    return out


def best_pair(
    newly_ready: Sequence[float],
    ready: Sequence[float],
    terminal: Sequence[float],
    prereq_capacity: int,
    follow_capacity: int,
    *,
    advance_spare: bool = True,
) -> PairChoice | None:
    """The exact best joint cohorts for one prerequisite/following shape pair.

    ``newly_ready``: contributions of rows the prerequisite makes ready, if
    the following graph serves them (:func:`following_contribution`);
    ``ready``: already ready rows' contributions to the following graph;
    ``terminal``: contributions of terminal rows the prerequisite can finish
    (:func:`terminal_sequence_contribution`).  Any order, any sign.

    For each ``k`` in ``1..min(len(newly_ready), prereq_capacity,
    follow_capacity)``: the ``k`` largest newly ready contributions (forced,
    whatever their sign: at least one must participate), plus the largest
    *positive* ready contributions up to ``follow_capacity - k``, plus the
    largest *positive* terminal contributions up to ``prereq_capacity - k``.
    A non-positive contribution is never taken to fill capacity (it cannot
    raise the total, and leaving it out is what an exhaustive search would
    do).  The best ``k`` maximizes the total; equal totals prefer more
    requests (served, finished or advanced), then the larger ``k``.  With
    ``advance_spare`` the prerequisite's remaining rows take further newly
    ready rows (best first) as ``advanced``.

    ``None`` when there is no newly ready row or either capacity is below one.
    O(n log n): three sorts, prefix sums, one pass over ``k``.
    """
    values = pair_values(newly_ready, ready, terminal, prereq_capacity, follow_capacity)
    if not values:
        return None
    new_order = _order(newly_ready)
    ready_order = _order(ready)
    term_order = _order(terminal)
    n_ready_pos = len(_positive_prefix(ready, ready_order)) - 1
    n_term_pos = len(_positive_prefix(terminal, term_order)) - 1
    n_new = len(newly_ready)

    def shape(k: int) -> tuple[int, int, int]:
        r = min(follow_capacity - k, n_ready_pos)
        m = min(prereq_capacity - k, n_term_pos)
        a = min(n_new - k, prereq_capacity - k - m) if advance_spare else 0
        return r, m, a

    best_key: tuple[float, int, int] | None = None
    best_k = 1
    for k in range(1, len(values)):
        r, m, a = shape(k)
        key = (values[k], k + r + m + a, k)
        if best_key is None or key > best_key:
            best_key, best_k = key, k
    r, m, a = shape(best_k)
    return PairChoice(
        k=best_k,
        newly_ready=tuple(new_order[:best_k]),
        ready=tuple(ready_order[:r]),
        terminal=tuple(term_order[:m]),
        advanced=tuple(new_order[best_k : best_k + a]),
        value=values[best_k],
    )
