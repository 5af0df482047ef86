"""The cohort search of causally allocated rounds: ragged host programs and
device-allocated ones (spec, "Adaptive ragged selection evaluates cohort
prefixes under three bounded orderings [...] Each cohort is priced using its
resulting causal prefix allocation").

A program of batch B and aggregate target rows P gives each lane of a cohort
its pending row, then its remaining P - n rows one at a time to the best
immediate frontier (``rounds`` module docstring).  Every lane's row keys are
non-increasing in depth (the means are clamped non-increasing), so that
frontier process takes rows in one global order, by (key descending, depth
ascending, slot ascending): a lane's deeper row always sorts after its
shallower one.  The allocation of a cohort is therefore the first P - n of
its rows in that order.  That order depends on the lanes and the width
(W, D), not on B, P, the ordering or the prefix: one sort per width serves
every program of that width and every cohort.

:class:`CausalSearch` holds, per ordering, the rank of every lane and, for
every prefix n at once, the count and the value of the cohort's rows along
the global order (cumulative sums over an n x rows matrix).  A program's
candidate prefixes then cost one ``searchsorted``: the value of prefix n is
the cohort's pending values plus its rows up to the (P - n)-th.

Exactness.  The reference (the frontier heap and a left-to-right sum over
the cohort, first strictly greater value kept in (ordering, prefix) order)
decides between values that differ by a rounding error, and the sums here
add the same terms in another order.  So the prefixes whose value lies
within a relative 1e-11 of the best (far above any rounding error of these
sums, far below any real difference) are evaluated again exactly as the
reference does, and the first strictly greater of those in the reference's
order wins.  ``tests/coordinator/test_selection_reference.py`` holds this to
the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Candidate prefixes this close to the best approximate value (relative) are
# evaluated exactly: far above the sums' rounding, far below real differences.
NEAR = 1e-11

Lane = Any  # lanes.Lane: limit, order, gains, base, value(rows), slot(), view


class _Ordering:
    """One ordering's ranked lanes and its per-prefix row counts and values."""

    __slots__ = ("base", "flat", "rank", "ranked", "values")

    def __init__(
        self, lanes: Sequence[Lane], ranked: list[int], rows: np.ndarray, gains: np.ndarray
    ) -> None:
        self.ranked = ranked
        rank = np.empty(len(lanes), dtype=np.int64)
        rank[ranked] = np.arange(len(lanes))
        self.rank = rank
        self.base = np.cumsum([0.0] + [lanes[i].base for i in ranked])
        # members[n - 1, t]: row t (global order) belongs to the cohort of n lanes.
        position = rank[rows]
        members = position[None, :] < np.arange(1, len(lanes) + 1)[:, None]
        counts = np.cumsum(members, axis=1)  # non-decreasing along each row, <= rows
        # Every prefix's counts in one sorted array: row n - 1 shifted by (n - 1)(rows + 1).
        shift = np.arange(len(lanes))[:, None] * (len(rows) + 1)
        self.flat = (counts + shift).ravel()
        self.values = np.cumsum(np.where(members, gains[None, :], 0.0), axis=1)


class CausalSearch:
    """The cohort search of the causally allocated programs of one width: the
    lanes' global row order and the orderings' prefix sums are built once;
    :meth:`solve` answers programs (batch, target rows) together, each once
    (a program's answer depends only on its own prefixes)."""

    def __init__(
        self,
        lanes: Sequence[Lane],
        orderings: Sequence[Callable[[Lane], tuple]],
    ) -> None:
        self.lanes = lanes
        keys = []
        for i, lane in enumerate(lanes):
            order, slot = lane.order, lane.slot()
            for j in range(min(lane.limit - 1, len(order))):
                if order[j] <= 0.0:
                    break  # a certain rejection, and every deeper row too
                keys.append((-order[j], j + 1, slot, i))
        keys.sort()
        self.rows = np.array([k[3] for k in keys], dtype=np.int64)  # each row's lane
        self.gains = np.array([lanes[k[3]].gains[k[1] - 1] for k in keys], dtype=np.float64)
        self._keys = orderings
        self._ordered: list[_Ordering] | None = None
        self._results: dict[tuple[int, int], tuple[float, list[Lane], list[int]] | None] = {}

    def solve(self, programs: Sequence[tuple[int, int]]) -> None:
        """Answer the ``programs`` (batch, target rows) not answered yet, together."""
        results = self._results
        fresh = [program for program in dict.fromkeys(programs) if program not in results]
        if fresh:
            self._solve(fresh)

    def best(self, batch: int, target: int) -> tuple[float, list[Lane], list[int]] | None:
        """The reference's choice for a program of ``batch`` lanes and ``target``
        rows: (value, cohort, query lengths), or None when no lane fits."""
        if (batch, target) not in self._results:
            self._solve([(batch, target)])
        return self._results[(batch, target)]

    def _orderings(self) -> list[_Ordering]:
        """The distinct orderings, in the reference's order: one that ranks the
        lanes as an earlier one does offers the same values, never greater."""
        if self._ordered is not None:
            return self._ordered
        out: list[_Ordering] = []
        self._ordered = out
        lanes = self.lanes
        for key in self._keys:
            ranked = sorted(range(len(lanes)), key=lambda i: key(lanes[i]))
            if any(o.ranked == ranked for o in out):
                continue
            out.append(_Ordering(lanes, ranked, self.rows, self.gains))
        return out

    def _solve(self, programs: list[tuple[int, int]]) -> None:
        n_lanes = len(self.lanes)
        tops = [min(b, n_lanes, p) for b, p in programs]
        for program, top in zip(programs, tops):
            if top < 1:
                self._results[program] = None
        live = [(program, top) for program, top in zip(programs, tops) if top >= 1]
        if not live:
            return
        sizes = np.concatenate([np.arange(1, top + 1) for _, top in live])
        want = np.concatenate([p - np.arange(1, top + 1) for (_, p), top in live])
        starts = np.cumsum([0] + [top for _, top in live])[:-1]
        owner = np.repeat(np.arange(len(live)), [top for _, top in live])
        orderings = self._orderings()
        approx = np.stack([o.base[sizes] + self._rows_value(o, sizes, want) for o in orderings])
        most = np.maximum.reduceat(approx.max(axis=0), starts)
        floor = (most - NEAR * np.abs(most))[owner]
        which, column = np.nonzero(approx >= floor[None, :])
        # The reference's order within a program: ordering, then prefix.
        order = np.lexsort((column, which, owner[column]))
        best: dict[int, tuple[float, list[Lane], list[int]]] = {}
        seen: set[tuple] = set()  # (program, cohort in order): the same value again
        for o_index, col in zip(which[order].tolist(), column[order].tolist()):
            j = int(owner[col])
            size = int(sizes[col])
            o = orderings[o_index]
            key = (j, *o.ranked[:size])
            if key in seen:
                continue  # an earlier ordering's prefix, lane for lane: never greater
            seen.add(key)
            cohort, queries, value = self._exact(o, size, live[j][0][1])
            held = best.get(j)
            if held is None or value > held[0]:
                best[j] = (value, cohort, queries)
        for j, (program, _) in enumerate(live):
            self._results[program] = best[j]

    def _rows_value(self, o: _Ordering, n: np.ndarray, want: np.ndarray) -> np.ndarray:
        """Per prefix n, the value of its first ``want`` rows in the global order."""
        m = len(self.rows)
        if not m:
            return np.zeros(len(n))
        # The first row of prefix n's counts that reaches ``want`` (the want-th
        # cohort row); past its last row when it has fewer: then all of them.
        where = np.searchsorted(o.flat, want + (n - 1) * (m + 1), side="left")
        col = np.minimum(where - (n - 1) * m, m - 1)
        return np.where(want > 0, o.values[n - 1, col], 0.0)

    def _exact(self, o: _Ordering, size: int, target: int):
        """The cohort of ``size`` lanes, its allocation and its value, as the
        reference computes them."""
        members = o.rank[self.rows] < size
        taken = members & (np.cumsum(members) <= target - size)
        extra = np.bincount(self.rows[taken], minlength=len(self.lanes))
        cohort = [self.lanes[i] for i in o.ranked[:size]]
        queries = [1 + int(extra[i]) for i in o.ranked[:size]]
        value = sum(x.value(q) for x, q in zip(cohort, queries))
        return cohort, queries, value
