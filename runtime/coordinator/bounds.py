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

The deferred programs of a decision share their lanes' sorted columns per
ceiling group (:class:`TopLists`, built once a decision by
``lanes.LaneTable.top_lists``: one sort per ceiling, whatever the programs),
so each program's bounds cost a lookup and a binary search
(:class:`Pending`); the programs' shapes are read once a catalog
(:class:`Shapes`).  Plain lists, not arrays: an array operation costs a
microsecond or two whatever its size, and a decision of a few dozen programs
is cheaper as a loop than as the hundred array operations it would take
(``docs/scheduler.md``, "Planning time").
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

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
INF = float("inf")


class Columns:
    """One decision's lanes as the bounds read them: the bases sorted
    descending with their prefix sums ``[0, x1, x1 + x2, ...]``, per ceiling
    group the prefix sums of the complete-prefix values sorted descending, and
    per group, on first use (:meth:`gains`), the row gains sorted descending
    with their prefix sums.

    ``lanes``: per lane with a row left, (base, row gains, rows left, gains'
    prefix sums ``[0, g1, g1 + g2, ...]``); group g holds the programs whose
    min(D + 1, W) is ``ceilings[g]``.  ``negative``: some base or gain may be
    negative (then nothing is bounded)."""

    __slots__ = ("_gains", "_lanes", "bases", "ceilings", "count", "fulls", "negative", "top_bases")

    def __init__(
        self, lanes: Sequence[tuple[float, Sequence[float], int, Sequence[float]]],
        ceilings: Sequence[int], negative: bool,
    ) -> None:  # fmt: skip
        self._lanes = lanes
        self.ceilings = ceilings
        self.count = len(lanes)
        self.negative = negative
        self.bases = sorted((lane[0] for lane in lanes), reverse=True)
        self.top_bases = [0.0, *accumulate(self.bases)]
        self.fulls = []
        for top in ceilings:
            fulls = []
            for base, _, left, prefix in lanes:
                rows = top if left >= top else left  # the lane's ceiling on this group
                last = len(prefix)
                fulls.append(base + prefix[(rows if rows < last else last) - 1])
            fulls.sort(reverse=True)
            self.fulls.append([0.0, *accumulate(fulls)])
        self._gains: dict[int, tuple[list[float], list[float]]] = {}

    def gains(self, group: int) -> tuple[list[float], list[float]]:
        """Group ``group``'s row gains sorted descending, and their prefix sums."""
        held = self._gains.get(group)
        if held is None:
            top = self.ceilings[group]
            gains: list[float] = []
            for _, row, left, _ in self._lanes:
                rows = top if left >= top else left
                gains.extend(row[: rows - 1])
            gains.sort(reverse=True)
            held = self._gains[group] = (gains, [0.0, *accumulate(gains)])
        return held


def _best_split(bases: Sequence[float], gains: Sequence[float], target: int, m: int) -> int:
    """The n in 1..m that maximises (the n largest bases) + (the target - n
    largest gains), both sorted descending.  One more lane changes the sum by
    bases[n] less the gain it displaces, gains[target - n - 1] (0 past the
    end): a non-increasing step, so the sum is concave in n and the last n
    whose step in is positive is a maximum."""
    rows = len(gains)
    low, high = 1, m  # the answer lies in [low, high]
    while low < high:
        mid = (low + high) // 2
        k = target - mid - 1
        if bases[mid] - (gains[k] if k < rows else 0.0) > 0.0:
            low = mid + 1
        else:
            high = mid
    return low


def value_bounds(
    bases: Sequence[float], gains: Sequence[float], fulls: Sequence[float],
    programs: Sequence[tuple[int, int]],
) -> list[float]:  # fmt: skip
    """Per causally allocated program (B, P) an upper bound on its best
    cohort's value, the margin included (``-inf``: no lane fits; ``inf``: no
    bound, a negative base or gain), for one width's lanes given as their
    bases, every row gain and their complete-prefix values: what
    :class:`Pending` computes."""
    negative = min(bases, default=0.0) < 0.0 or min(gains, default=0.0) < 0.0
    columns = Columns([(b, [], 1, [0.0]) for b in bases], [1], negative)
    top = sorted(gains, reverse=True)
    columns._gains[0] = (top, [0.0, *accumulate(top)])
    columns.fulls[0] = [0.0, *accumulate(sorted(fulls, reverse=True))]
    return [causal_bound(columns, 0, b, p) for b, p in programs]


def causal_bound(columns: Columns, group: int, batch: int, target: int) -> float:
    """The value bound of a causally allocated program (module docstring)."""
    if columns.negative:
        return INF
    m = min(batch, columns.count, target)
    if m < 1:
        return -INF
    gains, top_gains = columns.gains(group)
    n = _best_split(columns.bases, gains, target, m)
    split = columns.top_bases[n] + top_gains[min(len(gains), target - n)]
    value = min(split, columns.fulls[group][m])
    return value + MARGIN * abs(value)


def score_bound(value: float, t_ms: float, slope: float, size: int, price: float) -> float:
    """An upper bound on the score of a value bound ``value`` run in ``t_ms``
    by a cohort of at most ``size`` lanes (``policy.value_rate``; ``inf``
    without a bound or a time, ``-inf`` where nothing fits)."""
    if value == INF or value == -INF or t_ms <= 0.0:
        return value if value == -INF else INF
    score = value / t_ms + max(slope, slope * size) - 0.5 * t_ms * price
    return score + MARGIN * abs(score)


class Shapes:
    """Programs' shapes, read once a catalog: per program (B, W, P, D,
    device-allocated, exact, search), where exact marks a rectangular host
    program (its bounds are its exact value and score) and search numbers its
    (W, D, device) group (the programs one lane set and one cohort search
    serve)."""

    def __init__(self, descs: Sequence) -> None:
        self.descs = list(descs)
        searches: dict[tuple[int, int, bool], int] = {}
        self.rows = [
            (
                d.batch_capacity, d.token_capacity, d.target_capacity, d.proposal_depth,
                d.device_allocated,
                not d.device_allocated and d.target_capacity >= d.batch_capacity * d.token_capacity,
                searches.setdefault(
                    (d.token_capacity, d.proposal_depth, d.device_allocated), len(searches)
                ),
            )
            for d in self.descs
        ]  # fmt: skip


class Pending:
    """The deferred programs of a decision (positions ``deferred`` of
    ``shapes``, of ceiling groups ``group``, measured ``t_ms``) with their
    value and score bounds, the margin included, until they are evaluated.

    A causally allocated program starts with the cheaper of its two bounds,
    its best min(B, P) lanes at their complete prefixes; only when that cannot
    rule it out is its split bound (the sorted row gains of its group) taken
    too (``_loose``)."""

    def __init__(
        self, shapes: Shapes, deferred: Sequence[int], columns: Columns,
        group: Sequence[int], t_ms: Sequence[float], slope: float, price: float,
        floor: float | None = None,
    ) -> None:  # fmt: skip
        self.shapes = shapes
        self.floor = floor  # a fixed score to beat, and no scale test (an acceptance probe)
        self.columns = columns
        self.group = group
        self.t_ms = t_ms
        self.slope = slope
        self.price = price
        self.value: dict[int, float] = {}
        self.score: dict[int, float] = {}
        self._loose: set[int] = set()
        lanes = columns.count
        if lanes < 1:
            return  # no lane fits: every search finds nothing
        rows, fulls = shapes.rows, columns.fulls
        value = self.value
        score = self.score
        negative = columns.negative
        half = 0.5 * price
        for i in deferred:
            b, _, p, _, _, exact, _ = rows[i]
            m = b if b < lanes else lanes
            if not exact:
                if p < m:
                    m = p
                if m < 1:
                    continue
                if negative:
                    value[i] = score[i] = INF
                    continue
                self._loose.add(i)
            v = fulls[group[i]][m]
            v += MARGIN * abs(v)
            value[i] = v
            t = t_ms[i]
            if t <= 0.0:
                score[i] = INF
                continue
            s = v / t + (slope * m if slope > 0.0 else slope) - half * t
            score[i] = s + MARGIN * abs(s)

    def _tighten(self, i: int) -> None:
        """Program ``i``'s split bound too (a causally allocated program)."""
        self._loose.discard(i)
        b, _, p, _, _, _, _ = self.shapes.rows[i]
        value = min(self.value[i], causal_bound(self.columns, self.group[i], b, p))
        self.value[i] = value
        size = min(b, self.columns.count, p)
        self.score[i] = score_bound(value, self.t_ms[i], self.slope, size, self.price)

    @property
    def left(self) -> bool:
        """Whether a deferred program is still unevaluated."""
        return bool(self.value)

    def next_batch(
        self, kept: Sequence[Candidate], others: tuple[float, float] | None
    ) -> list[int]:
        """The positions to evaluate next, marked evaluated (empty: the bounds
        rule out every program left).  Of the programs :meth:`why` chooses,
        while exact (rectangular) ones remain: the one of the best score, the
        one of the largest value and those that may dominate (evaluating the
        first two settles the rest's score and scale tests); then the causal
        (W, D, device) group of the best bound, whose programs share one search."""
        rows = self.shapes.rows
        # Exact programs first (their bounds are their scores): while one must
        # be evaluated, no causal bound is computed or tightened.
        why = self.why(kept, others, [i for i in self.value if rows[i][5]])
        if why:
            batch = [i for i in why if why[i] == DOMINANCE]
            for code, key in ((SCORE, self.score), (SCALE, self.value)):
                some = [i for i in why if why[i] == code]
                if some:
                    batch.append(max(some, key=key.__getitem__))
        else:
            why = self.why(kept, others, [i for i in self.value if not rows[i][5]])
            if not why:
                return []
            best = max(why, key=self.score.__getitem__)
            search = rows[best][6]
            batch = [i for i in why if rows[i][6] == search]
        for i in batch:
            del self.value[i], self.score[i]
        return batch

    def why(
        self, kept: Sequence[Candidate], others: tuple[float, float] | None,
        positions: Sequence[int] | None = None,
    ) -> dict[int, int]:  # fmt: skip
        """The unevaluated programs (of ``positions``, default all) whose search
        must run, in position order, with why: they might be chosen
        (``SCORE``), set the decision's largest value (``SCALE``), or dominate
        a kept candidate (``DOMINANCE``).  ``kept``: this kind's undominated
        candidates so far; ``others``: the best known score and the largest
        value of the decision's candidates of other kinds (:func:`summary`;
        None: there are none)."""
        if self.floor is not None:  # only candidates above the floor matter
            best, largest = self.floor, INF
        else:
            best, largest = others if others is not None else (-INF, -INF)
            for c in kept:
                if not c.unknown and c.score > best:
                    best = c.score
                largest = max(largest, abs(c.value))
        positions = sorted(self.value if positions is None else positions)
        if best == -INF:  # no known score to beat: any may win
            return dict.fromkeys(positions, SCORE)
        best -= MARGIN * abs(best)
        scale = largest * (1.0 + SCALE_SLACK) * (1.0 + MARGIN)  # values carry the margin
        works = _works(kept)
        out: dict[int, int] = {}
        for i in positions:
            code = self._why(i, best, scale, works)
            if code and i in self._loose:
                self._tighten(i)
                code = self._why(i, best, scale, works)
            if code:
                out[i] = code
        return out

    def _why(self, i: int, best: float, scale: float, works: list[tuple]) -> int:
        if self.score[i] >= best:
            return SCORE
        value = self.value[i]
        if value > scale:
            return SCALE
        if works and self._may_dominate(i, value, works):
            return DOMINANCE
        return 0

    def _may_dominate(self, i: int, value: float, works: list[tuple]) -> bool:
        """Whether program ``i`` (its value bound ``value``) could hold a kept
        candidate's work (:func:`_works`) on a shape no larger in every
        capacity (and not the same shape): the same depth and allocation, a
        value bound at least the candidate's, room for its cohort and its rows."""
        batch, width, target, depth, device, _, _ = self.shapes.rows[i]
        for held, d, dev, b, w, p, same, lanes, rows in works:
            if held > value or d != depth or dev != device:
                continue  # more than it can be worth, or not its depth or allocation
            if b < batch or w < width or p < target:
                continue  # program i is larger in some capacity: it cannot dominate
            if same and b == batch and w == width and p == target:
                continue  # the same shape
            if lanes <= min(batch, target) and rows <= target:
                return True
        return False


def _works(kept: Sequence[Candidate]) -> list[tuple]:
    """What the dominance test reads of each kept candidate: its value, depth,
    allocation, B, W, P, whether it may be a speculative shape (no prompt
    capacity), its lanes and its rows."""
    out = []
    for cand in kept:
        desc = cand.entry.descriptor
        out.append((
            cand.value, desc.proposal_depth, desc.device_allocated, desc.batch_capacity,
            desc.token_capacity, desc.target_capacity, desc.prompt_capacity == 0,
            len(cand.lanes), sum(cand.queries or ()),
        ))  # fmt: skip
    return out


def summary(candidates: Sequence[Candidate]) -> tuple[float, float] | None:
    """The best known score and the largest value magnitude of ``candidates``
    (None: no candidate; a score of ``-inf``: none is known)."""
    if not candidates:
        return None
    known = [c.score for c in candidates if not c.unknown]
    return max(known, default=float("-inf")), max(abs(c.value) for c in candidates)
