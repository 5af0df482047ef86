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

Scored prefill (SCORED_PREFILL, docs/scored-prefill.md) is packed the same
way over its own programs and rows: the scored requests' prompt rows
(:meth:`~runtime.coordinator.policy.SelectionContext.prompt_rows`), valued
exactly as unscored ones.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate

from runtime.catalog import GraphKind
from runtime.coordinator.policy import (
    Candidate,
    LaneView,
    SelectionContext,
    fit_tokens,
    prompt_lane_value,
)


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
        fit = [min(size, capacity) for size in sizes]
        usable: range | list[int] = range(len(sizes))
        for i, size in enumerate(sizes):
            if size > capacity:  # ranked by what the capacity holds of it
                fit[i] = fit_tokens(self.lanes[i], capacity)  # (image spans atomic)
                values[i] = prompt_lane_value(self.lanes[i], fit[i], self.beta)
        if not all(fit):  # an image span at its position longer than the capacity
            usable = [i for i in usable if fit[i]]
        ties, price = self.ties, self.price
        if not usable:
            self._orders[key] = []
            return []
        keys = (
            lambda i: (-values[i], ties[i]),  # total row value
            lambda i: (-values[i] / fit[i], ties[i]),  # value per token
            lambda i: (-price[i], ties[i]),  # the price of one more token
        )
        held = []
        for rank in keys:
            order = sorted(usable, key=rank)
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
        best_value = -1.0
        best: tuple | None = None
        for order, sizes, values in self.orders(capacity):
            top = batch if batch < len(order) else len(order)
            whole = bisect_right(sizes, capacity) - 1  # rows taking whole chunks
            if whole > top:
                whole = top
            value = values[whole]
            left = capacity - sizes[whole]
            if whole < top and left > 0:  # (a partial chunk splits no image span)
                left = fit_tokens(self.lanes[order[whole]], left)
            partial = whole < top and left > 0  # the next row takes what is left over
            if partial:
                value += prompt_lane_value(self.lanes[order[whole]], left, self.beta)
            if best is None or value > best_value:
                best_value, best = value, (order, whole, left if partial else 0)
        if best is None:  # no row takes a token at this capacity (image spans)
            return 0.0, [], []
        order, whole, left = best
        rows = order[: whole + 1] if left else order[:whole]
        chunks = [self.sizes[i] for i in order[:whole]]
        if left:
            chunks.append(left)
        assert rows  # every row has a token available
        return best_value, rows, chunks


class _Layout:
    """A catalog's packed prefill programs (index, entry, B, C), the single
    prefill capacities, and each batch's capacities ascending (for good: the
    shapes do not change)."""

    def __init__(self, catalog, kind: GraphKind = GraphKind.PREFILL) -> None:
        entries = catalog.entries(kind)
        self.packed = [
            (index, entry, entry.descriptor.batch_capacity, entry.descriptor.prompt_capacity)
            for index, entry in enumerate(entries)
            if entry.descriptor.batch_capacity > 1
        ]
        self.singles = sorted(
            e.descriptor.prompt_capacity for e in entries if e.descriptor.batch_capacity == 1
        )
        self.ladders: dict[int, list[int]] = {}
        for _, _, b, c in self.packed:
            self.ladders.setdefault(b, []).append(c)
        for ladder in self.ladders.values():
            ladder.sort()


def packed_prefill_candidates(
    ctx: SelectionContext, out: list[Candidate], kind: GraphKind = GraphKind.PREFILL
) -> None:
    """One candidate per packed prefill program (batch > 1) of ``kind`` (PREFILL
    or SCORED_PREFILL, over the rows that kind serves) whose cohort is not left
    to a smaller shape (module docstring); shapes doing the same work are
    dropped before any candidate is built."""
    prompt_rows = ctx.prompt_rows(kind)
    if not prompt_rows:
        return
    layout = ctx.catalog.derived(
        f"packed-{kind.value}", lambda: _Layout(ctx.catalog, kind), per_version=False
    )
    if not layout.packed:
        return
    rows = PromptRows(prompt_rows, ctx.beta)
    singles = layout.singles
    reach = sorted((v.to_endpoint for v in prompt_rows), reverse=True)
    # (rows, chunks) -> the smallest batch seen doing that work.  Programs come in
    # catalog order (capacity, then batch), so an earlier program of the same work
    # has no larger a capacity: it dominates a later one of no smaller a batch.
    smallest: dict[tuple, int] = {}
    kept: list[Candidate] = []
    lanes = rows.lanes
    for index, entry, b, c in layout.packed:
        if not entry.known:
            ladder = layout.ladders[b]
            k = bisect_left(ladder, c)
            if k and ladder[k - 1] >= sum(reach[:b]):
                continue  # exploration: a smaller capacity of this batch holds it all
        value, cohort, chunks = rows.best(b, c)
        if not cohort:
            continue  # (only image spans longer than C stand at the rows' positions)
        if len(cohort) == 1:
            k = bisect_right(singles, c)
            if k and singles[k - 1] >= chunks[0]:
                continue  # a single prefill of capacity in [chunk, C] does this work
        key = (tuple(cohort), tuple(chunks))
        held = smallest.get(key)
        if held is not None and held <= b:
            continue  # the same rows and chunks on a shape no larger: dominated
        smallest[key] = b if held is None else min(held, b)
        views = [lanes[i] for i in cohort]
        tokens = sum(chunks)
        cand = Candidate(
            entry, index, views, value, 0.0, (c - tokens) + (b - len(views)),
            max(v.lru for v in views), tokens, ctx,
        )  # fmt: skip
        cand.chunks = chunks
        kept.append(cand)
    out.extend(kept)  # (a later program never dominates a kept one: its capacity is larger)
