"""Counters and per-frame timing kept by the engine, for benchmarks and tests.

Metric export is out of scope; these are plain numbers a script can read.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class FrameStat:
    """One completed frame.

    ``plan_ns``: when planning of the frame began; ``sent_ns``: just before the
    frame was published; ``completed_ns``: when the last rank's completion was
    observed.  ``host_wall_ns`` = completed - sent (what the scheduler gets);
    ``device_ns``: the maximum positive rank interval.
    """

    fence: int
    graph: str
    lanes: int
    queued: bool
    plan_ns: int
    sent_ns: int
    completed_ns: int
    rank_device_ns: tuple[int, ...]
    readiness_delay_ns: int

    @property
    def host_wall_ns(self) -> int:
        return self.completed_ns - self.sent_ns

    @property
    def device_ns(self) -> int:
        return max((ns for ns in self.rank_device_ns if ns > 0), default=0)


class EngineStats:
    """Thread-safe counters; the engine thread writes, anyone reads."""

    def __init__(self, frame_limit: int = 100_000) -> None:
        self._lock = threading.Lock()
        self.frames_sent = 0
        self.frames_completed = 0
        self.completion_messages = 0  # accepted per-rank completions
        self.ignored_messages = 0  # unknown fence, duplicate rank, unexpected type
        self.tokens_out = 0
        self.requests_submitted = 0
        self.requests_finished = 0  # finished by stop or length
        self.requests_cancelled = 0
        self._frames: deque[FrameStat] = deque(maxlen=frame_limit)
        # Completed frames and their device time by program kind ("decode", ...).
        self.frames_by_kind: dict[str, int] = {}
        self.device_ns_by_kind: dict[str, int] = {}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def record_frame(self, stat: FrameStat, kind: str = "") -> None:
        with self._lock:
            self.frames_completed += 1
            self._frames.append(stat)
            if kind:
                self.frames_by_kind[kind] = self.frames_by_kind.get(kind, 0) + 1
                self.device_ns_by_kind[kind] = self.device_ns_by_kind.get(kind, 0) + stat.device_ns

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """(frames, device ns) completed per program kind."""
        with self._lock:
            return {k: (n, self.device_ns_by_kind[k]) for k, n in self.frames_by_kind.items()}

    def frames(self) -> list[FrameStat]:
        with self._lock:
            return list(self._frames)

    def reset_frames(self) -> None:
        with self._lock:
            self._frames.clear()

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {
                "frames_sent": self.frames_sent,
                "frames_completed": self.frames_completed,
                "completion_messages": self.completion_messages,
                "ignored_messages": self.ignored_messages,
                "tokens_out": self.tokens_out,
                "requests_submitted": self.requests_submitted,
                "requests_finished": self.requests_finished,
                "requests_cancelled": self.requests_cancelled,
            }

    def summary(self) -> dict[str, float | int]:
        """Frame timing over the kept frames.

        ``host_overhead_ratio``: mean host wall over mean device interval of the
        frames dispatched into an empty window (a queued frame's wall includes
        its wait behind the head); 1.0 is the limit.  ``round_trip_ns``: median
        host wall minus device interval of those frames: what the host and the
        transport add to one frame.  ``busy_overhead_ratio``: the span from the
        first dispatch to the last completion over the summed device intervals,
        which counts queued frames too.
        """
        frames = self.frames()
        out: dict[str, float | int] = {"frames": len(frames)}
        if not frames:
            return out
        alone = [f for f in frames if not f.queued and f.device_ns > 0]
        device = sum(f.device_ns for f in frames)
        out["queued_frames"] = sum(1 for f in frames if f.queued)
        out["mean_host_wall_ns"] = statistics.fmean(f.host_wall_ns for f in frames)
        out["mean_device_ns"] = statistics.fmean(f.device_ns for f in frames)
        if alone:
            wall = statistics.fmean(f.host_wall_ns for f in alone)
            dev = statistics.fmean(f.device_ns for f in alone)
            out["host_overhead_ratio"] = wall / dev
            out["round_trip_ns"] = statistics.median(f.host_wall_ns - f.device_ns for f in alone)
        if device > 0:
            span = max(f.completed_ns for f in frames) - min(f.sent_ns for f in frames)
            out["busy_overhead_ratio"] = span / device
        return out
