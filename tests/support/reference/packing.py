"""Packed prefill selection as the reference states it (see ``__init__``):
every program, every ordering, the rows added one at a time while they fit,
each cohort summed from scratch.  ``runtime.coordinator.packing`` is the fast
path held to it."""

from __future__ import annotations

from runtime.catalog import GraphKind
from tests.support.reference.policy import Candidate, SelectionContext, prompt_lane_value


def _chunk_value(view, tokens: int, beta: float) -> float:
    return prompt_lane_value(view, tokens, beta)


def _orderings(rows, capacity: int, beta: float) -> list[list]:
    """Total row value, value per token, price of one more token (chunks longer
    than ``capacity`` ranked by what it holds); ties: lru, then request id."""

    def held(v):
        return min(v.available, capacity)

    def value(v):
        return _chunk_value(v, held(v), beta)

    def tie(v):
        return (v.lru, v.request.handle.id)

    keys = (
        lambda v: (-value(v), tie(v)),
        lambda v: (-value(v) / held(v), tie(v)),
        lambda v: (-(1.0 + v.token_price), tie(v)),
    )
    out: list[list] = []
    for key in keys:
        order = sorted(rows, key=key)
        if all(o != order for o in out):
            out.append(order)
    return out


def _fill(order, batch: int, capacity: int, beta: float):
    """The ordering's longest prefix that fits: whole chunks while they fit, then
    the next row (a row of the batch left) takes what is left."""
    cohort, chunks, value, left = [], [], 0.0, capacity
    for v in order[:batch]:
        if v.available <= left:
            cohort.append(v)
            chunks.append(v.available)
            value += _chunk_value(v, v.available, beta)
            left -= v.available
            continue
        if left > 0:
            cohort.append(v)
            chunks.append(left)
            value += _chunk_value(v, left, beta)
        break
    return value, cohort, chunks


def packed_prefill_candidates(ctx: SelectionContext, out: list[Candidate]) -> None:
    entries = ctx.catalog.entries(GraphKind.PREFILL)
    if not ctx.prefill:
        return
    beta = ctx.beta
    singles = [e.descriptor.prompt_capacity for e in entries if e.descriptor.batch_capacity == 1]
    found = []
    for index, entry in enumerate(entries):
        desc = entry.descriptor
        b, c = desc.batch_capacity, desc.prompt_capacity
        if b == 1:
            continue
        if not entry.known:
            reach = sum(sorted((v.to_endpoint for v in ctx.prefill), reverse=True)[:b])
            smaller = [
                e.descriptor.prompt_capacity
                for e in entries
                if e.descriptor.batch_capacity == b and e.descriptor.prompt_capacity < c
            ]
            if any(s >= reach for s in smaller):
                continue
        best = None
        for order in _orderings(ctx.prefill, c, beta):
            value, cohort, chunks = _fill(order, b, c, beta)
            if cohort and (best is None or value > best[0]):
                best = (value, cohort, chunks)
        value, cohort, chunks = best
        if len(cohort) == 1 and any(chunks[0] <= s <= c for s in singles):
            continue
        tokens = sum(chunks)
        cand = Candidate(
            entry, index, cohort, value, 0.0, (c - tokens) + (b - len(cohort)),
            max(v.lru for v in cohort), tokens, ctx,
        )  # fmt: skip
        cand.chunks = chunks
        found.append(((tuple(v.request.handle.id for v in cohort), tuple(chunks)), cand))
    for key, cand in found:
        d = cand.entry.descriptor
        mine = (d.batch_capacity, d.prompt_capacity)
        smaller = [
            (o.entry.descriptor.batch_capacity, o.entry.descriptor.prompt_capacity)
            for k, o in found
            if k == key
        ]
        if not any(s != mine and s[0] <= mine[0] and s[1] <= mine[1] for s in smaller):
            out.append(cand)
