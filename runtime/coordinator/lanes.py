"""The decoders of one decision as round lanes: each request's ceiling on a
program of width W and depth D, the scored value of each further row
(``s_i**alpha * (beta + f/x)``), and the lanes per (W, D, value source), read
once per decision (:mod:`runtime.coordinator.rounds` prices programs with
them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from runtime.coordinator.bounds import Tops, tops_of
from runtime.coordinator.causal import CausalSearch
from runtime.coordinator.policy import LaneView, SelectionContext

SurvivalFn = Callable[[LaneView, int], Sequence[float]]


def ceiling(lane: LaneView, width: int, depth: int) -> int:
    """The most target rows ``lane`` can use: min(D + 1, W, output left after
    what queued frames may still add, the rows its KV pages hold)."""
    r = lane.request
    left = min(r.remaining_output - r.inflight_output, lane.room)
    return max(0, min(depth + 1, width, left))


def row_gains(lane: LaneView, survival: Sequence[float], alpha: float, beta: float) -> list[float]:
    """The scored value each further row adds: s_i**alpha * (beta + f/x), i = 1.."""
    price = beta + lane.token_price
    return [(s**alpha if s > 0 else 0.0) * price for s in survival]


def complete_prefix_value(
    lane: LaneView, desc, survival: SurvivalFn, alpha: float, beta: float
) -> float:
    """``lane``'s value on round program ``desc`` at its complete prefix (its
    ceiling): what a restore's following round program is scored with."""
    limit = ceiling(lane, desc.token_capacity, desc.proposal_depth)
    if limit <= 1:
        return lane.decode_value
    gains = row_gains(lane, survival(lane, limit - 1), alpha, beta)
    return lane.decode_value + sum(gains[: limit - 1])


class Lane:
    """A decoder with its ceiling, the scored value of each extra row, and the
    key the allocation ranks its next row by (the gains, or the forecast joint
    prefix probabilities of a device-allocated program)."""

    __slots__ = ("base", "full", "gains", "limit", "order", "prefix", "view")

    def __init__(
        self,
        view: LaneView,
        limit: int,
        gains: Sequence[float],
        order: Sequence[float] | None = None,
        prefix: Sequence[float] | None = None,
    ) -> None:
        self.view = view
        self.limit = limit
        self.gains = gains
        self.order = gains if order is None else order
        self.base = base = view.decode_value  # one token, one delivery, the age value
        if prefix is None:
            prefix = [0.0]
            for g in gains:
                prefix.append(prefix[-1] + g)
        self.prefix = prefix  # prefix[k]: the value rows 2..k+1 add (k < limit read)
        self.full = base + prefix[min(limit, len(prefix)) - 1]  # at its complete prefix

    def value(self, rows: int) -> float:
        return self.base + self.prefix[min(rows, self.limit, len(self.prefix)) - 1]

    def slot(self) -> int:
        return self.view.request.slot


class LaneTable:
    """The decoders of one decision with their survival read once at the deepest
    depth any program offers (``survival`` and ``forecast`` are called once per
    request per decision, not per program), and their lanes per (W, D, value
    source), built once."""

    def __init__(
        self,
        ctx: SelectionContext,
        survival: SurvivalFn,
        alpha: float,
        depth: int,
        forecast: SurvivalFn | None,
    ) -> None:
        self.views = ctx.decode
        self.gains: list[list[float]] = []
        self.prefix: list[list[float]] = []
        # Per decoder the rows its output limit and KV pages leave (``ceiling``).
        self.left = [
            min(v.request.remaining_output - v.request.inflight_output, v.room) for v in self.views
        ]
        for view in self.views:
            gains = row_gains(view, survival(view, depth), alpha, ctx.beta) if depth > 0 else []
            prefix = [0.0]
            for g in gains:
                prefix.append(prefix[-1] + g)
            self.gains.append(gains)
            self.prefix.append(prefix)
        self._forecast = forecast
        self._depth = depth
        self._orders: list[Sequence[float]] | None = None
        self._lanes: dict[tuple[int, int, bool], list[Lane]] = {}
        self._causal: dict[tuple[int, int, bool], CausalSearch] = {}
        self._tops: dict[tuple[int, ...], Tops] = {}

    def lanes(self, width: int, depth: int, device: bool) -> list[Lane]:
        key = (width, depth, device)
        held = self._lanes.get(key)
        if held is None:
            orders = self._orders_for() if device else None
            held = []
            top = min(depth + 1, width)
            for i, (view, left) in enumerate(zip(self.views, self.left)):
                limit = top if left >= top else left  # ceiling(view, width, depth)
                if limit < 1:
                    continue
                order = None if orders is None else orders[i]
                held.append(Lane(view, limit, self.gains[i][: limit - 1], order, self.prefix[i]))
            self._lanes[key] = held
        return held

    def tops(self, ceilings: Sequence[int]) -> Tops:
        """The lanes' sorted prefix sums (:class:`bounds.Tops`) per ceiling group:
        group g holds the lanes of programs whose min(D + 1, W) is ``ceilings[g]``."""
        key = tuple(ceilings)
        held = self._tops.get(key)
        if held is None:
            left, gains = self.left, self.gains
            if min(left, default=1) < 1:  # a lane without a row left has no place
                included = [i for i, x in enumerate(left) if x >= 1]
                left, gains = [left[i] for i in included], [gains[i] for i in included]
                views: Sequence[LaneView] = [self.views[i] for i in included]
            else:
                views = self.views
            bases = np.array([v.decode_value for v in views], dtype=float)
            depth = max(0, self._depth)
            matrix = _gain_matrix(gains, depth)  # (lanes, depth), zero past a lane's own
            prefix = np.zeros((len(views), depth + 1))
            np.cumsum(matrix, axis=1, out=prefix[:, 1:])  # the sums Lane.prefix holds
            have = np.array([len(g) for g in gains], dtype=np.int64)
            top = np.array(ceilings, dtype=np.int64)
            # rows[g, i]: the rows 2.. lane i can get under ceiling group g.
            rows = np.minimum(
                np.minimum(np.array(left, dtype=np.int64)[None, :], top[:, None]) - 1,
                have[None, :],
            )
            fulls = bases[None, :] + prefix[np.arange(len(views))[None, :], rows]
            masked = np.where(
                np.arange(depth)[None, None, :] < rows[:, :, None], matrix[None, :, :], 0.0
            ).reshape(len(ceilings), len(views) * depth)
            negative = bool(
                (bases.size and bases.min() < 0.0) or (matrix.size and matrix.min() < 0.0)
            )
            held = self._tops[key] = tops_of(bases, masked, fulls, negative)
        return held

    def causal(
        self, width: int, depth: int, device: bool, programs: Sequence[tuple[int, int]]
    ) -> CausalSearch:
        """The cohort search of (W, D, device), one per decision, with the causally
        allocated ``programs`` (B, P) answered (together, those not answered yet)."""
        key = (width, depth, device)
        held = self._causal.get(key)
        if held is None:
            lanes = self.lanes(width, depth, device)
            held = self._causal[key] = CausalSearch(lanes, ORDERINGS)
        held.solve(programs)
        return held

    def _orders_for(self) -> list[Sequence[float]]:
        if self._orders is None:
            forecast = self._forecast
            assert forecast is not None
            self._orders = [forecast(view, self._depth) for view in self.views]
        return self._orders


# The spec's three bounded orderings of a causally allocated program's cohort
# prefixes, each a sort key (ties: the less recently served, then the slot).
ORDERINGS = (
    lambda x: (-x.full, x.view.lru, x.slot()),  # total lane value
    lambda x: (-x.view.delivery_price, x.view.lru, x.slot()),  # pending-token delivery value
    lambda x: (-x.full / x.limit, x.view.lru, x.slot()),  # value per target row
)


def _gain_matrix(gains: Sequence[Sequence[float]], depth: int) -> np.ndarray:
    """Every decoder's row gains as one row of ``depth`` columns (zero past its own)."""
    if all(len(g) == depth for g in gains):
        return np.array(gains, dtype=float).reshape(len(gains), depth)
    out = np.zeros((len(gains), depth))
    for i, g in enumerate(gains):
        out[i, : len(g)] = g
    return out
