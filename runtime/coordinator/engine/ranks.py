"""The engine's view of each rank: questions asked of every rank, and per-rank metrics.

:class:`RankQueries` tracks the control questions the engine thread put to
every rank (``inspect``, answered by a
:class:`~runtime.transport.inspection.RankStatus`; ``profile``, answered by
``Control("profiled")``), matched by nonce; a caller in another thread waits on
:class:`RankAsk.done`.  :class:`RankMetrics` accumulates, from every rank's
completions, its device seconds by selection class, its host seconds by stage
(the ranks' stage names), its last completed fence and the skew of each frame
(the largest minus the smallest rank interval), plus each rank's memory from
its latest inspection, and renders them as the flat ``name:label:...`` values
of :meth:`Engine.metrics` (exported by :mod:`runtime.frontend.metrics`).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from runtime.transport.completion import STAGE_NAMES, Completion
from runtime.transport.control import Control
from runtime.transport.inspection import RankStatus

# The skew histogram's upper bounds, seconds (the last bucket is +Inf).
SKEW_BUCKETS_S = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
# Each rank's memory is re-read this often while someone reads the metrics.
REFRESH_NS = 2_000_000_000
REFRESH_WANTED_NS = 60_000_000_000  # ... that long after the last read
REFRESH_TIMEOUT_NS = 10_000_000_000


@dataclass
class RankAsk:
    """One question to every rank; ``answers`` by rank once ``done`` is set
    (all of them, or those that came before the deadline or the shutdown)."""

    command: str
    count: int = 0
    timeout_ns: int = REFRESH_TIMEOUT_NS  # from when the engine thread sends it
    nonce: int = 0
    deadline_ns: int = 0
    answers: dict[int, RankStatus | Control] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    internal: bool = False  # the engine's own refresh of the metrics


class RankQueries:
    """Questions in flight, by nonce (engine thread only)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._nonces = itertools.count(1)
        self._open: dict[int, RankAsk] = {}

    def __bool__(self) -> bool:
        return bool(self._open)

    def open(self, ask: RankAsk, now_ns: int) -> Control:
        """Register ``ask``; the control message to publish for it."""
        ask.nonce = next(self._nonces)
        ask.deadline_ns = now_ns + ask.timeout_ns
        self._open[ask.nonce] = ask
        return Control(ask.command, nonce=ask.nonce, count=ask.count)

    def take(self, message: object) -> RankAsk | None:
        """Record ``message`` if it answers an open question; the question, if
        this answer completed it."""
        if isinstance(message, RankStatus):
            command = "inspect"
        elif isinstance(message, Control) and message.command == "profiled":
            command = "profile"
        else:
            return None
        ask = self._open.get(message.nonce)
        if ask is None or ask.command != command or message.rank in ask.answers:
            return None
        ask.answers[message.rank] = message
        if len(ask.answers) < self.world:
            return None
        del self._open[ask.nonce]
        ask.done.set()
        return ask

    def is_answer(self, message: object) -> bool:
        return isinstance(message, RankStatus) or (
            isinstance(message, Control) and message.command == "profiled"
        )

    def expire(self, now_ns: int) -> list[RankAsk]:
        """Questions past their deadline, done with the answers that came (late
        answers are ignored)."""
        late = [ask for ask in self._open.values() if now_ns > ask.deadline_ns]
        for ask in late:
            del self._open[ask.nonce]
            ask.done.set()
        return late

    def close(self) -> None:
        for ask in self._open.values():
            ask.done.set()
        self._open.clear()


class RankMetrics:
    """Per-rank counters and gauges (written by the engine thread, read by any)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._lock = threading.Lock()
        self._device_ns: dict[tuple[int, str], int] = {}
        self._stage_ns = [[0] * len(STAGE_NAMES) for _ in range(world)]
        self._last_fence = [-1] * world
        self._skew_counts = [0] * (len(SKEW_BUCKETS_S) + 1)
        self._skew_sum_s = 0.0
        self._statuses: dict[int, RankStatus] = {}
        self._wanted_until_ns = 0
        self._refreshed_ns = 0
        self.refreshing = False

    def record(self, answers: Mapping[int, Completion], selection_class: str | None) -> None:
        """One applied frame's completions (``selection_class`` None: an empty frame)."""
        with self._lock:
            for rank, answer in answers.items():
                self._last_fence[rank] = max(self._last_fence[rank], answer.fence)
                if selection_class is None:
                    continue
                key = (rank, selection_class)
                self._device_ns[key] = self._device_ns.get(key, 0) + answer.device_ns
                for i, ns in enumerate(answer.stage_ns):
                    self._stage_ns[rank][i] += ns
            if selection_class is None:
                return
            intervals = [answer.device_ns for answer in answers.values()]
            skew_s = (max(intervals) - min(intervals)) / 1e9
            self._skew_counts[bisect.bisect_left(SKEW_BUCKETS_S, skew_s)] += 1
            self._skew_sum_s += skew_s

    def wanted(self, now_ns: int) -> None:
        """Someone reads the metrics: keep the ranks' memory fresh for a while."""
        self._wanted_until_ns = now_ns + REFRESH_WANTED_NS

    def refresh_due(self, now_ns: int) -> bool:
        return (
            not self.refreshing
            and now_ns < self._wanted_until_ns
            and now_ns - self._refreshed_ns >= REFRESH_NS
        )

    def refreshed(self, statuses: Mapping[int, RankStatus], now_ns: int) -> None:
        with self._lock:
            self._statuses.update(statuses)
        self._refreshed_ns = now_ns
        self.refreshing = False

    def values(self) -> dict[str, float]:
        """``rank_device_seconds_total:RANK:CLASS``, ``rank_host_seconds_total:RANK:STAGE``,
        ``rank_last_fence:RANK``, ``rank_rss_bytes:RANK``, ``rank_device_allocated_bytes:RANK``
        and ``rank_device_reserved_bytes:RANK`` (ranks with a device),
        ``rank_skew_seconds_bucket:LE`` (cumulative), ``rank_skew_seconds_sum``,
        ``rank_skew_seconds_count``."""
        out: dict[str, float] = {}
        with self._lock:
            for (rank, name), ns in sorted(self._device_ns.items()):
                out[f"rank_device_seconds_total:{rank}:{name}"] = ns / 1e9
            for rank in range(self.world):
                for stage, ns in zip(STAGE_NAMES, self._stage_ns[rank]):
                    out[f"rank_host_seconds_total:{rank}:{stage}"] = ns / 1e9
                out[f"rank_last_fence:{rank}"] = float(self._last_fence[rank])
            for rank, status in sorted(self._statuses.items()):
                out[f"rank_rss_bytes:{rank}"] = float(status.rss_bytes)
                if status.device != "cpu":
                    out[f"rank_device_allocated_bytes:{rank}"] = float(
                        status.device_allocated_bytes
                    )
                    out[f"rank_device_reserved_bytes:{rank}"] = float(status.device_reserved_bytes)
            total = 0
            for bound, count in zip((*SKEW_BUCKETS_S, float("inf")), self._skew_counts):
                total += count
                out[f"rank_skew_seconds_bucket:{bound:g}"] = float(total)
            out["rank_skew_seconds_sum"] = self._skew_sum_s
            out["rank_skew_seconds_count"] = float(total)
        return out
