"""Rate-limited logging: a flood of one message becomes a burst and a count.

A process that logs the same thing in a loop (asyncio's accept loop out of
file descriptors, a client hammering a refused route) can write a million lines
in seconds.  :class:`RateLimitFilter` lets through at most ``burst`` records of
each kind per ``interval_s`` seconds and drops the rest; when the interval is
over it writes one summary line counting what it dropped::

    [frontend] ERROR suppressed 2041 more like: socket.accept() out of system resource (in 10.0 s)

A record's kind is its logger's name, its level and its message template (the
format string before ``%`` arguments; a message without arguments counts with
its digits masked and only its first line, so ``fd=23`` and ``fd=24`` are one
kind).  Use::

    from runtime.logs import basic_config, install_rate_limit

    basic_config(logging.INFO, "%(message)s")  # a process's own basicConfig, guarded
    install_rate_limit()                     # every handler of the root logger
    install_rate_limit(handler, burst=5, interval_s=60.0)
    install_rate_limit(logging.getLogger("uvicorn"))  # that logger's handlers

Installing it twice on a handler keeps one filter.  The filter is thread-safe;
its summaries are written by the handler it guards (the summary of an interval
comes with the next record of any kind, or from a timer when the flood stopped,
or at exit).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable

__all__ = [
    "DEFAULT_BURST",
    "RATE_LIMIT_WINDOW_S",
    "RateLimitFilter",
    "basic_config",
    "install_rate_limit",
]

DEFAULT_BURST = 10
RATE_LIMIT_WINDOW_S = 10.0
MAX_KINDS = 4096  # kinds tracked at once; the oldest windows are forgotten beyond
_DIGITS = re.compile(r"\d+")
_SUMMARY_ATTR = "flare_rate_limit_summary"


class _Window:
    __slots__ = ("level", "logger", "passed", "sample", "start", "suppressed")

    def __init__(self, start: float, record: logging.LogRecord) -> None:
        self.start = start
        self.passed = 0
        self.suppressed = 0
        self.level = record.levelno
        self.logger = record.name
        self.sample = ""


class RateLimitFilter(logging.Filter):
    """At most ``burst`` records of a kind per ``interval_s`` seconds, then one
    summary line per interval counting the suppressed ones (see the module
    docstring).  ``emit``: where summaries go (a handler's ``handle``)."""

    def __init__(
        self,
        burst: int = DEFAULT_BURST,
        interval_s: float = RATE_LIMIT_WINDOW_S,
        emit: Callable[[logging.LogRecord], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.burst = burst
        self.interval_s = interval_s
        self.emit = emit
        self.clock = clock
        self.suppressed_total = 0  # records dropped since the filter was made
        self._windows: dict[tuple, _Window] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    @staticmethod
    def kind(record: logging.LogRecord) -> tuple:
        msg = record.msg
        if isinstance(msg, str) and not record.args:
            msg = _DIGITS.sub("#", msg.split("\n", 1)[0][:200])
        elif not isinstance(msg, str):
            msg = type(msg).__name__
        return (record.name, record.levelno, msg)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _SUMMARY_ATTR, False):
            return True
        now = self.clock()
        key = self.kind(record)
        with self._lock:
            due = self._expired(now)
            window = self._windows.get(key)
            if window is None or now - window.start >= self.interval_s:
                if window is not None and window.suppressed:
                    due.append(window)
                window = _Window(now, record)
                self._windows.pop(key, None)
                self._windows[key] = window
                if len(self._windows) > MAX_KINDS:
                    oldest = next(iter(self._windows))
                    dropped = self._windows.pop(oldest)
                    if dropped.suppressed:
                        due.append(dropped)
            if window.passed < self.burst:
                window.passed += 1
                allowed = True
            else:
                if not window.suppressed:
                    window.sample = _first_line(record)
                window.suppressed += 1
                self.suppressed_total += 1
                allowed = False
                self._arm_timer(window.start + self.interval_s - now)
        self._summarize(due, now)
        return allowed

    def flush(self) -> None:
        """Write the summaries of every interval with suppressed records now."""
        now = self.clock()
        with self._lock:
            due = [w for w in self._windows.values() if w.suppressed]
            for key in [k for k, w in self._windows.items() if w.suppressed]:
                del self._windows[key]
        self._summarize(due, now)

    # ------------------------------------------------------------------ internals

    def _expired(self, now: float) -> list[_Window]:
        """Windows over with suppressed records (their summaries are due); the
        lock is held."""
        due = []
        for key, window in list(self._windows.items()):
            if now - window.start >= self.interval_s:
                del self._windows[key]
                if window.suppressed:
                    due.append(window)
            else:
                break  # later windows started later (insertion order)
        return due

    def _arm_timer(self, delay: float) -> None:
        if self._timer is not None:
            return
        timer = threading.Timer(max(0.0, delay) + 0.01, self._on_timer)
        timer.daemon = True
        self._timer = timer
        timer.start()

    def _on_timer(self) -> None:
        now = self.clock()
        with self._lock:
            self._timer = None
            due = self._expired(now)
            pending = [w for w in self._windows.values() if w.suppressed]
            if pending:
                self._arm_timer(min(w.start for w in pending) + self.interval_s - now)
        self._summarize(due, now)

    def _summarize(self, windows: list[_Window], now: float) -> None:
        if not windows or self.emit is None:
            return
        for window in windows:
            seconds = min(now - window.start, self.interval_s)
            record = logging.LogRecord(
                window.logger,
                window.level,
                __file__,
                0,
                "suppressed %d more like: %s (in %.1f s)",
                (window.suppressed, window.sample, seconds),
                None,
            )
            setattr(record, _SUMMARY_ATTR, True)
            with contextlib.suppress(Exception):  # a logging failure must not break the caller
                self.emit(record)


def _first_line(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:
        text = str(record.msg)
    return text.split("\n", 1)[0][:300]


_installed: weakref.WeakSet[RateLimitFilter] = weakref.WeakSet()


def _flush_all() -> None:
    for flt in list(_installed):
        flt.flush()


atexit.register(_flush_all)


def install_rate_limit(
    target: logging.Handler | logging.Logger | None = None,
    *,
    burst: int = DEFAULT_BURST,
    interval_s: float = RATE_LIMIT_WINDOW_S,
) -> list[RateLimitFilter]:
    """Rate-limit what ``target`` writes: a handler, or each handler of a logger
    (the root logger when None).  At most ``burst`` records of one kind (logger,
    level, message template) per ``interval_s`` seconds pass; one summary line
    per interval counts the rest.  Returns the filters (one per handler; a
    handler that has one keeps it)."""
    if target is None:
        target = logging.getLogger()
    handlers = [target] if isinstance(target, logging.Handler) else list(target.handlers)
    out = []
    for handler in handlers:
        existing = next((f for f in handler.filters if isinstance(f, RateLimitFilter)), None)
        if existing is not None:
            out.append(existing)
            continue
        flt = RateLimitFilter(burst, interval_s, emit=handler.handle)
        handler.addFilter(flt)
        _installed.add(flt)
        out.append(flt)
    return out


def basic_config(level: int | str, fmt: str) -> list[RateLimitFilter]:
    """A process's own logging: :func:`logging.basicConfig` with ``level`` and
    ``fmt``, its handler rate-limited.  Like basicConfig it changes nothing when
    the root logger already has handlers (a program that embeds this one, a test
    runner): their handlers, and what they let through, are theirs."""
    root = logging.getLogger()
    if root.handlers:
        return []
    logging.basicConfig(level=level, format=fmt)
    return [flt for handler in root.handlers for flt in install_rate_limit(handler)]
