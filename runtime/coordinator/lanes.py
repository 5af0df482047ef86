"""The decoders of one decision as round lanes: each request's ceiling on a
program of width W and depth D, the scored value of each further row
(``s_i**alpha * (beta + f/x)``), and the lanes per (W, D, value source), read
once per decision (:mod:`runtime.coordinator.rounds` prices programs with
them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

from runtime.coordinator.bounds import Columns
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
        self.beta = ctx.beta
        self.gains: list[list[float]] = []
        self.prefix: list[list[float]] = []
        # Per decoder the rows its output limit and KV pages leave (``ceiling``).
        self.left = [
            min(v.request.remaining_output - v.request.inflight_output, v.room) for v in self.views
        ]
        if depth > 0:
            beta = ctx.beta
            for view in self.views:
                price = beta + view.token_price
                if alpha == 1.0:  # s**1.0 is s: row_gains without the power
                    gains = [(s if s > 0 else 0.0) * price for s in survival(view, depth)]
                else:
                    gains = [(s**alpha if s > 0 else 0.0) * price for s in survival(view, depth)]
                self.gains.append(gains)
                self.prefix.append([0.0, *accumulate(gains)])
        else:
            self.gains = [[] for _ in self.views]
            self.prefix = [[0.0] for _ in self.views]
        self.count = sum(1 for left in self.left if left >= 1)  # lanes with a row left
        self._ranked: dict[tuple[int, int], list[tuple]] = {}
        self._forecast = forecast
        self._depth = depth
        self._orders: list[Sequence[float]] | None = None
        self._lanes: dict[tuple[int, int, bool], list[Lane]] = {}
        self._causal: dict[tuple[int, int, bool], CausalSearch] = {}

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

    def ranked(self, width: int, depth: int) -> list[tuple]:
        """The lanes of host programs of (W, D) by value at their complete
        prefixes, best first (ties: the less recently served, then the request):
        ``(-value, lru, request id, ceiling, view)``, what a :class:`Lane`'s
        ``full`` and ``limit`` would be, without building lanes."""
        key = (width, depth)
        held = self._ranked.get(key)
        if held is None:
            top = min(depth + 1, width)
            held = []
            for view, left, prefix in zip(self.views, self.left, self.prefix):
                limit = top if left >= top else left  # ceiling(view, width, depth)
                if limit < 1:
                    continue
                last = len(prefix)
                full = view.decode_value + prefix[(limit if limit < last else last) - 1]
                held.append((-full, view.lru, view.request.handle.id, limit, view))
            held.sort(key=_rank_key)
            self._ranked[key] = held
        return held

    def columns(self, ceilings: Sequence[int]) -> Columns:
        """The lanes as the bounds read them, per ceiling group (group g holds
        the programs whose min(D + 1, W) is ``ceilings[g]``): :class:`bounds.Columns`."""
        lanes = [
            (view.decode_value, row, left, prefix)
            for view, left, row, prefix in zip(self.views, self.left, self.gains, self.prefix)
            if left >= 1
        ]
        # A gain is s**alpha * (beta + f/x) with s >= 0: negative only at a negative price.
        negative = bool(lanes) and (
            min(lane[0] for lane in lanes) < 0.0
            or self.beta + min(view.token_price for view in self.views) < 0.0
        )
        return Columns(lanes, ceilings, negative)

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


def _rank_key(row: tuple) -> tuple:
    return row[:3]


# The spec's three bounded orderings of a causally allocated program's cohort
# prefixes, each a sort key (ties: the less recently served, then the slot).
ORDERINGS = (
    lambda x: (-x.full, x.view.lru, x.slot()),  # total lane value
    lambda x: (-x.view.delivery_price, x.view.lru, x.slot()),  # pending-token delivery value
    lambda x: (-x.full / x.limit, x.view.lru, x.slot()),  # value per target row
)
