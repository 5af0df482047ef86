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
one request, so each request/capacity pair is one candidate.  A mixed graph
(spec, "Mixed execution contract") compares its best decode-only cohort (a
prefix of the decoders) with its best prompt row plus the highest-value
decoders fitting the remaining rows (that prefix again, one row shorter): one
decode-only and one prompt-row candidate per mixed shape.

Dominance: candidates of one graph kind with the same cohort and logical work
keep only shapes no larger in every capacity than an alternative; mixed
candidates also need the same prompt row and prompt tokens.  A shape removed
by the exploration rule dominates nothing.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from runtime.catalog import PREFILL_KINDS, GraphKind
from runtime.coordinator.cost import CostCatalog, CostEntry
from runtime.coordinator.mixed_layout import MixedLayout
from runtime.coordinator.requests import Request
from runtime.coordinator.utility import prompt_chunk_value, value_rate
from runtime.image_spans import fit_chunk


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
    # Prefills: restored history ends here (no value below it), and the value of
    # the output token the final chunk commits (utility.prompt_chunk_value).
    history_end: int = 0
    finish_value: float = 0.0
    # Decoders: target rows its KV pages hold from its pending token on
    # (pages on demand; runtime.coordinator.residency).
    room: int = 1 << 30


@dataclass(slots=True)
class SelectionContext:
    now_ns: int
    start_ns: int  # planning start: now, or the queue's expected end
    beta: float
    ttl_ns: int
    catalog: CostCatalog
    prefill: list[LaneView]  # requests that may run a prefill chunk (unscored)
    decode: list[LaneView]  # decoders that may run a decode row
    decode_age_slope: float  # c * sigma of the decode family
    active_age_price: float  # sum of c over active decoders
    # The decoders sorted by value (best first) and their prefix sums; built
    # once per decision by sort_decoders(), shared by decode and mixed builders.
    prefix_value: list[float] | None = None
    prefix_lru: list[int] | None = None
    # Terminal requests and restores awaiting a state program (state_ops.StateViews).
    states: Any = None
    # Prompt rows of requests whose prompt is scored (RequestSpec.score_prompt):
    # they run on SCORED_PREFILL programs only (docs/scored-prefill.md).
    scored: list[LaneView] = field(default_factory=list)
    # Unscored prompt rows of requests with images (prefill programs and a mixed
    # program's prompt row, spans kept whole); the vision population
    # (runtime.coordinator.vision_select).
    imaged: list[LaneView] = field(default_factory=list)
    vision: Any = None

    def prompt_rows(self, kind: GraphKind) -> list[LaneView]:
        """The prompt rows a prefill program of ``kind`` serves: the scored rows on
        SCORED_PREFILL programs, every other one on PREFILL programs."""
        if kind is GraphKind.SCORED_PREFILL:
            return self.scored
        return self.prefill + self.imaged if self.imaged else self.prefill

    def sort_decoders(self) -> tuple[list[float], list[int]]:
        if self.prefix_value is None or self.prefix_lru is None:
            self.decode.sort(key=lambda v: (-v.decode_value, v.lru, v.request.handle.id))
            values = [0.0]
            lrus = [-1]
            for lane in self.decode:
                values.append(values[-1] + lane.decode_value)
                lrus.append(max(lrus[-1], lane.lru))
            self.prefix_value, self.prefix_lru = values, lrus
        return self.prefix_value, self.prefix_lru


class Candidate:
    """One physical program with its best cohort.

    ``lanes`` in plan order; ``prompt_row`` is the index of the lane that
    consumes ``prompt_tokens`` prompt tokens (-1: none, a decode-only cohort);
    every other lane is a decode row.
    """

    __slots__ = (
        "age_slope",
        "ceilings",
        "chunks",
        "entry",
        "index",
        "lanes",
        "lru",
        "padding",
        "prompt_row",
        "prompt_tokens",
        "queries",
        "roles",
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
        prompt_row: int = -1,
    ) -> None:
        self.entry = entry
        self.index = index
        self.lanes = lanes
        self.value = value
        self.age_slope = age_slope
        self.padding = padding
        self.lru = lru
        self.prompt_tokens = prompt_tokens
        self.prompt_row = prompt_row
        self.queries: list[int] | None = None  # speculative: each lane's query length
        self.ceilings: list[int] | None = None  # device-allocated: each lane's ceiling
        self.roles: list[str] | None = None  # state programs: each lane's role (state_ops)
        self.chunks: list[int] | None = None  # packed prefill: each row's prompt tokens
        estimate_ns = entry.estimate_ns
        if estimate_ns <= 0:  # indeterminate (CostEntry.known is False)
            self.unknown = True
            self.stale = False
            self.t_ms = 0.0
            self.score = value  # optimistic work score: no division by an unknown time
        else:
            self.unknown = False
            self.stale = entry.stale(ctx.now_ns, ctx.ttl_ns)
            self.t_ms = t_ms = estimate_ns / 1e6
            self.score = value_rate(value, age_slope, t_ms, ctx.active_age_price)

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


def prefill_options(
    ctx: SelectionContext, lane: LaneView, kind: GraphKind = GraphKind.PREFILL
) -> Iterator[tuple]:
    """The single-row prefill programs of ``kind`` (PREFILL or SCORED_PREFILL)
    ``lane`` competes on, as (entry, index, value, padding, tokens): every
    capacity up to the first that holds its available tokens (a larger one
    would do the same work with more padding), but for the exploration rule."""
    avail = lane.available
    to_end = lane.to_endpoint
    included = 0  # largest capacity kept as a candidate so far
    previous = 0  # largest smaller capacity seen, kept or not
    for index, entry in enumerate(ctx.catalog.entries(kind)):
        if entry.descriptor.batch_capacity > 1:
            continue  # packed programs: runtime.coordinator.packing
        capacity = entry.descriptor.prompt_capacity
        if included >= avail:
            break  # a kept smaller shape already consumes everything: padding only
        if not entry.known and previous >= to_end:
            # Exploration: a larger unmeasured graph is excluded when a smaller
            # capacity consumes the same tokens up to the next endpoint.
            previous = capacity
            continue
        tokens = capacity if capacity < avail else avail
        if getattr(lane.request, "vision", None) is not None:  # an image span is atomic
            tokens = fit_chunk(lane.request.spec.images, lane.prompt_pos, tokens)
            if not tokens:
                continue  # the span at its position does not fit this capacity
        yield entry, index, prompt_lane_value(lane, tokens, ctx.beta), capacity - tokens, tokens
        included = previous = capacity


class _PrefillLadder:
    """A catalog version's single-row prefill programs, ascending: whether all
    are measured, the oldest last observation, the most prompt tokens per ms
    (C / T) and the shortest time: what a row's score bound reads."""

    def __init__(self, catalog: CostCatalog, kind: GraphKind = GraphKind.PREFILL) -> None:
        items = [
            (index, entry)
            for index, entry in enumerate(catalog.entries(kind))
            if entry.descriptor.batch_capacity == 1
        ]
        self.items = items
        self.capacities = [entry.descriptor.prompt_capacity for _, entry in items]
        self.measured = bool(items) and all(entry.known for _, entry in items)
        self.rate = self.t_min = 0.0
        self.oldest = 0
        if self.measured:
            times = [entry.estimate_ns / 1e6 for _, entry in items]
            self.rate = max(c / t for c, t in zip(self.capacities, times))
            self.t_min = min(times)
            self.oldest = min(entry.last_valid_ns or 0 for _, entry in items)


def _prefill_ladder(ctx: SelectionContext, kind: GraphKind) -> _PrefillLadder:
    build = lambda: _PrefillLadder(ctx.catalog, kind)  # noqa: E731
    return ctx.catalog.derived(f"prefill-ladder-{kind.value}", build)


def prefill_candidates(
    ctx: SelectionContext,
    out: list[Candidate],
    floor: float | None = None,
    kind: GraphKind = GraphKind.PREFILL,
) -> None:
    """Per prompt row, its single-row prefill candidates (:func:`prefill_options`)
    on programs of ``kind``: PREFILL for the unscored rows, SCORED_PREFILL for
    the scored ones (:meth:`SelectionContext.prompt_rows`; valued alike,
    docs/scored-prefill.md).
    Only those a decision can read become objects: the best by
    :meth:`Candidate.rank_key` (what selection reads), the most valuable (the
    plan's log scale), and the stale ones (a timing refresh's alternatives);
    the row's other options cannot change a plan.  ``floor``: a known score
    the decision already has; a row whose every option is measured and fresh
    and whose score bound is below it offers only its most valuable option
    (the bound: its best token price at the ladder's best tokens per ms, its
    first output over the shortest time, less the active age cost of the
    shortest time; the margin of runtime.coordinator.bounds)."""
    rows = ctx.prompt_rows(kind)
    if not rows or not ctx.catalog.entries(kind):
        return
    now_ns, ttl_ns, price = ctx.now_ns, ctx.ttl_ns, ctx.active_age_price
    ladder = _prefill_ladder(ctx, kind)
    if floor is not None and (not ladder.measured or now_ns - ladder.oldest >= ttl_ns):
        floor = None  # an unmeasured or stale option may win: every row searched
    if floor is not None:
        floor -= 1e-9 * abs(floor)
    for lane in rows:
        if floor is not None:
            per = 1.0 + lane.token_price
            if lane.history_end > lane.prompt_pos:  # restored history's continuation index
                per = max(per, lane.finish_value / (lane.request.prefill_target - lane.prompt_pos))
            t = ladder.t_min
            bound = per * ladder.rate + lane.finish_value / t - 0.5 * t * price
            if bound + 1e-9 * abs(bound) < floor:
                k = min(bisect_left(ladder.capacities, lane.available), len(ladder.items) - 1)
                index, entry = ladder.items[k]
                tokens = fit_tokens(lane, min(ladder.capacities[k], lane.available))
                if not tokens:
                    continue  # (its span fits no capacity there: nothing to offer)
                value = prompt_lane_value(lane, tokens, ctx.beta)
                option = (entry, index, value, ladder.capacities[k] - tokens, tokens)
                out.append(_prompt_candidate(ctx, lane, option))  # the scale's candidate
                continue
        best_key: tuple | None = None
        best = last = None
        for option in prefill_options(ctx, lane, kind):
            entry, index, value, padding, _ = last = option
            estimate = entry.estimate_ns
            if estimate > 0:
                t_ms = estimate / 1e6
                key = (False, value_rate(value, 0.0, t_ms, price), -t_ms, -padding, -index)
                if entry.stale(now_ns, ttl_ns):
                    out.append(_prompt_candidate(ctx, lane, option))
            else:
                key = (True, value, -0.0, -padding, -index)
            if best_key is None or key > best_key:
                best_key, best = key, option
        for held in (best, last) if best is not last else (best,):
            if held is not None and not (held[0].known and held[0].stale(now_ns, ttl_ns)):
                out.append(_prompt_candidate(ctx, lane, held))  # (a stale one is out already)


def _prompt_candidate(ctx: SelectionContext, lane: LaneView, option: tuple) -> Candidate:
    entry, index, value, padding, tokens = option
    return Candidate(entry, index, [lane], value, 0.0, padding, lane.lru, tokens, ctx, 0)


def fit_tokens(lane: LaneView, tokens: int) -> int:
    """``tokens`` of ``lane``'s chunk, short of any image span it would split."""
    if getattr(lane.request, "vision", None) is None:  # (test doubles carry none)
        return tokens
    return fit_chunk(lane.request.spec.images, lane.prompt_pos, tokens)


def decode_candidates(ctx: SelectionContext, out: list[Candidate]) -> None:
    entries = ctx.catalog.entries(GraphKind.DECODE)
    lanes = ctx.decode
    if not entries or not lanes:
        return
    prefix_value, prefix_lru = ctx.sort_decoders()
    n_lanes = len(lanes)
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


def prompt_lane_value(lane: LaneView, tokens: int, beta: float) -> float:
    """Consumed uncached prompt tokens, plus the one output token a chunk ending the
    prefill commits (:func:`~runtime.coordinator.utility.prompt_chunk_value`).
    ``beta`` is the output-token value already folded into ``lane.finish_value``."""
    del beta
    return prompt_chunk_value(
        lane.prompt_pos,
        tokens,
        lane.request.prefill_target,
        lane.history_end,
        lane.token_price,
        lane.finish_value,
    )


def mixed_candidates(ctx: SelectionContext, out: list[Candidate]) -> None:
    """Per mixed shape: the best decode-only cohort, and the best prompt row plus
    the highest-value decoders fitting the remaining rows.

    Width-one shapes only: wider verification rows join with speculative rounds.
    Dominance (same cohort, same prompt row and prompt tokens, capacities all at
    least as large) is applied per prompt row before the best row of a shape is
    chosen, so a row whose work fits a smaller shape never lends that larger
    shape its value.  The exploration rule works on each batch's prompt ladder:
    an unmeasured capacity is skipped when a smaller capacity of that batch
    already reaches the row's next endpoint.
    """
    layout = ctx.catalog.derived("mixed", lambda: MixedLayout(ctx.catalog), per_version=False)
    prompts = ctx.prefill + ctx.imaged if ctx.imaged else ctx.prefill
    if not layout.batches or not (ctx.decode or prompts):
        return
    prefix_value, prefix_lru = ctx.sort_decoders()
    n_dec = len(ctx.decode)
    slope = ctx.decode_age_slope
    beta = ctx.beta
    by_batch, batches = layout.by_batch, layout.batches
    signature = ctx.catalog.derived("mixed-signature", layout.signature)

    # Decode-only populations: the prompt capacity is padding, so per batch only
    # the smallest capacity stays, and batches stop at the first that covers
    # every decoder.
    for batch in batches:
        if not n_dec:
            break
        index, entry = by_batch[batch][0]
        n = min(batch, n_dec)
        desc = entry.descriptor
        padding = desc.prompt_capacity + (batch - 1) - n
        out.append(
            Candidate(
                entry, index, ctx.decode[:n], prefix_value[n], slope * n, padding,
                prefix_lru[n], 0, ctx,
            )
        )  # fmt: skip
        if batch >= n_dec:
            break

    if not prompts:
        return
    # Prompt row + decoders.  A row's prompt value does not depend on the batch,
    # so batches whose ladders look alike (same capacities, same measured state)
    # share one pass over the rows.  Below `cover` every batch serves a
    # different number of decoders, so only capacities compete there; beyond
    # it the decoders are the same as on `cover`, so a batch with cover's
    # ladder is dominated outright and any other one is checked row by row.
    cover = next((b for b in batches if b - 1 >= n_dec), batches[-1])
    beyond = [b for b in batches if b > cover and signature[b] != signature[cover]]
    kept: dict[int, dict[int, int]] | None = {} if beyond else None
    shared: dict[tuple, list] = {}
    for batch in batches:
        ladder = by_batch[batch]
        if batch < cover or (batch == cover and kept is None):
            rows = shared.get(signature[batch])
            if rows is None:
                rows = shared[signature[batch]] = _best_rows(ladder, prompts, beta, None)
        elif batch == cover or batch in beyond:
            rows = _best_rows(ladder, prompts, beta, kept)
        else:
            continue  # the same rows, work and decoders as on `cover`: dominated
        n = min(batch - 1, n_dec)
        cohort = ctx.decode[:n]
        for (index, entry), row in zip(ladder, rows):
            if row is None:
                continue
            value, _, lane, tokens = row
            desc = entry.descriptor
            padding = desc.prompt_capacity - tokens + (batch - 1) - n
            out.append(
                Candidate(
                    entry, index, [lane, *cohort], value + prefix_value[n], slope * n, padding,
                    max(lane.lru, prefix_lru[n]), tokens, ctx, 0,
                )
            )  # fmt: skip


def _best_rows(
    ladder: list[tuple[int, CostEntry]],
    lanes: list[LaneView],
    beta: float,
    kept: dict[int, dict[int, int]] | None,
) -> list[tuple[float, int, LaneView, int] | None]:
    """Per capacity of one batch's ladder, the best undominated prompt row:
    (prompt value, -lru, row, tokens), or None.

    A row stops at the first kept capacity that covers its available tokens
    (larger ones do the same work); the exploration rule skips an unmeasured
    capacity once a smaller one of the ladder reaches the row's endpoint.
    ``kept`` (row index -> tokens -> smallest capacity) carries the work rows
    already do with the same decoders on a smaller batch: the same work on a
    capacity at least as large is dominated.
    """
    best: list[tuple[float, int, LaneView, int] | None] = [None] * len(ladder)
    for i, lane in enumerate(lanes):
        avail, to_end = lane.available, lane.to_endpoint
        images = getattr(lane.request, "vision", None) is not None  # spans kept whole
        done = None if kept is None else kept.setdefault(i, {})
        previous = 0  # largest smaller capacity of this ladder seen, kept or not
        for pos, (_, entry) in enumerate(ladder):
            capacity = entry.descriptor.prompt_capacity
            if not entry.known and previous >= to_end:
                previous = capacity
                continue  # exploration: a smaller capacity reaches the endpoint
            previous = capacity
            tokens = capacity if capacity < avail else avail
            if images:
                tokens = fit_tokens(lane, tokens)
                if tokens <= 0:
                    continue  # the capacity ends inside the span at its position
            if done is not None:
                held = done.get(tokens)
                if held is not None and held <= capacity:
                    if capacity >= avail:
                        break
                    continue  # dominated: the same work on a smaller batch
                done[tokens] = capacity
            value = prompt_lane_value(lane, tokens, beta)
            current = best[pos]
            if current is None or (value, -lane.lru) > current[:2]:
                best[pos] = (value, -lane.lru, lane, tokens)
            if capacity >= avail:
                break  # larger capacities of this ladder do the same work
    return best


def candidates(ctx: SelectionContext) -> list[Candidate]:
    """Prefill, decode and mixed candidates, in that order; the prefill rows
    are bounded by the best known score of the others (prefill_candidates)."""
    decode: list[Candidate] = []
    decode_candidates(ctx, decode)
    mixed_candidates(ctx, decode)
    floor = max((c.score for c in decode if not c.unknown), default=None)
    out: list[Candidate] = []
    for kind in PREFILL_KINDS:  # unscored rows on prefill, scored ones on scored prefill
        prefill_candidates(ctx, out, floor, kind)
    out += decode
    return out


def best(cands: list[Candidate]) -> Candidate | None:
    return max(cands, key=Candidate.rank_key) if cands else None
