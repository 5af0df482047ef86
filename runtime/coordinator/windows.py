"""A request's image windows and the storage's window slots and private
snapshot rows (runtime.coordinator.vision has the whole story; this module
holds the state alone, below the requests that carry it).

Pure Python: no torch, sockets or clocks.
"""

from __future__ import annotations

from enum import Enum

from runtime.image_spans import ImageSpan, VisionStorage, windows

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
        self.encoding = 0
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

    def least_chunk(self, position: int) -> int:
        """The shortest chunk from ``position``: an image span starting there is
        atomic, so its whole length (what its pages must hold to run at all)."""
        span = next((s for s in self.spans if s.start >= position), None)
        return span.length if span is not None and span.start == position else 1

    def pending(self) -> range:
        """Span indices of the active window still to encode, in order."""
        return range(self.encoded, self.end)

    def offset(self, index: int) -> int:
        """The compact feature offset of span ``index`` in its window's slot."""
        return sum(s.length for s in self.spans[self.first : index])

    def at_boundary(self, position: int) -> bool:
        """The active window is consumed and prefill stands at the following
        window's first span: the window transition is due."""
        return self.encoded == self.end < len(self.spans) and position >= self.spans[self.end].start

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
