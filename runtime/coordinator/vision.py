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
from enum import Enum

from runtime.coordinator.errors import CommitError
from runtime.coordinator.plan import ImageRead, LanePhase, LaneWork, VisionImage
from runtime.coordinator.requests import Request
from runtime.image_spans import ImageSpan, VisionStorage, windows

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

_FAR = 1 << 62


class Stage(str, Enum):
    READY = "ready"
    SNAPSHOT = "snapshot"
    RESTORE = "restore"


class VisionState:
    """One request's windows (module docstring).  Spans before ``first`` are
    consumed (or attached from the prefix cache); spans ``[first, encoded)`` of
    the active window ``[first, end)`` have their features in ``window_slot``."""

    __slots__ = (
        "capacity",
        "encoded",
        "encoding",
        "end",
        "first",
        "origin",
        "snapshot_row",
        "spans",
        "stage",
        "window_slot",
    )

    def __init__(self, spans: tuple[ImageSpan, ...], capacity: int) -> None:
        self.spans = spans
        self.capacity = capacity
        self.window_slot = -1
        self.snapshot_row = -1
        self.first = self.end = self.encoded = 0
        self.encoding = 0  # images a submitted vision frame encodes
        self.origin = -1
        self.stage = Stage.READY
        self.reset(0)

    # ---------------------------------------------------------------- windows
    def reset(self, position: int) -> None:
        """The active window from ``position`` (a new generation's consumed
        prompt): its first span is the first not wholly before ``position``."""
        spans = self.spans
        first = next((i for i, s in enumerate(spans) if s.end > position), len(spans))
        self.first = self.encoded = first
        self.end = self._window_end(first)
        self.origin = position
        self.stage = Stage.READY

    def _window_end(self, first: int) -> int:
        rows, end = 0, first
        for span in self.spans[first:]:
            if rows + span.length > self.capacity:
                break
            rows += span.length
            end += 1
        return end

    def sync(self, position: int) -> None:
        """A request that encoded nothing yet follows its consumed prompt (a
        prefix attached late, a text chunk before its first image)."""
        if self.stage is Stage.READY and self.encoded == self.first and position != self.origin:
            self.reset(position)

    @property
    def transition(self) -> bool:
        """Between two windows: its next row is a window snapshot or restore."""
        return self.stage is not Stage.READY

    @property
    def windows_left(self) -> int:
        """Windows from the active one to the last (1: no boundary ahead)."""
        return len(windows(self.spans[self.first :], self.capacity)) if self.spans else 0

    def stop(self, position: int) -> int:
        """Where prefill from ``position`` must stop: the first image not encoded
        (the following window's first span once the active one is encoded)."""
        del position
        return self.spans[self.encoded].start if self.encoded < len(self.spans) else _FAR

    def window_stop(self) -> int:
        """The following window's first span (prefill never passes it in this window)."""
        return self.spans[self.end].start if self.end < len(self.spans) else _FAR

    def pending(self) -> range:
        """Span indices of the active window still to encode, in order."""
        return range(self.encoded, self.end)

    def offset(self, index: int) -> int:
        """The compact feature offset of span ``index`` in its window's slot."""
        return sum(s.length for s in self.spans[self.first : index])

    def at_boundary(self, position: int) -> bool:
        """The active window is consumed and prefill stands at the following
        window's first span: the window transition is due."""
        return (
            self.encoded == self.end < len(self.spans)
            and position >= self.spans[self.end].start
        )

    def consumed(self, position: int) -> bool:
        """Every feature of the active window has been read by prefill."""
        return self.end > self.first and position >= self.spans[self.end - 1].end


class WindowStore:
    """The storage's window slots and private snapshot rows, owned by the
    scheduler (free lists, lowest id first)."""

    def __init__(self, storage: VisionStorage, max_slots: int) -> None:
        self.storage = storage
        self.free_windows = list(range(storage.window_slots))
        rows = storage.snapshot_rows or max_slots
        self.free_rows = list(range(rows))
        self.snapshot_rows = rows

    def take_window(self, slot: int) -> None:
        self.free_windows.remove(slot)

    def release(self, state: VisionState) -> None:
        """Free what ``state`` holds (its request ended, or its window is consumed)."""
        self.release_window(state)
        if state.snapshot_row >= 0:
            self.free_rows.append(state.snapshot_row)
            self.free_rows.sort()
            state.snapshot_row = -1

    def release_window(self, state: VisionState) -> None:
        if state.window_slot >= 0:
            self.free_windows.append(state.window_slot)
            self.free_windows.sort()
            state.window_slot = -1

    def reserve_row(self, state: VisionState) -> bool:
        """A private snapshot row for a request spanning several windows
        (reserved once; False when every row is taken)."""
        if state.snapshot_row >= 0:
            return True
        if not self.free_rows:
            return False
        state.snapshot_row = self.free_rows.pop(0)
        return True


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
