"""The trace file: a bounded queue, a writer thread, rotation, and a ring of recent lines.

The engine thread calls :meth:`TraceWriter.offer` once per completed frame: an
append to a deque, or, when :data:`TraceOptions.queue_limit` items already
wait, a counted drop.  It never blocks and never formats: the writer thread
wakes every :data:`POLL_S`, renders each item to a JSON object (the ``render``
callable), adds the drop count so far, writes it as one line and keeps it in a
ring for ``/debug/trace`` (:meth:`TraceWriter.lines_since`).  It gives up the
GIL after every line, so the engine thread never waits on a whole batch
(otherwise up to the interpreter's 5 ms switch interval).

Files: every file starts with a ``{"event": "start", ...}`` line and the last
ends with ``{"event": "end", ...}`` (frame lines written, dropped); between
them, frame lines and the requests' lines (:mod:`runtime.trace.lines`).  A
render may give several lines for one item, and may add fields to the start
line of every later file (:meth:`TraceWriter.add_header`).

Format versions (``"v"`` of the start and end lines): 1 wrote frame lines and
request lines with ids, times, prompt and max tokens; 2 adds what a what-if
replay needs: request lines with message endpoints, boundaries and prompt
page digests, a ``finish`` line per request, and a ``scheduler`` line (its
configuration and policy), also copied into later files' start lines.  When writing a
line would take the file past ``max_bytes`` it is rotated: ``FILE.k`` becomes
``FILE.k+1`` (the oldest, ``FILE.keep``, is overwritten), ``FILE`` becomes
``FILE.1`` and a new ``FILE`` starts.  Traces hold token ids: files are created
mode 0600, and directories the writer has to create are made 0700.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.coordinator.config import ConfigError
from runtime.private_files import make_private_dirs, open_private

log = logging.getLogger("runtime.trace")

FORMAT_VERSION = 2
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_KEEP = 3
DEFAULT_QUEUE_LIMIT = 65536
DEFAULT_RING_LINES = 4096
POLL_S = 0.05  # the writer thread's wake-up period


@dataclass(frozen=True)
class TraceOptions:
    """Where and how much to trace.

    * ``path``: the trace file (``None``: the ring only, for ``/debug/trace``);
    * ``max_bytes``: a file's size limit before rotation (at least 4096);
    * ``keep``: rotated files kept (``FILE.1`` .. ``FILE.keep``; 0: none);
    * ``queue_limit``: frames that may wait for the writer before new ones are dropped;
    * ``ring_lines``: recent frame lines kept in memory for ``/debug/trace``.
    """

    path: str | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    keep: int = DEFAULT_KEEP
    queue_limit: int = DEFAULT_QUEUE_LIMIT
    ring_lines: int = DEFAULT_RING_LINES

    def __post_init__(self) -> None:
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ConfigError(f"path must be a file path or None, got {self.path!r}")
        for name, low in (("max_bytes", 4096), ("keep", 0), ("queue_limit", 1), ("ring_lines", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)  # lines are trees


def dumps(obj: dict) -> str:
    return _ENCODER.encode(obj)


class TraceWriter:
    """One trace file (or none) and its writer thread; see the module's docstring.

    ``render(item)`` runs on the writer thread, in offer order: a line's JSON
    object (it must hold ``"fence"``), a list of them, or None to write nothing
    for that item.
    ``header``: fields of every file's start line.  ``file_only``: the ``"event"``
    values of lines written to the file but kept out of the ring and the
    ``frames`` count (request lines).
    """

    def __init__(
        self,
        options: TraceOptions,
        render: Callable[[Any], dict | list[dict] | None],
        header: dict | None = None,
        poll_s: float = POLL_S,
        file_only: tuple[str, ...] = (),
    ) -> None:
        self.options = options
        self._file_only = file_only
        self._render = render
        self._header = dict(header or {})
        self._poll_s = poll_s
        self._queue: deque[Any] = deque()
        self._limit = options.queue_limit
        self.dropped = 0  # written by the engine thread only
        self.written = 0  # lines, written by the writer thread only
        self.frames = 0  # of which lines not ``file_only`` (frames)
        self.render_errors = 0
        self.rotations = 0
        self._ring: deque[tuple[int, str]] = deque(maxlen=options.ring_lines)
        self._ring_lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._fd: int | None = None
        self._size = 0
        self._pending: list[str] = []
        if options.path is not None:
            make_private_dirs(os.path.dirname(os.path.abspath(options.path)))
            self._open()
        self._thread = threading.Thread(target=self._run, name="flare-trace", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def offer(self, item: Any) -> bool:
        """Queue ``item`` for the writer (the engine thread); False: dropped, counted."""
        if self._closed or len(self._queue) >= self._limit:
            self.dropped += 1
            return False
        self._queue.append(item)
        return True

    def add_header(self, fields: dict) -> None:
        """Add ``fields`` to the start line of every file opened from now on (the
        writer thread: call it from ``render``)."""
        self._header.update(fields)

    def lines_since(self, fence: int, limit: int | None = None) -> list[str]:
        """The kept lines of frames after ``fence``, oldest first (at most the last ``limit``)."""
        with self._ring_lock:
            lines = [line for f, line in self._ring if f > fence]
        return lines if limit is None else lines[-limit:] if limit > 0 else []

    @property
    def queued(self) -> int:
        return len(self._queue)

    def counters(self) -> dict[str, int]:
        return {
            "trace_lines": self.frames,  # frame lines (not the file_only ones)
            "trace_dropped": self.dropped,
            "trace_render_errors": self.render_errors,
            "trace_rotations": self.rotations,
        }

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued item is written (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue or self._busy:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then the end line, and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)
        if self._fd is not None:
            end = {"event": "end", "v": FORMAT_VERSION, "frames": self.frames}
            end.update(dropped=self.dropped, render_errors=self.render_errors,
                       rotations=self.rotations, closed_ns=time.monotonic_ns())  # fmt: skip
            self._pending.append(dumps(end) + "\n")
            self._write_pending()  # rotates first if the end line would pass the limit
            os.close(self._fd)
            self._fd = None

    # ------------------------------------------------------------------ writer thread
    _busy = False

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if self._queue:
                self._busy = True
                try:
                    self._drain()
                finally:
                    self._busy = False
            elif stopping:
                return
            else:
                self._stop.wait(self._poll_s)

    def _drain(self) -> None:
        queue = self._queue
        while queue:
            item = queue.popleft()
            try:
                line = self._render(item)
            except Exception:  # a bad item must not stop the trace
                self.render_errors += 1
                if self.render_errors == 1:
                    log.exception("trace: cannot render a frame (later failures only counted)")
                continue
            if line is None:
                continue
            for one in line if isinstance(line, list) else (line,):
                self._take(one)
            time.sleep(0)  # let a waiting engine thread take the GIL between lines
        if self._fd is not None:
            try:
                self._write_pending()
            except OSError as exc:  # a full disk: keep the ring, stop the file
                log.error("trace: writing %s failed (%s); the file stops here",
                          self.options.path, exc)  # fmt: skip
                self._pending.clear()
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None

    def _take(self, line: dict) -> None:
        line["dropped"] = self.dropped
        text = dumps(line)
        self.written += 1
        if line.get("event") not in self._file_only:  # the ring: frames, for /debug/trace
            self.frames += 1
            with self._ring_lock:
                self._ring.append((line["fence"], text))
        if self._fd is not None:
            self._pending.append(text + "\n")

    def _write_pending(self) -> None:
        chunk: list[str] = []
        size = self._size
        limit = self.options.max_bytes
        for text in self._pending:
            if size + len(text) > limit and size > 0:
                self._write_now("".join(chunk))
                chunk = []
                self._rotate()
                size = self._size
            chunk.append(text)
            size += len(text)
        self._pending.clear()
        if chunk:
            self._write_now("".join(chunk))

    # ------------------------------------------------------------------ files
    def _open(self) -> None:
        path = self.options.path
        assert path is not None
        self._fd = open_private(path)
        self._size = 0
        start = {"event": "start", "v": FORMAT_VERSION, "file_index": self.rotations}
        start.update(self._header)
        start["opened_ns"] = time.monotonic_ns()
        self._write_now(dumps(start) + "\n")

    def _write_now(self, text: str) -> None:
        assert self._fd is not None
        data = text.encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self._size += len(data)

    def _rotate(self) -> None:
        path = self.options.path
        assert path is not None and self._fd is not None
        os.close(self._fd)
        self._fd = None
        keep = self.options.keep
        if keep == 0:
            os.unlink(path)
        else:
            for k in range(keep, 1, -1):
                older = f"{path}.{k - 1}"
                if os.path.exists(older):
                    os.replace(older, f"{path}.{k}")
            os.replace(path, f"{path}.1")
        self.rotations += 1
        self._open()
