"""Vision candidates: the pair search of a vision frame and the prefill or
mixed program it enables, and the window transition rows (spec, "Prerequisites and
completion"; docs/vision.md, "Scheduling").

* **Vision pairs.**  A vision frame is a prerequisite that immediately enables
  inference: for every pair of a VISION shape (``B_v`` images, ``T`` ms) and a
  following shape (PREFILL or SCORED_PREFILL, single or packed, ``B_f`` rows,
  ``C`` tokens, ``F`` ms; or a width-one MIXED shape) the cohorts are chosen
  jointly.  A prompt row with images still to encode in its active window offers, per ``j`` more
  images, the chunk its prefill may then take on ``C`` (up to the next image
  not encoded, a hard boundary, the pages it holds, never splitting a span),
  worth :func:`~runtime.coordinator.policy.prompt_lane_value`.  The newly
  ready rows are chosen by :func:`choose_cohort`, exact over the image budget
  and the following rows (a multiple-choice knapsack by dynamic programming:
  at most one option per row, ``sum j <= B_v``, at most ``B_f`` rows, at least
  one); on a packed shape the already ready prompt rows join them through the
  packing search (runtime.coordinator.packing: ``C`` shared), which must keep
  a newly ready row.  Spare image rows advance further images at no extra
  physical cost.  A width-one MIXED following shape serves one newly ready
  row as its prompt row and the running decoders on its other rows, their
  ages resetting at ``T + F`` (:func:`mixed_cohort`: exact, by
  :func:`~runtime.coordinator.prerequisites.best_pair` with one newly ready
  row).  The sequence scores ``total / (T + F) - (T + F)/2 * sum c`` (the
  decoders riding a mixed program are in ``total``); unknown durations score
  the value.  An unmeasured following shape whose cohort a smaller shape of
  its family holds does not follow (:mod:`runtime.coordinator.exploration`).
  Per vision shape the best pair is its candidate; only the vision frame
  executes.
* **Window transitions** (:mod:`runtime.coordinator.window_select`): the
  window snapshot and restore rows, ranked by the continuation index.

Pure Python: no torch, sockets or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.catalog import PREFILL_KINDS, GraphKind
from runtime.coordinator.cost import CostEntry
from runtime.coordinator.exploration import dominated_unmeasured
from runtime.coordinator.packing import PromptRows
from runtime.coordinator.plan import VisionImage
from runtime.coordinator.policy import Candidate, LaneView, SelectionContext, prompt_lane_value
from runtime.coordinator.prerequisites import (
    best_pair,
    following_contribution,
    sequence_rate,
)
from runtime.coordinator.requests import Request
from runtime.coordinator.vision import WindowStore, WindowViews
from runtime.coordinator.window_select import window_candidates
from runtime.image_spans import fit_chunk

_FAR = 1 << 62


@dataclass(slots=True)
class VisionRow:
    """A prompt row with images to encode: ``reach[j]`` tokens its chunk may
    take after its next ``j`` images (``images``: their span indices)."""

    view: LaneView
    reach: list[int]
    images: list[int]

    @property
    def kind(self) -> GraphKind:
        scored = self.view.request.spec.score_prompt
        return GraphKind.SCORED_PREFILL if scored else GraphKind.PREFILL


class VisionCandidate(Candidate):
    """A vision frame's candidate: its images, each in its window slot and
    offset; ``follow`` the following shape of its best pair (lookahead only)."""

    __slots__ = ("follow", "images")
    images: list[VisionImage]
    follow: CostEntry


def _base_limit(r: Request, pos: int, page_size: int) -> int:
    """Where ``r``'s prefill from ``pos`` stops but for images: a hard boundary,
    its prefill target, the pages it holds."""
    bound = next((p for p in r.spec.boundaries if p > pos), r.prefill_target)
    held = len(r.pages) * page_size if page_size else _FAR
    return min(bound, r.prefill_target, held)


def _reach(r: Request, pos: int, stop: int, page_size: int) -> int:
    end = min(_base_limit(r, pos, page_size), stop)
    return fit_chunk(r.spec.images, pos, max(0, end - pos))


def window_views(
    rows: list[LaneView], windowing: list[LaneView], store: WindowStore, page_size: int
) -> WindowViews:
    """The decision's vision population (vision.WindowViews)."""
    out: list[VisionRow] = []
    for view in rows:
        r, pos = view.request, view.prompt_pos
        state = r.vision
        assert state is not None
        images = list(state.pending())
        spans = state.spans
        reach = [
            _reach(r, pos, spans[i].start if i < len(spans) else _FAR, page_size)
            for i in range(state.encoded, state.encoded + len(images) + 1)
        ]
        out.append(VisionRow(view, reach, images))
    snapshot: list[tuple[LaneView, int]] = []
    restore: list[tuple[LaneView, int]] = []
    for view in windowing:
        r = view.request
        state = r.vision
        assert state is not None
        first = state.end  # the next window's
        end = state._window_end(first)
        stop = state.spans[end].start if end < len(state.spans) else _FAR
        # (pages come on demand: the lookahead's reach is not capped by those held now)
        ready = replace(view, available=_reach(r, view.prompt_pos, stop, 0))
        (snapshot if state.stage.value == "snapshot" else restore).append((ready, end - first))
    return WindowViews(out, snapshot, restore, list(store.free_windows), len(store.free_rows))


# ---------------------------------------------------------------------------
# The exact cohort choice over the image budget


def choose_cohort(
    groups: list[list[tuple[int, float]]], budget: int, rows: int
) -> tuple[float, list[tuple[int, int]]] | None:
    """At most one option ``(images, value)`` per group, ``sum images <= budget``,
    at most ``rows`` groups, at least one: the greatest total value, as
    ``(value, [(group, option), ...])``; ties prefer more groups, then fewer
    images.  Exact (dynamic programming over (groups taken, images used));
    None when no option fits."""
    states: dict[tuple[int, int], tuple[float, tuple[tuple[int, int], ...]]] = {(0, 0): (0.0, ())}
    for g, options in enumerate(groups):
        nxt = dict(states)
        for (count, used), (value, picks) in states.items():
            if count >= rows:
                continue
            for o, (images, gain) in enumerate(options):
                if used + images > budget:
                    continue
                key = (count + 1, used + images)
                held = nxt.get(key)
                if held is None or value + gain > held[0]:
                    nxt[key] = (value + gain, (*picks, (g, o)))
        states = nxt
    best: tuple[tuple[float, int, int], float, list[tuple[int, int]]] | None = None
    for (count, used), (value, picks) in states.items():
        if count < 1:
            continue
        rank = (value, count, -used)
        if best is None or rank > best[0]:
            best = (rank, value, list(picks))
    return None if best is None else (best[1], best[2])


def _options(row: VisionRow, batch: int, capacity: int, beta: float) -> list[tuple[int, float]]:
    """(images, value) per useful number of images on a capacity: only counts
    that lengthen the chunk."""
    out: list[tuple[int, float]] = []
    pos = row.view.prompt_pos
    spans = row.view.request.spec.images
    last = fit_chunk(spans, pos, min(capacity, row.reach[0]))
    for j in range(1, min(len(row.images), batch) + 1):
        tokens = fit_chunk(spans, pos, min(capacity, row.reach[j]))
        if tokens <= last:
            break
        out.append((j, prompt_lane_value(row.view, tokens, beta)))
        last = tokens
    return out


# ---------------------------------------------------------------------------
# Vision pairs


def _ms(entry: CostEntry) -> float:
    return entry.estimate_ns / 1e6 if entry.known else 0.0


def vision_candidates(ctx: SelectionContext, out: list[Candidate], fixed_width: int = 0) -> None:
    """Per vision shape, its best pair with a following prefill or width-one
    mixed shape (module docstring); then the window transition candidates.
    ``fixed_width`` > 1: a width-one mixed shape carries its prompt row alone
    (fixed-width execution runs no width-one decode row)."""
    views: WindowViews | None = ctx.vision
    if views is None:
        return
    if views.rows:
        follows = [(kind, entry) for kind in PREFILL_KINDS for entry in ctx.catalog.entries(kind)]
        follows += [
            (GraphKind.MIXED, entry)
            for entry in ctx.catalog.entries(GraphKind.MIXED)
            if entry.descriptor.token_capacity == 1
        ]
        for index, entry in enumerate(ctx.catalog.entries(GraphKind.VISION)):
            rows = _eligible(views, entry.descriptor.batch_capacity, ctx.beta)
            best: VisionCandidate | None = None
            for kind, follow in follows:
                if kind is GraphKind.MIXED:
                    cand = _mixed_pair(ctx, views, rows, entry, index, follow, fixed_width)
                else:
                    cand = _pair(ctx, views, rows, entry, index, kind, follow)
                if cand is not None and (best is None or cand.rank_key() > best.rank_key()):
                    best = cand
            if best is not None:
                out.append(best)
    window_candidates(ctx, views, out)


def _eligible(views: WindowViews, batch: int, beta: float) -> list[VisionRow]:
    """The rows a vision frame may serve: those holding a window slot, and as
    many others as slots are free (the most valuable first: what their whole
    reach after ``batch`` images is worth; ties the less recently served)."""
    held = [row for row in views.rows if _slot(row) >= 0]
    others = [row for row in views.rows if _slot(row) < 0]
    if len(others) > len(views.free_windows):

        def worth(row: VisionRow) -> tuple[float, int]:
            tokens = row.reach[min(len(row.images), batch)]
            return (-prompt_lane_value(row.view, tokens, beta), row.view.lru)

        others = sorted(others, key=worth)[: len(views.free_windows)]
    return held + others


def _slot(row: VisionRow) -> int:
    state = row.view.request.vision
    assert state is not None
    return state.window_slot


def _pair(
    ctx: SelectionContext,
    views: WindowViews,
    rows: list[VisionRow],
    entry: CostEntry,
    index: int,
    kind: GraphKind,
    follow: CostEntry,
) -> VisionCandidate | None:
    """The exact joint cohorts of vision shape ``entry`` and following prefill
    shape ``follow`` (module docstring), as the vision frame's candidate."""
    budget = entry.descriptor.batch_capacity
    rows_f, capacity = follow.descriptor.batch_capacity, follow.descriptor.prompt_capacity
    served = [row for row in rows if row.kind is kind]
    groups = [_options(row, budget, capacity, ctx.beta) for row in served]
    choice = choose_cohort(groups, budget, rows_f)
    if choice is None:
        return None
    total, picks = choice
    chosen = [(served[g], groups[g][o][0]) for g, o in picks]
    if rows_f > 1:  # packed: the ready rows share C with the newly ready ones
        packed = _packed(ctx, kind, chosen, rows_f, capacity)
        if packed is None:
            return None
        total, chosen, work = packed
    else:
        work = (1, _chunk(chosen[0], capacity))
    if dominated_unmeasured(ctx.catalog.entries(kind), follow, *work):
        return None  # (runtime.coordinator.exploration)
    return _candidate(ctx, views, rows, entry, index, follow, chosen, total)


def _chunk(chosen: tuple[VisionRow, int], capacity: int) -> int:
    """The chunk a newly ready row takes on ``capacity`` after its ``j`` images."""
    row, j = chosen
    return fit_chunk(row.view.request.spec.images, row.view.prompt_pos, min(capacity, row.reach[j]))


def _candidate(
    ctx: SelectionContext,
    views: WindowViews,
    rows: list[VisionRow],
    entry: CostEntry,
    index: int,
    follow: CostEntry,
    chosen: list[tuple[VisionRow, int]],
    total: float,
) -> VisionCandidate:
    """The vision frame's candidate serving ``chosen`` (rows, images) and
    advancing others on spare image rows; its sequence worth ``total``."""
    budget = entry.descriptor.batch_capacity
    images, lanes = _assign(views, rows, chosen, budget)
    lru = max(v.lru for v in lanes)
    cand = VisionCandidate(entry, index, lanes, total, 0.0, budget - len(images), lru, 0, ctx)
    cand.images, cand.follow = images, follow
    t_ms, f_ms = _ms(entry), _ms(follow)
    if t_ms <= 0.0 or f_ms <= 0.0:
        cand.unknown, cand.score = True, total  # unknown durations: by useful value
    else:
        cand.unknown = False
        cand.score = sequence_rate(total, t_ms, f_ms, ctx.active_age_price)
    return cand


def mixed_cohort(
    groups: list[list[tuple[int, float]]], decoders: list[float], rows: int
) -> tuple[float, tuple[int, int], tuple[int, ...]] | None:
    """The following cohort of a mixed shape of ``rows`` rows after a vision
    frame: one newly ready prompt row (group ``g``'s option ``o``; every option
    ``(images, value)`` already within the image budget) and, on the other
    ``rows - 1`` rows, the already ready decoders (their contributions, any
    order): ``(value, (g, o), decoder indices)``, None when no option exists.
    Exact: :func:`~runtime.coordinator.prerequisites.best_pair` with one
    newly ready row (the prompt row; per group its best option, ties to fewer
    images) and the decoders as the ready rows (positive ones only)."""
    newly: list[float] = []
    picks: list[tuple[int, int]] = []
    for g, options in enumerate(groups):
        if options:
            o = max(range(len(options)), key=lambda k: (options[k][1], -options[k][0]))
            newly.append(options[o][1])
            picks.append((g, o))
    choice = best_pair(newly, decoders, [], 1, rows, advance_spare=False)
    if choice is None:
        return None
    return choice.value, picks[choice.newly_ready[0]], choice.ready


def _mixed_pair(
    ctx: SelectionContext,
    views: WindowViews,
    rows: list[VisionRow],
    entry: CostEntry,
    index: int,
    follow: CostEntry,
    fixed_width: int,
) -> VisionCandidate | None:
    """Vision shape ``entry`` followed by width-one mixed shape ``follow``: its
    prompt row a newly ready (unscored) row, its decode rows the running
    decoders, the decoders' ages resetting at ``T + F`` (:func:`mixed_cohort`)."""
    budget = entry.descriptor.batch_capacity
    desc = follow.descriptor
    served = [row for row in rows if row.kind is GraphKind.PREFILL]
    groups = [_options(row, budget, desc.prompt_capacity, ctx.beta) for row in served]
    if not any(groups):
        return None
    t_ms, f_ms = _ms(entry), _ms(follow)
    decoders: list[float] = []
    if fixed_width <= 1:
        ctx.sort_decoders()  # (best first: the rows - 1 best are all that can join)
        slope = ctx.decode_age_slope
        decoders = [
            following_contribution(v.decode_value, slope, t_ms, f_ms)
            for v in ctx.decode[: desc.batch_capacity - 1]
        ]
    choice = mixed_cohort(groups, decoders, desc.batch_capacity)
    if choice is None:
        return None
    total, (g, o), riders = choice
    chosen = (served[g], groups[g][o][0])
    work = (1 + len(riders), _chunk(chosen, desc.prompt_capacity))
    if dominated_unmeasured(ctx.catalog.entries(GraphKind.MIXED), follow, *work):
        return None  # (runtime.coordinator.exploration)
    return _candidate(ctx, views, rows, entry, index, follow, [chosen], total)


def _packed(
    ctx: SelectionContext,
    kind: GraphKind,
    chosen: list[tuple[VisionRow, int]],
    batch: int,
    capacity: int,
) -> tuple[float, list[tuple[VisionRow, int]], tuple[int, int]] | None:
    """The newly ready rows (at their reach after their images) and the ready
    prompt rows of ``kind`` packed on (``batch``, ``capacity``), with the
    following program's work (rows, prompt tokens); None unless a newly ready
    row keeps a chunk longer than it had without the vision frame."""
    newly = [replace(row.view, available=row.reach[j]) for row, j in chosen]
    taken = {row.view.request.handle.id for row, _ in chosen}
    ready = [v for v in ctx.prompt_rows(kind) if v.request.handle.id not in taken]
    value, cohort, chunks = PromptRows(newly + ready, ctx.beta).best(batch, capacity)
    if not cohort:
        return None
    kept = [
        chosen[i] for i, chunk in zip(cohort, chunks)
        if i < len(newly) and chunk > chosen[i][0].reach[0]
    ]  # fmt: skip
    return (value, kept, (len(cohort), sum(chunks))) if kept else None


def _assign(
    views: WindowViews, rows: list[VisionRow], chosen: list[tuple[VisionRow, int]], budget: int
) -> tuple[list[VisionImage], list[LaneView]]:
    """The frame's images: the chosen rows' first, then spare rows advancing
    other rows' images, then the chosen rows' further ones; each request's
    images in order into its window slot (held, or the next free one) at their
    compact offsets."""
    counts: dict[int, int] = {}
    order: list[VisionRow] = []
    for row, j in chosen:
        counts[id(row)] = j
        order.append(row)
    left = budget - sum(counts.values())
    for row in [r for r in rows if id(r) not in counts] + [row for row, _ in chosen]:
        if left <= 0:
            break
        extra = min(left, len(row.images) - counts.get(id(row), 0))
        if extra > 0:
            if id(row) not in counts:
                order.append(row)
            counts[id(row)] = counts.get(id(row), 0) + extra
            left -= extra
    free = iter(views.free_windows)
    images: list[VisionImage] = []
    lanes: list[LaneView] = []
    for row in order:
        r = row.view.request
        state = r.vision
        assert state is not None
        slot = state.window_slot if state.window_slot >= 0 else next(free)
        for index in row.images[: counts[id(row)]]:
            span = state.spans[index]
            images.append(
                VisionImage(r.handle, index, slot, state.offset(index), span.length, span.digest)
            )
        lanes.append(row.view)
    return images, lanes
