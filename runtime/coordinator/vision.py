"""Image windows: a request's image spans grouped into whole-image windows
bounded by the prepared feature storage (spec, "Prerequisites and
completion", the image-window paragraph; docs/vision.md, "Scheduling").

* :class:`VisionState` (``Request.vision``): the active window (its first and
  end span indices), how many of its images are encoded, the window slot its
  features occupy, its private snapshot row, and its stage: ``READY``
  (vision frames encode the window's images, prefill consumes them),
  ``SNAPSHOT`` (at the following window's first span, everything consumed:
  its exact state is to be snapshotted into its private row) or ``RESTORE``
  (snapshotted: to be restored into a fresh request generation, after which
  the next window's vision writes from offset zero).
* :class:`WindowStore`: the storage's window slots and private snapshot rows.
* The plan's image data (:class:`VisionImage` for a vision frame,
  :class:`ImageRead` for a prefill chunk), and commit's checks of vision and
  window rows.

Pure Python: no torch, sockets or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.coordinator.errors import CommitError
from runtime.coordinator.plan import ImageRead, LanePhase, LaneWork, VisionImage
from runtime.coordinator.requests import Request
from runtime.coordinator.windows import Stage, VisionState, WindowStore

__all__ = [
    "ImageRead",
    "Stage",
    "VisionImage",
    "VisionState",
    "WindowStore",
    "check_vision_lane",
    "check_window_lane",
    "image_reads",
]

# ---------------------------------------------------------------------------
# The plan's image data


def image_reads(lanes: tuple[LaneWork, ...], requests: list[Request]) -> tuple[ImageRead, ...]:
    """For a prefill plan: each prompt row's image spans inside its chunk,
    with the window slot and feature offsets they read."""
    out: list[ImageRead] = []
    for i, (lane, r) in enumerate(zip(lanes, requests)):
        state = r.vision
        if state is None or lane.phase is not LanePhase.PREFILL:
            continue
        end = lane.prompt_start + lane.prompt_tokens
        for index in range(state.first, state.encoded):
            span = state.spans[index]
            if span.start >= lane.prompt_start and span.end <= end:
                out.append(
                    ImageRead(
                        i, index, span.start, span.length, state.window_slot,
                        state.offset(index),
                    )
                )  # fmt: skip
    return tuple(out)


def check_vision_lane(
    lane: LaneWork, r: Request | None, images: list[VisionImage], free: list[int]
) -> Request:
    """A vision row: its request runnable at the planned epoch with nothing in
    flight, its images the next ones of its active window in order, each at its
    compact offset in the window slot it holds (or a free one)."""
    if r is None or not r.runnable or r.vision is None:
        raise CommitError(f"request {lane.handle.id} cannot run a vision row now")
    if (lane.slot, lane.generation) != (r.slot, r.generation):
        raise CommitError(f"request {lane.handle.id}: slot epoch changed")
    if r.inflight_fences:
        raise CommitError(f"request {lane.handle.id} has work in flight")
    state = r.vision
    expected = list(state.pending())[: len(images)]
    if not images or [im.span for im in images] != expected:
        raise CommitError(f"request {lane.handle.id}: its images are not its next ones")
    slots = {im.window_slot for im in images}
    slot = images[0].window_slot
    if len(slots) != 1 or (slot != state.window_slot and slot not in free):
        raise CommitError(f"request {lane.handle.id}: window slot {slot} is not available")
    for im in images:
        span = state.spans[im.span]
        if (im.offset, im.rows) != (state.offset(im.span), span.length):
            raise CommitError(f"request {lane.handle.id}: image {im.span} offset changed")
    return r


def check_window_lane(lane: LaneWork, r: Request | None, rows_free: bool) -> Request:
    """A window snapshot or restore row: its request between two windows at
    that stage, at the planned epoch, with nothing in flight (``rows_free``: a
    private snapshot row is held or obtainable)."""
    if r is None or not r.window_waiting or r.inflight_fences or r.vision is None:
        raise CommitError(f"request {lane.handle.id} awaits no window transition")
    if (lane.slot, lane.generation) != (r.slot, r.generation):
        raise CommitError(f"request {lane.handle.id}: slot epoch changed")
    stage = Stage.SNAPSHOT if lane.phase is LanePhase.WINDOW_SNAPSHOT else Stage.RESTORE
    if r.vision.stage is not stage:
        raise CommitError(f"request {lane.handle.id} is not at its window {stage.value}")
    if stage is Stage.SNAPSHOT and not rows_free:
        raise CommitError(f"request {lane.handle.id}: no private snapshot row")
    return r


@dataclass(frozen=True)
class WindowViews:
    """The vision population of one decision (runtime.coordinator.vision_select):
    prompt rows with images still to encode in their active window (each with
    the tokens its chunk may reach after ``j`` more images, ``j = 0..``), the
    requests awaiting a window snapshot and a window restore, and the window
    slots free now."""

    rows: list
    snapshot: list
    restore: list
    free_windows: list[int]
    rows_free: int
