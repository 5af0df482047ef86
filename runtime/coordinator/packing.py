"""Packed prefill programs: up to B prompt rows share one program's C prompt
tokens (a prefill descriptor of batch capacity B > 1; issue 26).

Each row takes a chunk of its own, from its position up to its next hard
boundary (``LaneView.available``: a boundary, the prompt's end, or what its
pages hold), never across it, as a single prefill does.  A row given ``t``
tokens is worth :func:`~runtime.coordinator.policy.prompt_lane_value`: the
uncached tokens at its price 1 + f/x, restored history at its continuation
index, and the first output token where the chunk finishes the prompt.  The
program is priced like any other: the cohort's value over its measured time,
less the active decoders' age cost (no decoder rides along).

The spec gives no prefill batch capacity (B = 1 was this project's choice);
selection follows its rule for constrained ragged graphs: the highest-value
cohort that fits both B and the token capacity C.  That is a knapsack with a
cardinality bound, and a finishing chunk's first output makes a row's value
jump at its full chunk, so it is not searched exactly.  The search, without
enumerating subsets:

* the rows are ranked under three orderings: value of the row's whole chunk
  (total row value), that value per token (value per target row), and the
  price of one more of its tokens (1 + f/x, what a partial chunk earns); a
  chunk longer than C is ranked by what C holds of it; ties go to the less
  recently served, then the lower request id;
* per ordering the cohort is its longest prefix that fits: rows take their
  whole chunks in order while they fit C and B, and the next row, when a row
  of B is left, takes the tokens left over (at least one) as a partial chunk;
  prefix sums of chunk sizes and values price it in one binary search;
* the best of the three, the first strictly greater in that order.

What that guarantees (``docs/scheduler.md``, "Packed prefill programs", has
the proofs; ``tests/coordinator/test_packing.py`` checks them against brute
force over every cohort and chunk split):

* exact when the whole chunks of the B most valuable rows fit C (the value
  ordering takes them all; values are additive and non-decreasing in tokens),
  and so for B = 1;
* within one first-output value (the largest finishing bonus) of the best
  when there are at most B rows and none is restoring history (the
  value-per-token ordering fills like the greedy fractional knapsack, which
  bounds every cohort, and loses only its one partial row's bonus).

Dominance (spec: same work on a shape at least as large in every capacity
is dropped): a packed cohort of one row is left to the single prefill
programs when one of capacity in [chunk, C] exists, and packed candidates
with the same rows and chunks keep only their smallest shapes.  Exploration:
an unmeasured packed program is skipped when a smaller capacity of the same
batch already holds what its B rows could consume up to their next message
or prompt endpoints.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate

from runtime.catalog import GraphKind
from runtime.coordinator.policy import Candidate, LaneView, SelectionContext, prompt_lane_value


class PromptRows:
    """One decision's prompt rows: each row's whole chunk (size and value) and
    per-token price, and per capacity the orderings of the rows with the
    prefix sums of their chunk sizes and values (a row whose chunk exceeds the
    capacity is ranked by what the capacity holds of it)."""

    __slots__ = ("_orders", "beta", "lanes", "price", "sizes", "ties", "values")

    def __init__(self, lanes: list[LaneView], beta: float) -> None:
        self.lanes = lanes
        self.beta = beta
        self.sizes = [v.available for v in lanes]
        self.values = [prompt_lane_value(v, v.available, beta) for v in lanes]
        self.price = [1.0 + v.token_price for v in lanes]
        self.ties = [(v.lru, v.request.handle.id) for v in lanes]
        self._orders: dict[int, list[tuple[list[int], list[int], list[float]]]] = {}

    def orders(self, capacity: int) -> list[tuple[list[int], list[int], list[float]]]:
        """The distinct orderings for ``capacity`` tokens, each with the prefix
        sums of its rows' whole chunk sizes and values (module docstring)."""
        sizes = self.sizes
        key = capacity if max(sizes) > capacity else 0  # 0: no chunk is capped
        held = self._orders.get(key)
        if held is not None:
            return held
        values = list(self.values)
        for i, size in enumerate(sizes):
            if size > capacity:  # ranked by what the capacity holds of it
                values[i] = prompt_lane_value(self.lanes[i], capacity, self.beta)
        fit = [min(size, capacity) for size in sizes]
        ties, price = self.ties, self.price
        keys = (
            lambda i: (-values[i], ties[i]),  # total row value
            lambda i: (-values[i] / fit[i], ties[i]),  # value per token
            lambda i: (-price[i], ties[i]),  # the price of one more token
        )
        held = []
        for rank in keys:
            order = sorted(range(len(sizes)), key=rank)
            if any(order == o for o, _, _ in held):
                continue  # the same cohorts as an earlier ordering: never greater
            held.append((
                order,
                [0, *accumulate(sizes[i] for i in order)],
                [0.0, *accumulate(self.values[i] for i in order)],
            ))  # fmt: skip
        self._orders[key] = held
        return held

    def best(self, batch: int, capacity: int) -> tuple[float, list[int], list[int]]:
        """(value, rows, chunks) of the search's cohort for a program of ``batch``
        rows and ``capacity`` tokens (module docstring); rows in cohort order."""
        best: tuple[float, list[int], list[int]] | None = None
        for order, sizes, values in self.orders(capacity):
            top = min(batch, len(order))
            whole = min(top, bisect_right(sizes, capacity) - 1)  # rows taking whole chunks
            rows = order[:whole]
            chunks = [self.sizes[i] for i in rows]
            value = values[whole]
            left = capacity - sizes[whole]
            if whole < top and left > 0:  # the next row takes what is left over
                i = order[whole]
                rows = [*rows, i]
                chunks.append(left)
                value += prompt_lane_value(self.lanes[i], left, self.beta)
            if best is None or value > best[0]:
                best = (value, rows, chunks)
        assert best is not None and best[1]  # every row has a token available
        return best


def packed_prefill_candidates(ctx: SelectionContext, out: list[Candidate]) -> None:
    """One candidate per packed prefill program (batch > 1) whose cohort is not
    left to a smaller shape (module docstring)."""
    entries = ctx.catalog.entries(GraphKind.PREFILL)
    if not ctx.prefill or not any(e.descriptor.batch_capacity > 1 for e in entries):
        return
    beta = ctx.beta
    rows = PromptRows(ctx.prefill, beta)
    singles = sorted(
        d.prompt_capacity for d in (e.descriptor for e in entries) if d.batch_capacity == 1
    )
    reach = sorted((v.to_endpoint for v in ctx.prefill), reverse=True)
    ladders: dict[int, list[int]] = {}  # batch -> its capacities, ascending
    for e in entries:
        ladders.setdefault(e.descriptor.batch_capacity, []).append(e.descriptor.prompt_capacity)
    found: list[tuple[tuple, Candidate]] = []
    for index, entry in enumerate(entries):
        desc = entry.descriptor
        b, c = desc.batch_capacity, desc.prompt_capacity
        if b == 1:
            continue
        if not entry.known:
            ladder = ladders[b]
            k = bisect_left(ladder, c)
            if k and ladder[k - 1] >= sum(reach[:b]):
                continue  # exploration: a smaller capacity of this batch holds it all
        value, cohort, chunks = rows.best(b, c)
        if len(cohort) == 1:
            k = bisect_right(singles, c)
            if k and singles[k - 1] >= chunks[0]:
                continue  # a single prefill of capacity in [chunk, C] does this work
        views = [rows.lanes[i] for i in cohort]
        tokens = sum(chunks)
        cand = Candidate(
            entry, index, views, value, 0.0, (c - tokens) + (b - len(views)),
            max(v.lru for v in views), tokens, ctx,
        )  # fmt: skip
        cand.chunks = chunks
        found.append(((tuple(v.request.handle.id for v in views), tuple(chunks)), cand))
    out.extend(_smallest_shapes(found))


def _smallest_shapes(found: list[tuple[tuple, Candidate]]) -> list[Candidate]:
    """Drop a candidate when another with the same rows and chunks runs on a
    shape no larger in batch and capacity (and not the same shape)."""
    shapes: dict[tuple, list[tuple[int, int]]] = {}
    for key, cand in found:
        desc = cand.entry.descriptor
        shapes.setdefault(key, []).append((desc.batch_capacity, desc.prompt_capacity))
    kept = []
    for key, cand in found:
        desc = cand.entry.descriptor
        mine = (desc.batch_capacity, desc.prompt_capacity)
        if not any(o != mine and o[0] <= mine[0] and o[1] <= mine[1] for o in shapes[key]):
            kept.append(cand)
    return kept
