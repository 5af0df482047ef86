"""Bounds that rule causally allocated rounds out of a decision before their
cohort search (branch and bound; exact: the decision is the one the full
search makes).

A causally allocated program (a ragged host program, or a device-allocated
one) of batch B and target rows P serves a cohort of n <= min(B, lanes, P)
lanes; each lane is worth its base (one token, one delivery, the age value)
plus the gains of the extra rows it gets, P - n rows in all.  With every base
and every gain non-negative, its value is therefore at most

* max over n of (the n largest bases) + (the P - n largest row gains of the
  width), and
* the largest sum of at most min(B, P) lanes at their complete prefixes (a
  lane is worth the most at its ceiling),

whichever is smaller; its score is at most that value over its time, plus the
age slope of its largest cohort, less its time's active age cost.

A program whose bound is below the best score among the decision's other
candidates cannot be chosen, so its search is skipped when nothing else could
tell: it is measured and fresh (an unknown or stale program may still be
chosen, by discovery or a timing refresh), its value bound does not exceed the
decision's largest value (the plan's log scale is that largest value), and it
could not dominate a candidate that is kept (same cohort, query lengths and
depth on a shape no larger: the full search would then have dropped that
candidate).  The rest are searched; a candidate that search adds may drop
others by dominance, so the test is repeated until it holds
(``rounds._settle``).

Every deferred program of a decision is bounded at once, as arrays
(:class:`Pending`): the lanes' sorted prefix sums per ceiling (``Tops``,
built once a decision by ``lanes.LaneTable.tops``), then each program's
bounds and the search test by array operations, so a plan's cost grows with
lanes and shapes, not with their product; only the few programs the test
chooses are evaluated (``Pending.next_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from runtime.coordinator.policy import Candidate

# A bound is widened by this relative margin: the search's sums and these add
# the same terms in other orders, and rounding must never prune a winner.
MARGIN = 1e-9

# The log-scale test's slack (relative): a program whose value may exceed the
# decision's largest by less moves the plan's log scale by less than this
# (absolute) and its scaled figures by less than this (relative), far inside
# what the reference test and any reader of a plan resolve; the sums' own
# rounding is below 1e-13.
SCALE_SLACK = 1e-12

# Why a program must be searched (Pending.why): it might be chosen, set the
# plan's log scale, or dominate a kept candidate.
SCORE, SCALE, DOMINANCE = 1, 2, 3


class Tops(NamedTuple):
    """The lanes of a decision as the bounds read them, per ceiling group g
    (the lanes' ceilings on programs of min(D + 1, W) = that group's top):
    prefix sums ``[0, x1, x1 + x2, ...]`` of the bases, of the row gains and of
    the complete-prefix values, each sorted descending (the gains' sums stay
    flat past the group's rows), and whether a base or gain is negative (then
    there is no bound)."""

    bases: np.ndarray  # (lanes + 1,): every group has the same lanes and bases
    gains: np.ndarray  # (groups, rows + 1)
    fulls: np.ndarray  # (groups, lanes + 1)
    negative: bool


def tops_of(bases: np.ndarray, gains: np.ndarray, fulls: np.ndarray, negative: bool) -> Tops:
    """:class:`Tops` from the lanes' bases (lanes,), their row gains per group
    (groups, rows; zero where a group's lane has no such row, which leaves
    the sorted sums of non-negative gains as they are) and their
    complete-prefix values per group (groups, lanes).  ``negative``: a base or
    a gain is negative."""
    top_bases = np.zeros(bases.size + 1)
    np.cumsum(np.sort(bases)[::-1], out=top_bases[1:])
    top_gains = np.zeros((gains.shape[0], gains.shape[1] + 1))
    np.cumsum(np.sort(gains, axis=1)[:, ::-1], axis=1, out=top_gains[:, 1:])
    top_fulls = np.zeros((fulls.shape[0], fulls.shape[1] + 1))
    np.cumsum(np.sort(fulls, axis=1)[:, ::-1], axis=1, out=top_fulls[:, 1:])
    return Tops(top_bases, top_gains, top_fulls, negative)


def value_bounds(
    bases: Sequence[float], gains: Sequence[float], fulls: Sequence[float],
    programs: Sequence[tuple[int, int]],
) -> list[float]:  # fmt: skip
    """Per causally allocated program (B, P) an upper bound on its best
    cohort's value, the margin included (``-inf``: no lane fits; ``inf``: no
    bound, a negative base or gain), for one width's lanes given as their
    bases, every row gain and their complete-prefix values."""
    tops = tops_of(
        np.asarray(bases, dtype=float),
        np.asarray(gains, dtype=float).reshape(1, len(gains)),
        np.asarray(fulls, dtype=float).reshape(1, len(fulls)),
        min(bases, default=0.0) < 0.0 or min(gains, default=0.0) < 0.0,
    )
    group = np.zeros(len(programs), dtype=np.int64)
    batch = np.array([b for b, _ in programs], dtype=np.int64)
    target = np.array([p for _, p in programs], dtype=np.int64)
    return program_values(tops, group, batch, target, np.ones(len(programs), bool)).tolist()


def program_values(
    tops: Tops, group: np.ndarray, batch: np.ndarray, target: np.ndarray, causal: np.ndarray
) -> np.ndarray:
    """Per program j (of ceiling group ``group[j]``, batch B and target rows P)
    an upper bound on its value, the margin included: a causally allocated
    one's (``causal[j]``) the smaller of the best split (the n largest bases
    and the P - n largest gains, over 1 <= n <= m = min(B, lanes, P)) and the
    m best complete prefixes; a rectangular one's exact, its B best lanes at
    their complete prefixes.  ``-inf``: no lane fits; ``inf``: no bound."""
    lanes, rows = tops.bases.size - 1, tops.gains.shape[1] - 1
    if lanes == 0 or batch.size == 0:
        return np.full(batch.size, -np.inf)
    m = np.minimum(np.minimum(batch, lanes), target)
    bound = tops.fulls[group, np.minimum(batch, lanes)]  # rectangular: exact
    some = np.flatnonzero(causal & (m >= 1))
    if some.size:
        cm = m[some]
        n = np.arange(1, int(cm.max()) + 1)
        split = tops.bases[n][None, :] + tops.gains[
            group[some][:, None], np.clip(target[some][:, None] - n[None, :], 0, rows)
        ]
        split = np.where(n[None, :] <= cm[:, None], split, -np.inf).max(axis=1)
        bound[some] = np.minimum(split, tops.fulls[group[some], cm])
    bound = bound + MARGIN * np.abs(bound)
    bound[causal & (m < 1)] = -np.inf
    if tops.negative:
        bound[causal] = np.inf
    return bound


def score_bounds(
    values: np.ndarray, t_ms: np.ndarray, slope: float, sizes: np.ndarray, price: float
) -> np.ndarray:
    """Upper bounds on the scores of programs of value bounds ``values`` run in
    ``t_ms`` by cohorts of at most ``sizes`` lanes (``policy.value_rate``),
    widened by the margin (``-inf`` where nothing fits, ``inf`` without a bound
    or without a time: an unmeasured program)."""
    finite = np.isfinite(values)
    measured = t_ms > 0.0
    t = np.where(measured, t_ms, 1.0)
    age = np.maximum(slope, slope * sizes)
    score = np.where(finite, values, 0.0) / t + age - 0.5 * t * price
    score = score + MARGIN * np.abs(score)
    return np.where(finite, np.where(measured, score, np.inf), values)


class Shapes:
    """Programs' descriptors and shapes as arrays (what :class:`Pending` reads),
    built once a catalog."""

    def __init__(self, descs: Sequence) -> None:
        self.descs = list(descs)
        shape = np.array(
            [
                (d.batch_capacity, d.token_capacity, d.target_capacity, d.proposal_depth,
                 d.device_allocated)
                for d in self.descs
            ],
            dtype=np.int64,
        ).reshape(len(self.descs), 5)  # fmt: skip
        self.batch, self.width, self.target = shape[:, 0], shape[:, 1], shape[:, 2]
        self.depth, self.device = shape[:, 3], shape[:, 4].astype(bool)
        # Rectangular host programs: their bounds are their exact values.
        self.exact = ~self.device & (self.target >= self.batch * self.width)
        # (W, D, device): the programs one lane set and one cohort search serve.
        searches: dict[tuple[int, int, bool], int] = {}
        self.search = np.array(
            [
                searches.setdefault(
                    (d.token_capacity, d.proposal_depth, d.device_allocated), len(searches)
                )
                for d in self.descs
            ],
            dtype=np.int64,
        )


class Pending:
    """The deferred programs of a decision: their bounds, as arrays over
    ``shapes``, and which are deferred and still unevaluated (``alive``)."""

    def __init__(
        self, shapes: Shapes, deferred: np.ndarray, tops: Tops, group: np.ndarray,
        t_ms: np.ndarray, slope: float, price: float,
    ) -> None:  # fmt: skip
        self.shapes = s = shapes
        self.value = program_values(tops, group, s.batch, s.target, ~s.exact)
        lanes = tops.bases.size - 1
        sizes = np.minimum(np.minimum(s.batch, lanes), s.target)
        self.score = score_bounds(self.value, t_ms, slope, sizes, price)
        self.alive = deferred & (self.value != -np.inf)  # no lane fits: nothing to find

    def next_batch(
        self, kept: Sequence[Candidate], others: tuple[float, float] | None
    ) -> list[int]:
        """The positions to evaluate next, marked evaluated (empty: the bounds
        rule out every program left).  Of the programs :meth:`why` chooses,
        while exact (rectangular) ones remain: the one of the best score, the
        one of the largest value and those that may dominate (evaluating the
        first two settles the rest's score and scale tests); then the causal
        (W, D, device) group of the best bound, whose programs share one search."""
        why = self.why(kept, others)
        chosen = why > 0
        if not chosen.any():
            return []
        exact = chosen & self.shapes.exact
        if exact.any():
            batch = np.flatnonzero(exact & (why == DOMINANCE)).tolist()
            for code, key in ((SCORE, self.score), (SCALE, self.value)):
                some = np.flatnonzero(exact & (why == code))
                if some.size:
                    batch.append(int(some[np.argmax(key[some])]))
        else:
            some = np.flatnonzero(chosen)
            search = self.shapes.search
            best = some[np.argmax(self.score[some])]
            batch = np.flatnonzero(chosen & (search == search[best])).tolist()
        self.alive[batch] = False
        return batch

    def why(self, kept: Sequence[Candidate], others: tuple[float, float] | None) -> np.ndarray:
        """Per program why its search must run (0: it need not): it might be
        chosen (``SCORE``), set the decision's largest value (``SCALE``), or
        dominate a kept candidate (``DOMINANCE``).  ``kept``: this kind's
        undominated candidates so far; ``others``: the best known score and the
        largest value of the decision's candidates of other kinds
        (:func:`summary`; None: there are none)."""
        best, largest = others if others is not None else (float("-inf"), float("-inf"))
        for c in kept:
            if not c.unknown and c.score > best:
                best = c.score
            largest = max(largest, abs(c.value))
        why = np.zeros(self.alive.size, dtype=np.int64)
        if best == float("-inf"):  # no known score to beat: any may win
            why[self.alive] = SCORE
            return why
        best -= MARGIN * abs(best)
        scale = largest * (1.0 + SCALE_SLACK) * (1.0 + MARGIN)  # values carry the margin
        score = self.alive & (self.score >= best)
        why[score] = SCORE
        rest = self.alive & ~score
        scaled = rest & (self.value > scale)
        why[scaled] = SCALE
        rest &= ~scaled
        if rest.any():
            why[rest & self._may_dominate(kept)] = DOMINANCE
        return why

    def _may_dominate(self, kept: Sequence[Candidate]) -> np.ndarray:
        """Per program whether it could hold a kept candidate's work on a shape
        no larger in every capacity (and not the same shape)."""
        s = self.shapes
        out = np.zeros(self.alive.size, dtype=bool)
        for cand in kept:
            desc = cand.entry.descriptor
            b, w, p = desc.batch_capacity, desc.token_capacity, desc.target_capacity
            queries = cand.queries or ()
            out |= (
                (self.value >= cand.value)
                & (s.depth == desc.proposal_depth)
                & (s.device == desc.device_allocated)
                & (s.batch <= b) & (s.width <= w) & (s.target <= p)
                & ~((s.batch == b) & (s.width == w) & (s.target == p)
                    & (desc.prompt_capacity == 0))
                & (len(cand.lanes) <= np.minimum(s.batch, s.target))
                & (sum(queries) <= s.target)
            )  # fmt: skip
        return out


def summary(candidates: Sequence[Candidate]) -> tuple[float, float] | None:
    """The best known score and the largest value magnitude of ``candidates``
    (None: no candidate; a score of ``-inf``: none is known)."""
    if not candidates:
        return None
    known = [c.score for c in candidates if not c.unknown]
    return max(known, default=float("-inf")), max(abs(c.value) for c in candidates)
