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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate

from runtime.coordinator.lanes import Columns
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


class Deferred:
    """A program whose evaluation waits on its bound (a rectangular program's
    is its exact value and score, widened by the margin)."""

    __slots__ = ("depth", "device", "exact", "extents", "position", "score", "value", "why")

    def __init__(self, position: int, desc, value: float, score: float, exact: bool) -> None:
        self.position = position  # its place among the competing programs
        self.extents = (desc.batch_capacity, desc.token_capacity, desc.target_capacity, 0)
        self.depth = desc.proposal_depth
        self.device = desc.device_allocated
        self.value = value  # upper bounds, margin included
        self.score = score
        self.exact = exact  # the bounds are its value and score (cheap to evaluate)
        self.why = ""  # what requires its evaluation (to_search): score, scale, dominance

    @property
    def group(self) -> tuple[int, int, bool]:
        """(W, D, device): the programs one lane set and one search serve."""
        return self.extents[1], self.depth, self.device


def value_bounds(lanes: Columns, programs: Sequence[tuple[int, int]]) -> list[float]:
    """Per program (B, P) an upper bound on its best cohort's value, the margin
    included (``-inf``: no lane fits; ``inf``: no bound, a negative base or gain).
    ``lanes``: the width's lanes as columns (``lanes.LaneTable.columns``)."""
    bases = sorted(lanes.bases, reverse=True)
    gains = sorted(lanes.gains, reverse=True)
    if (bases and bases[-1] < 0.0) or (gains and gains[-1] < 0.0):
        return [float("inf")] * len(programs)
    top_bases = [0.0, *accumulate(bases)]
    top_gains = [0.0, *accumulate(gains)]
    top_full = [0.0, *accumulate(sorted(lanes.fulls, reverse=True))]
    out = []
    for batch, target in programs:
        m = min(batch, len(bases), target)
        if m < 1:
            out.append(float("-inf"))
            continue
        n = _best_split(bases, gains, target, m)
        split = top_bases[n] + top_gains[min(len(gains), target - n)]
        bound = min(split, top_full[m])
        out.append(bound + MARGIN * abs(bound))
    return out


def _best_split(bases: Sequence[float], gains: Sequence[float], target: int, m: int) -> int:
    """The n in 1..m that maximises (the n largest bases) + (the target - n
    largest gains), both lists sorted descending.  One more lane changes the sum
    by bases[n] less the gain it displaces, gains[target - n - 1] (0 past the
    end): a non-increasing step (bases fall, displaced gains rise), so the sum
    is concave in n and the last n whose step in is positive is a maximum."""
    rows = len(gains)

    def step(n: int) -> float:  # f(n + 1) - f(n)
        k = target - n - 1
        return bases[n] - (gains[k] if k < rows else 0.0)

    low, high = 1, m  # the answer lies in [low, high]
    while low < high:
        mid = (low + high) // 2
        if step(mid) > 0.0:
            low = mid + 1
        else:
            high = mid
    return low


def score_bound(value: float, t_ms: float, slope: float, size: int, price: float) -> float:
    """An upper bound on the score of a value bound ``value`` run in ``t_ms``
    by a cohort of at most ``size`` lanes (``policy.value_rate``)."""
    if value == float("-inf"):
        return value  # nothing fits
    age = max(slope, slope * size)
    score = value / t_ms + age - 0.5 * t_ms * price
    return score + MARGIN * abs(score)


def to_search(
    deferred: Iterable[Deferred], kept: Sequence[Candidate], others: tuple[float, float] | None
) -> list[Deferred]:
    """The deferred programs whose search must run: those that might be chosen,
    set the decision's largest value, or dominate a kept candidate.
    ``kept``: this kind's undominated candidates so far; ``others``: the best
    known score and the largest value of the decision's candidates of other
    kinds (:func:`summary`; None: there are none)."""
    best, largest = others if others is not None else (float("-inf"), float("-inf"))
    for c in kept:
        if not c.unknown and c.score > best:
            best = c.score
        largest = max(largest, abs(c.value))
    if best == float("-inf"):  # no known score to beat: any may win
        out = [d for d in deferred if d.value != float("-inf")]
        for d in out:
            d.why = "score"
        return out
    best -= MARGIN * abs(best)
    scale = largest * (1.0 + SCALE_SLACK) * (1.0 + MARGIN)  # the values carry the margin
    out = []
    for d in deferred:
        if d.value == float("-inf"):
            continue  # no lane fits: the search finds nothing
        if d.score >= best:
            d.why = "score"
        elif d.value > scale:
            d.why = "scale"
        elif _may_dominate(d, kept):
            d.why = "dominance"
        else:
            continue
        out.append(d)
    return out


def next_batch(chosen: Sequence[Deferred]) -> list[Deferred]:
    """Which programs :func:`to_search` chose to evaluate first.  While exact
    (rectangular) ones remain: the one of the best score, the one of the
    largest value and those that may dominate (evaluating the first two
    settles the rest's score and scale tests).  Then the causal group
    (W, D, device) of the best bound, whose programs share one search."""
    exact = [d for d in chosen if d.exact]
    if not exact:
        group = max(chosen, key=lambda d: d.score).group
        return [d for d in chosen if d.group == group]
    batch = [d for d in exact if d.why == "dominance"]
    for why, key in (("score", "score"), ("scale", "value")):
        some = [d for d in exact if d.why == why]
        if some:
            batch.append(max(some, key=lambda d: getattr(d, key)))
    assert batch, "every chosen program has a reason"
    return batch


def summary(candidates: Sequence[Candidate]) -> tuple[float, float] | None:
    """The best known score and the largest value magnitude of ``candidates``
    (None: no candidate; a score of ``-inf``: none is known)."""
    if not candidates:
        return None
    known = [c.score for c in candidates if not c.unknown]
    return max(known, default=float("-inf")), max(abs(c.value) for c in candidates)


def _may_dominate(d: Deferred, kept: Sequence[Candidate]) -> bool:
    """Whether ``d`` could hold a kept candidate's work on a shape no larger."""
    batch, _, target, _ = d.extents
    for cand in kept:
        if cand.value > d.value:
            continue  # more than it can be worth: not its work
        desc = cand.entry.descriptor
        if desc.proposal_depth != d.depth or desc.device_allocated != d.device:
            continue
        mine = (desc.batch_capacity, desc.token_capacity, desc.target_capacity,
                desc.prompt_capacity)  # fmt: skip
        if mine == d.extents or not all(a >= o for a, o in zip(mine, d.extents)):
            continue
        queries = cand.queries or ()
        if len(cand.lanes) <= min(batch, target) and sum(queries) <= target:
            return True
    return False
