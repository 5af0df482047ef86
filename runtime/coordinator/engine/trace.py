"""The engine's side of the live plan trace (``flare run --trace FILE``).

The engine thread does three cheap things per frame: note when each rank's
completion arrived (:meth:`FrameTrace.arrived`), and once the frame is applied
hand the dispatch, its scheduler trace record and the time to the writer's
queue (:meth:`FrameTrace.applied`).  Per request it queues one more item, when
the scheduler admits it (:meth:`FrameTrace.admitted`: the stream and the spec
themselves, both immutable, no field copied), and one when it is cancelled
(:meth:`FrameTrace.cancelled`); the first admission also queues the
scheduler, whose configuration and policy are frozen.  Everything else (clock
estimates, the JSON lines, prompt digests, each request's outcome
(:mod:`runtime.trace.outcomes`), the file) happens on the writer thread
(:mod:`runtime.trace.writer`).  Round-trip probes (empty frames) write no line
but still feed the clock estimates when the ranks report timestamps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from runtime.coordinator.config import PRESETS
from runtime.coordinator.engine.frames import Dispatch
from runtime.coordinator.engine.stream import RequestStream
from runtime.coordinator.plan import TraceRecord
from runtime.coordinator.requests import RequestSpec
from runtime.trace.clocks import RankClocks
from runtime.trace.lines import frame_line, request_line, scheduler_fields, start_fields
from runtime.trace.outcomes import RequestLedger, prompt_digests
from runtime.trace.writer import TraceOptions, TraceWriter

STALE_LIMIT = 1024  # records held before those of applied fences are swept
FILE_ONLY = ("request", "finish", "scheduler")  # lines kept out of the /debug/trace ring
DEFAULT_PAGE_SIZE = 16  # prompt digests' page, when the scheduler states none


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
        self._described = False  # the scheduler line is queued (engine thread)
        self._page_size = DEFAULT_PAGE_SIZE  # writer thread, from the scheduler line
        self._ledger = RequestLedger()  # writer thread
        self._last_fence = 0  # writer thread: the last frame rendered
        self.writer = TraceWriter(options, self._render, header, file_only=FILE_ONLY)

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
        stream: RequestStream,
        spec: RequestSpec,
        admitted_ns: int,
        next_fence: int,
        scheduler: object,
    ) -> None:
        """The scheduler admitted ``request`` (``stream``'s, as ``spec``) at
        ``admitted_ns``; ``next_fence``: the next frame's fence."""
        if not self._described:
            self._described = True
            self.writer.offer(("scheduler", next_fence, scheduler))
        self.writer.offer(("request", next_fence, request, stream, spec, admitted_ns))

    def cancelled(self, request: int, at_ns: int, next_fence: int) -> None:
        """``request`` was cancelled at ``at_ns`` (it may have finished already)."""
        self.writer.offer(("cancel", next_fence, request, at_ns))

    # ------------------------------------------------------------------ any thread
    def lines_since(self, fence: int, limit: int | None = None) -> list[str]:
        return self.writer.lines_since(fence, limit)

    def counters(self) -> dict[str, int]:
        return self.writer.counters()

    def close(self) -> None:
        """Requests still open end "unfinished"; then the end line and the file."""
        self.writer.offer(("close", time.monotonic_ns()))
        self.writer.close()

    # ------------------------------------------------------------------ writer thread
    def _render(self, item: tuple[Any, ...]) -> dict | list[dict] | None:
        match item[0]:
            case "request":
                return self._request_line(*item[1:])
            case "scheduler":
                fields = scheduler_fields(item[2], PRESETS)
                config = fields["config"] or {}
                self._page_size = int(config.get("page_size") or DEFAULT_PAGE_SIZE)
                self.writer.add_header({"scheduler": fields})
                return {"event": "scheduler", "fence": item[1], **fields}
            case "cancel":
                return self._ledger.cancelled(item[2], item[1], item[3])
            case "close":
                return self._ledger.close(self._last_fence + 1, item[1])
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
        line = frame_line(
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
        self._last_fence = dispatch.fence
        ends = self._ledger.frame(dispatch.fence, line["lanes"], dispatch.ignore_eos, applied_ns)
        return [line, *ends] if ends else line

    def _request_line(
        self, fence: int, request: int, stream: RequestStream, spec: RequestSpec, admitted_ns: int
    ) -> dict:
        self._ledger.admitted(request, spec.max_output_tokens)
        pages, tail = prompt_digests(stream.prompt_token_ids, self._page_size, spec.cache_salt)
        return request_line(
            fence, request, stream.submitted_ns, admitted_ns, spec.prompt_len,
            spec.max_output_tokens, message_endpoints=list(spec.message_endpoints),
            boundaries=list(spec.boundaries), ignore_eos=stream.ignore_eos, group=spec.group,
            prompt_pages=pages, prompt_tail=tail,
        )  # fmt: skip
