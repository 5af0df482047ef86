"""The coordinator's scheduler: plan, commit, complete, publish.

Pure Python: no torch, no sockets, no clocks.  Time enters only through
:meth:`Scheduler.advance_to`.  One decision is ``plan()`` (a pure function of
state returning an immutable :class:`ScheduledPlan` or ``None``), then
``commit(plan, fence)`` when the caller dispatches it, ``complete(fence, ...)``
when the ranks report, and ``published_output(handle, fence)`` when the
frontend makes output visible.

:class:`Scheduler` is built in layers, one concept each:
:mod:`~runtime.coordinator.admission` (the state; admission, cancellation,
memory), :mod:`~runtime.coordinator.planning` (``plan``, ``commit``),
:mod:`~runtime.coordinator.completion` (``complete`` and its sidecar forms,
``published_output``); this module adds what callers read.  It satisfies
:class:`runtime.coordinator.interface.EngineScheduler`.
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime.coordinator.completion import SchedulerCompletion
from runtime.coordinator.plan import TraceRecord
from runtime.coordinator.requests import GenerationStart, Request, RequestHandle


class Scheduler(SchedulerCompletion):
    """The coordinator's scheduler (module docstring); read-only views below."""

    # ---------------------------------------------------------- inspection
    def drain_trace(self) -> list[TraceRecord]:
        return self._trace.drain()

    def trim_trace(self, keep: int) -> None:
        """Drop all but the newest ``keep`` undrained records (not counted as dropped:
        the caller reads none of them)."""
        self._trace.trim(keep)

    @property
    def trace_dropped(self) -> int:
        """Trace records dropped undrained (the buffer holds the newest ``TRACE_LIMIT``)."""
        return self._trace.dropped

    def request(self, handle: RequestHandle) -> Request | None:
        return self._requests.get(handle.id)

    def page_table(self, handle: RequestHandle) -> list[int]:
        r = self._requests.get(handle.id)
        return list(r.pages) if r is not None else []

    @property
    def in_flight(self) -> int:
        return len(self._queue)

    @property
    def queue_fences(self) -> list[int]:
        return [f.fence for f in self._queue.frames]

    @property
    def running(self) -> int:
        return sum(1 for r in self._resident.values() if r.runnable)

    def generation_start(self, handle: RequestHandle) -> GenerationStart | None:
        """How ``handle``'s current generation begins on the ranks (cached prefix,
        copies, restored output): what its generation's first frame carries."""
        r = self._requests.get(handle.id)
        return r.start if r is not None else None

    def request_tokens(self, handle: RequestHandle) -> tuple[int, ...]:
        """``handle``'s prompt and committed output token ids."""
        r = self._requests.get(handle.id)
        return r.known_tokens() if r is not None else ()

    @property
    def waiting(self) -> int:
        return self._res.num_waiting

    @property
    def free_pages(self) -> int:
        """Pages an allocation can obtain now: free ones and idle cached ones."""
        return self._res.cache.available

    def memory_stats(self) -> dict[str, int]:
        """KV memory and prefix-cache counters (metrics)."""
        cache = self._res.cache
        return {
            "kv_pages_total": cache.num_pages,
            "kv_pages_free": cache.free_count,
            "kv_pages_held": cache.held_count,
            "kv_pages_cached": cache.cached_count,
            "kv_pages_cached_idle": cache.idle_count,
            "prefix_cache_queried_tokens": cache.queried_tokens,
            "prefix_cache_hit_tokens": cache.hit_tokens,
            "prefix_cache_evicted_pages": cache.evicted_pages,
            "preemptions": self._res.preemptions,
            "prompt_tokens_computed": self.prompt_tokens_computed,
        }

    def check_page_accounting(self) -> None:
        """Raise unless every page is free, held or cached exactly as recorded."""
        self._res.check()

    def active_requests(self) -> Iterable[Request]:
        return list(self._requests.values())
