"""Reading a trace back: ``FILE`` and its rotated predecessors, oldest first.

``read_trace(FILE)`` reads ``FILE.N`` .. ``FILE.1`` (those that exist), then
``FILE``, and returns the frame lines, the request lines, the finish lines, the
scheduler line (format 2) and what the start and end lines say.  A line cut
short (a trace read while it is written, or a killed process) is skipped and
counted, not an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


class TraceFileError(ValueError):
    """The trace cannot be read (missing, or not a trace): the message names the file."""


@dataclass
class Trace:
    frames: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)  # request lines, as written
    finishes: list[dict] = field(default_factory=list)  # finish lines (format 2)
    scheduler: dict | None = None  # the scheduler line, or a later start line's copy
    start: dict = field(default_factory=dict)  # the newest file's start line
    end: dict | None = None  # the end line, when the writer closed the file
    files: list[str] = field(default_factory=list)
    bad_lines: int = 0

    @property
    def world_size(self) -> int:
        if self.start.get("world_size"):
            return int(self.start["world_size"])
        return max((len(f["ranks"]) for f in self.frames), default=0)

    @property
    def dropped(self) -> int:
        """Frames the writer dropped: the end line's count, else the last frame's."""
        if self.end is not None:
            return int(self.end.get("dropped", 0))
        return int(self.frames[-1].get("dropped", 0)) if self.frames else 0


def trace_files(path: str) -> list[str]:
    """``path``'s rotated files that exist, oldest first, then ``path``."""
    rotated = []
    k = 1
    while os.path.exists(f"{path}.{k}"):
        rotated.append(f"{path}.{k}")
        k += 1
    return [*reversed(rotated), path]


def read_trace(path: str) -> Trace:
    if not os.path.isfile(path):
        raise TraceFileError(f"{path}: no such trace file")
    trace = Trace(files=trace_files(path))
    for name in trace.files:
        try:
            with open(name, encoding="utf-8") as fh:
                for text in fh:
                    _take(trace, text)
        except (OSError, UnicodeDecodeError) as exc:
            raise TraceFileError(f"{name}: cannot be read ({exc})") from None
    if not trace.start and not trace.frames:
        raise TraceFileError(f"{path}: not a flare trace (no start or frame line)")
    trace.frames.sort(key=lambda f: f["fence"])
    return trace


def _take(trace: Trace, text: str) -> None:
    text = text.strip()
    if not text:
        return
    try:
        line = json.loads(text)
    except ValueError:
        trace.bad_lines += 1
        return
    if not isinstance(line, dict):
        trace.bad_lines += 1
        return
    event = line.get("event")
    if event == "frame" and isinstance(line.get("ranks"), list) and "fence" in line:
        trace.frames.append(line)
    elif event == "request" and "request" in line and "fence" in line:
        trace.requests.append(line)
    elif event == "finish" and "request" in line:
        trace.finishes.append(line)
    elif event == "scheduler":
        trace.scheduler = line
    elif event == "start":
        trace.start = line
        if trace.scheduler is None and isinstance(line.get("scheduler"), dict):
            trace.scheduler = line["scheduler"]
    elif event == "end":
        trace.end = line
    else:
        trace.bad_lines += 1
