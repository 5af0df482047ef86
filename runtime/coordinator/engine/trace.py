"""The engine's side of the live plan trace (``flare run --trace FILE``).

The engine thread does three cheap things per frame: note when each rank's
completion arrived (:meth:`FrameTrace.arrived`), and once the frame is applied
hand the dispatch, its scheduler trace record and the time to the writer's
queue (:meth:`FrameTrace.applied`).  Per request it queues one more item, when
the scheduler admits it (:meth:`FrameTrace.admitted`).  Everything else (clock estimates, the JSON
line, the file) happens on the writer thread (:mod:`runtime.trace.writer`).
Round-trip probes (empty frames) write no line but still feed the clock
estimates when the ranks report timestamps.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from runtime.coordinator.engine.frames import Dispatch
from runtime.coordinator.plan import TraceRecord
from runtime.trace.clocks import RankClocks
from runtime.trace.lines import frame_line, request_line, start_fields
from runtime.trace.writer import TraceOptions, TraceWriter

STALE_LIMIT = 1024  # records held before those of applied fences are swept


class FrameTrace:
    """Frames of one engine, traced to a :class:`TraceWriter`."""

    def __init__(
        self, options: TraceOptions, world: int, model: str = "", programs: tuple[str, ...] = ()
    ) -> None:
        self._world = world
        self.clocks = RankClocks(world)
        self._records: dict[int, TraceRecord] = {}  # committed, not yet applied, by fence
        self._arrivals: dict[int, list[int]] = {}  # per fence, per rank (coordinator clock)
        header = start_fields(model, world, programs, os.getpid())
        self.writer = TraceWriter(options, self._render, header, file_only=("request",))

    # ------------------------------------------------------------------ engine thread
    def arrived(self, fence: int, rank: int, now_ns: int) -> None:
        arrivals = self._arrivals.get(fence)
        if arrivals is None:
            arrivals = self._arrivals[fence] = [0] * self._world
        arrivals[rank] = now_ns

    def applied(self, dispatch: Dispatch, now_ns: int, records: list[TraceRecord]) -> None:
        """``dispatch`` was applied at ``now_ns``; ``records``: the scheduler's drained trace."""
        records_by_fence = self._records
        for record in records:
            records_by_fence[record.fence] = record
        fence = dispatch.fence
        if len(records_by_fence) > STALE_LIMIT:  # frames applied in fence order: older is stale
            for stale in [f for f in records_by_fence if f < fence]:
                del records_by_fence[stale]
        self.writer.offer(
            (self._records.pop(fence, None), dispatch, self._arrivals.pop(fence, None), now_ns)
        )

    def admitted(
        self,
        request: int,
        submitted_ns: int,
        admitted_ns: int,
        prompt_tokens: int,
        max_tokens: int,
        next_fence: int,
    ) -> None:
        """The scheduler admitted ``request``; ``next_fence``: the next frame's fence."""
        self.writer.offer(
            ("request", next_fence, request, submitted_ns, admitted_ns, prompt_tokens, max_tokens)
        )

    # ------------------------------------------------------------------ any thread
    def lines_since(self, fence: int, limit: int | None = None) -> list[str]:
        return self.writer.lines_since(fence, limit)

    def counters(self) -> dict[str, int]:
        return self.writer.counters()

    def close(self) -> None:
        self.writer.close()

    # ------------------------------------------------------------------ writer thread
    def _render(self, item: tuple[Any, ...]) -> dict | None:
        if item[0] == "request":
            return request_line(*item[1:])
        record, dispatch, arrivals, applied_ns = item
        answers = dispatch.answers
        completions = [answers[rank] for rank in range(self._world)]
        if arrivals is not None:
            for rank, completion in enumerate(completions):
                times: Sequence[int] = getattr(completion, "host_times", ())
                if len(times) == 4 and arrivals[rank]:
                    self.clocks.observe(rank, dispatch.sent_ns, times[0], times[3], arrivals[rank])
        if dispatch.plan is None:  # a round-trip probe: clocks only
            return None
        clocks = [self.clocks.estimate(rank) for rank in range(self._world)]
        return frame_line(
            dispatch.fence,
            record,
            dispatch.plan,
            dispatch.queued,
            dispatch.plan_ns,
            dispatch.sent_ns,
            applied_ns,
            completions,
            arrivals,
            clocks,
        )
