"""Candidates and selection (spec, "Useful service and selection", "Duration estimates").

Selection sees a :class:`SelectionContext`: per-request lane views whose prices
and ages are already projected to the planning start time.  For every loaded
physical program it builds the best cohort, prunes physical shapes dominated by
a smaller shape doing the same logical work, and ranks the rest:

1. an indeterminate (never measured) candidate beats a determinate one;
2. indeterminate candidates compete by expected useful value, determinate ones
   by useful value per time (:func:`utility.value_rate`);
3. equal values prefer shorter known time, more served requests, less recently
   used requests, and smaller physical padding, in that order.

Nothing here enumerates request subsets: for a fixed graph, lane values are
additive and every decoder shares the family's age slope, so the best cohort of
a decode graph is a prefix of the lanes sorted by value; a prefill graph serves
one request, so each request/capacity pair is one candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.catalog import GraphKind
from runtime.coordinator.cost import CostCatalog, CostEntry
from runtime.coordinator.requests import Request
from runtime.coordinator.utility import value_rate


@dataclass(slots=True)
class LaneView:
    """A runnable request as selection sees it at the planning start."""

    request: Request
    token_price: float  # f / x
    delivery_price: float  # g / z (decoders)
    prompt_pos: int  # prompt consumed once queued work completes
    available: int  # prompt tokens to the next hard boundary or prompt end
    to_endpoint: int  # prompt tokens to the next message endpoint or prompt end
    output_start: int  # committed output once queued work completes
    decode_value: float  # decoders: priced service + c*sigma*A (T-independent)
    lru: int  # selection sequence of its last frame (-1: never)


@dataclass(slots=True)
class SelectionContext:
    now_ns: int
    start_ns: int  # planning start: now, or the queue's expected end
    beta: float
    ttl_ns: int
    catalog: CostCatalog
    prefill: list[LaneView]  # requests that may run a prefill chunk
    decode: list[LaneView]  # decoders that may run a decode row
    decode_age_slope: float  # c * sigma of the decode family
    active_age_price: float  # sum of c over active decoders


class Candidate:
    """One physical program with its best cohort (a decode prefix, or one prefill row)."""

    __slots__ = (
        "age_slope",
        "entry",
        "index",
        "lanes",
        "lru",
        "padding",
        "prompt_tokens",
        "score",
        "stale",
        "t_ms",
        "unknown",
        "value",
    )

    def __init__(
        self,
        entry: CostEntry,
        index: int,
        lanes: list[LaneView],
        value: float,
        age_slope: float,
        padding: int,
        lru: int,
        prompt_tokens: int,
        ctx: SelectionContext,
    ) -> None:
        self.entry = entry
        self.index = index
        self.lanes = lanes
        self.value = value
        self.age_slope = age_slope
        self.padding = padding
        self.lru = lru
        self.prompt_tokens = prompt_tokens
        self.unknown = not entry.known
        self.stale = entry.known and entry.stale(ctx.now_ns, ctx.ttl_ns)
        if self.unknown:
            self.t_ms = 0.0
            self.score = value  # optimistic work score: no division by an unknown time
        else:
            self.t_ms = entry.estimate_ns / 1e6
            self.score = value_rate(value, age_slope, self.t_ms, ctx.active_age_price)

    def rank_key(self) -> tuple:
        return (
            self.unknown,
            self.score,
            -self.t_ms,
            len(self.lanes),
            -self.lru,
            -self.padding,
            -self.index,
        )

    @property
    def requires_feedback(self) -> bool:
        """Unknown or stale costs, and every non-queueable kind, need an empty window."""
        return self.unknown or self.stale or not self.entry.descriptor.queueable


def prefill_candidates(ctx: SelectionContext, out: list[Candidate]) -> None:
    entries = ctx.catalog.entries(GraphKind.PREFILL)
    if not entries or not ctx.prefill:
        return
    beta = ctx.beta
    for lane in ctx.prefill:
        request = lane.request
        avail = lane.available
        to_end = lane.to_endpoint
        remaining = request.spec.prompt_len - lane.prompt_pos
        a = 1.0 + lane.token_price
        finish_bonus = beta + lane.token_price
        included = 0  # largest capacity kept as a candidate so far
        previous = 0  # largest smaller capacity seen, kept or not
        for index, entry in enumerate(entries):
            capacity = entry.descriptor.prompt_capacity
            if included >= avail:
                break  # a kept smaller shape already consumes everything: padding only
            if not entry.known and previous >= to_end:
                # Exploration: a larger unmeasured graph is excluded when a smaller
                # capacity consumes the same tokens up to the next endpoint.
                previous = capacity
                continue
            tokens = capacity if capacity < avail else avail
            finishes = tokens == remaining
            value = tokens * a + (finish_bonus if finishes else 0.0)
            padding = capacity - tokens
            out.append(Candidate(entry, index, [lane], value, 0.0, padding, lane.lru, tokens, ctx))
            included = previous = capacity


def decode_candidates(ctx: SelectionContext, out: list[Candidate]) -> None:
    entries = ctx.catalog.entries(GraphKind.DECODE)
    lanes = ctx.decode
    if not entries or not lanes:
        return
    lanes.sort(key=lambda v: (-v.decode_value, v.lru, v.request.handle.id))
    n_lanes = len(lanes)
    prefix_value = [0.0]
    prefix_lru = [-1]
    for lane in lanes:
        prefix_value.append(prefix_value[-1] + lane.decode_value)
        prefix_lru.append(max(prefix_lru[-1], lane.lru))
    slope = ctx.decode_age_slope
    covered = False
    for index, entry in enumerate(entries):
        batch = entry.descriptor.batch_capacity
        if covered:
            break  # a smaller batch already serves every eligible decoder: padding only
        n = min(batch, n_lanes)
        covered = batch >= n_lanes
        out.append(
            Candidate(
                entry,
                index,
                lanes[:n],
                prefix_value[n],
                slope * n,
                batch - n,
                prefix_lru[n],
                0,
                ctx,
            )
        )


CANDIDATE_BUILDERS = (prefill_candidates, decode_candidates)


def candidates(ctx: SelectionContext) -> list[Candidate]:
    out: list[Candidate] = []
    for build in CANDIDATE_BUILDERS:
        build(ctx, out)
    return out


def best(cands: list[Candidate]) -> Candidate | None:
    return max(cands, key=Candidate.rank_key) if cands else None
