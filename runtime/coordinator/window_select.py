"""Window transition candidates: a request between two image windows needs a
window snapshot row (SNAPSHOT program), then a window restore row (RESTORE
program), then the next window's vision before its prefill produces value
(spec, "Prerequisites and completion"; docs/vision.md, "Scheduling").  That
longer chain is ranked by the continuation index ``V * T / (T + F)``, ``F`` the
remaining operations (restore, the next window's vision frames, the prefill)
and ``V`` that prefill chunk's value
(:func:`~runtime.coordinator.prerequisites.chain_score`).  Unknown durations
compare optimistically (``V``).  :func:`chunk_encode_ms` is the same remaining
image time for a restore pair whose prompt row still has images to encode
(runtime.coordinator.state_ops).

Pure Python: no torch, sockets or clocks.
"""

from __future__ import annotations

from runtime.catalog import GraphKind
from runtime.coordinator.cost import CostEntry
from runtime.coordinator.policy import Candidate, LaneView, SelectionContext, prompt_lane_value
from runtime.coordinator.prerequisites import chain_score, continuation_contribution
from runtime.coordinator.vision import VisionState, WindowViews
from runtime.image_spans import fit_chunk

WINDOW_SNAPSHOT = "window-snapshot"
WINDOW_RESTORE = "window-restore"


def _ms(entry: CostEntry) -> float:
    return entry.estimate_ns / 1e6 if entry.known else 0.0


def window_candidates(ctx: SelectionContext, views: WindowViews, out: list[Candidate]) -> None:
    """Window snapshot candidates (SNAPSHOT programs) and window restore
    candidates (RESTORE programs): per shape, the B requests of the stage with
    the largest continuation contributions (module docstring)."""
    stages = (
        (GraphKind.SNAPSHOT, WINDOW_SNAPSHOT, _with_rows(views)),
        (GraphKind.RESTORE, WINDOW_RESTORE, views.restore),
    )
    for kind, role, cohort in stages:
        if not cohort:
            continue
        chains = [(view, *_chain(ctx, view, n, kind)) for view, n in cohort]
        for index, entry in enumerate(ctx.catalog.entries(kind)):
            t_ms = _ms(entry)
            scored = sorted(
                ((continuation_contribution(v, t_ms, f), view) for view, v, f in chains),
                key=lambda item: (-item[0], item[1].lru, item[1].request.handle.id),
            )[: entry.descriptor.batch_capacity]
            lanes = [view for _, view in scored]
            value = sum(c for c, _ in scored)
            cand = Candidate(
                entry, index, lanes, value, 0.0, entry.descriptor.batch_capacity - len(lanes),
                max(v.lru for v in lanes), 0, ctx,
            )  # fmt: skip
            cand.roles = [role] * len(lanes)
            score = chain_score([c for c, _ in scored], t_ms, ctx.active_age_price)
            cand.unknown, cand.score = score.unknown, score.score
            out.append(cand)


def _with_rows(views: WindowViews) -> list[tuple[LaneView, int]]:
    """The requests awaiting a window snapshot that hold a private snapshot row,
    and as many others as rows are free."""
    held = [item for item in views.snapshot if _row(item[0].request.vision) >= 0]
    others = [item for item in views.snapshot if _row(item[0].request.vision) < 0]
    return held + others[: views.rows_free]


def _row(state: VisionState | None) -> int:
    assert state is not None
    return state.snapshot_row


def _chain(
    ctx: SelectionContext, view: LaneView, images: int, kind: GraphKind
) -> tuple[float, float]:
    """(V, T_further) of a window transition's continuation: the value of the
    prefill chunk its next window enables, and the time of the operations
    still to run after this stage (0: some duration unknown)."""
    r = view.request
    pkind = GraphKind.SCORED_PREFILL if r.spec.score_prompt else GraphKind.PREFILL
    singles = [e for e in ctx.catalog.entries(pkind) if e.descriptor.batch_capacity == 1]
    fits = [e for e in singles if e.descriptor.prompt_capacity >= view.available]
    prefill = fits[0] if fits else (singles[-1] if singles else None)
    if prefill is None or view.available <= 0:
        return 0.0, 0.0
    capacity = prefill.descriptor.prompt_capacity
    tokens = fit_chunk(r.spec.images, view.prompt_pos, min(capacity, view.available))
    value = prompt_lane_value(view, tokens, ctx.beta)
    parts = [_ms(prefill)]
    if kind is GraphKind.SNAPSHOT:  # the restore is still to run
        restores = [_ms(e) for e in ctx.catalog.entries(GraphKind.RESTORE)]
        parts.append(min(restores) if restores and min(restores) > 0 else 0.0)
    if images:
        encode = encode_ms(ctx.catalog.entries(GraphKind.VISION), images)
        parts.append(0.0 if encode is None else encode)
    if any(p <= 0.0 for p in parts):
        return value, 0.0
    return value, sum(parts)


def encode_ms(visions: list[CostEntry], images: int) -> float | None:
    """The time to encode ``images`` images on the largest VISION program
    (what a chain's continuation still needs); None when unmeasured."""
    if not images:
        return 0.0
    if not visions or not visions[-1].known:
        return None
    largest = visions[-1]
    return -(-images // largest.descriptor.batch_capacity) * _ms(largest)


def chunk_encode_ms(visions: list[CostEntry], view: LaneView, tokens: int) -> float | None:
    """The time to encode the images of ``view``'s chunk of ``tokens`` tokens
    that its active window has not encoded yet (0.0 for none; None when unmeasured)."""
    return encode_ms(visions, pending_images(view, tokens))


def pending_images(view: LaneView, tokens: int) -> int:
    """The images of ``view``'s chunk of ``tokens`` tokens its active window has
    not encoded yet."""
    state = view.request.vision
    if state is None:
        return 0
    end = view.prompt_pos + tokens
    spans = state.spans
    return sum(1 for i in state.pending() if spans[i].start < end)
