"""DirectScheduler: the diagnostic scheduler of ``flare run --direct``.

A drop-in for :class:`runtime.coordinator.scheduler.Scheduler` as the engine
uses it (it satisfies :class:`runtime.coordinator.interface.EngineScheduler`:
``admit``, ``advance_to``, ``plan``, ``commit``, ``complete``, ``cancel``,
``published_output``, ``drain_trace``, ``request``, ``page_table`` and the
occupancy properties; no generation starts, memory counters or speculative
rounds), built on its own selection
(:mod:`runtime.direct.selection`) and costs (:mod:`runtime.direct.cost`) so
that a fault which persists under it lies in the ranks, not in the
coordinator's scheduler.  It shares only plain data types with the coordinator:
plans, lanes, records, request specs and handles, slots and pages.

Rules, in order of precedence at each ``plan()``:

1. Prefill first: while any resident request is still in its prompt, the
   oldest one gets the next chunk, alone, once nothing is in flight (prefill
   drains the window); nothing else is submitted meanwhile.
2. Otherwise a decode round (value per time, discovery first).  A measured
   round may go behind one measured decode round in flight (two frames at
   most); a discovery round needs an empty window.  A request is in at most
   one frame in flight.

Pure Python: no torch, no sockets, no clocks; time enters only through
:meth:`DirectScheduler.advance_to`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.errors import (
    CommitError,
    CompletionError,
    PublicationError,
    SchedulerError,
)
from runtime.coordinator.plan import (
    TRACE_LIMIT,
    LanePhase,
    LaneWork,
    ScheduledPlan,
    SelectionReason,
    TraceBuffer,
    TraceRecord,
    commit_record,
)
from runtime.coordinator.records import (
    CompletionRecord,
    Confidence,
    ExecutionTiming,
    GeneratedToken,
    validate_records,
    validate_timing,
)
from runtime.coordinator.requests import GenerationStart, Phase, RequestHandle, RequestSpec
from runtime.direct.config import DirectConfig
from runtime.direct.cost import DirectCatalog, cost_sample_ns
from runtime.direct.residency import DirectRequest, DirectResidency
from runtime.direct.selection import (
    Choice,
    choose_decode,
    choose_prefill,
    decoders_by_service,
    oldest_prompt,
)

log = logging.getLogger("runtime.direct")


@dataclass(slots=True)
class InFlight:
    """A committed frame awaiting its completion."""

    fence: int
    plan: ScheduledPlan
    requests: tuple[DirectRequest, ...]  # lane order
    exclusive: bool  # needed an empty window; nothing may queue behind it
    expected_end_ns: int


class DirectScheduler:
    """FCFS prefills and value-per-time decode rounds, with a 7/8 cost average."""

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        config: SchedulerConfig | None = None,
        direct: DirectConfig | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.direct = direct or DirectConfig()
        self.catalog = DirectCatalog(
            catalog, self.direct.sample_weight, self.direct.estimate_ttl_ns
        )
        if not self.catalog.programs(GraphKind.PREFILL):
            raise SchedulerError("direct mode needs at least one prefill program")
        if not self.catalog.programs(GraphKind.DECODE):
            raise SchedulerError("direct mode needs at least one decode program")
        prefills = len(self.catalog.programs(GraphKind.PREFILL))
        decodes = len(self.catalog.programs(GraphKind.DECODE))
        # A warning: the deployment is not running the product's scheduler, and an
        # operator must see that at the default log level.
        log.warning(
            "direct mode: the diagnostic scheduler (FCFS prefills, value-per-time decode "
            "rounds, 7/8 cost average reverting after %g s) with %d prefill and %d decode "
            "programs, %d others ignored",
            self.direct.estimate_ttl_ns / 1e9,
            prefills,
            decodes,
            len(self.catalog) - prefills - decodes,
        )
        self.now_ns = 0
        self._residency = DirectResidency(
            self.config.max_slots, self.config.num_pages, self.config.page_size
        )
        self._window: deque[InFlight] = deque()
        self._last_fence: int | None = None
        self._next_plan = 0
        self._served = 0  # lane sequence across commits, for least-recently-served order
        self.executions = {reason: 0 for reason in SelectionReason}
        self.execution_ns = {reason: 0 for reason in SelectionReason}
        self._trace = TraceBuffer(TRACE_LIMIT)

    # ------------------------------------------------------------------ time
    def advance_to(self, now_ns: int) -> None:
        """Move the scheduler's clock; estimates 30 s without a sample revert."""
        if isinstance(now_ns, bool) or not isinstance(now_ns, int):
            raise SchedulerError(f"now_ns must be an integer of ns, got {now_ns!r}")
        if now_ns < self.now_ns:
            raise SchedulerError(f"time cannot go backwards: {now_ns} < {self.now_ns}")
        self.now_ns = now_ns
        self.catalog.expire(now_ns)

    # ------------------------------------------------------------- admission
    def admit(self, spec: RequestSpec) -> RequestHandle:
        """Queue a request (FCFS residency); SchedulerError if it can never fit or
        asks for its prompt's scores (direct mode runs no scored prefill)."""
        if isinstance(spec, RequestSpec) and spec.score_prompt:
            raise SchedulerError("score_prompt: direct mode runs no scored prefill programs")
        return self._residency.admit(spec).handle

    def cancel(self, handle: RequestHandle) -> bool:
        """Stop selecting ``handle`` now; its slot and pages stay owned until its
        frame in flight (if any) completes.  False if it is gone or finished."""
        r = self._residency.requests.get(handle.id) if isinstance(handle, RequestHandle) else None
        if r is None or r.cancelled or r.finished:
            return False
        r.cancelled = True
        if r.resident:
            self._residency.retire_if_done(r)
        else:
            self._residency.forget_waiting(r)
        return True

    # ----------------------------------------------------------- selection
    def plan(self) -> ScheduledPlan | None:
        """The next program to submit, or None when nothing may be submitted now."""
        window = self._window
        if len(window) >= self.direct.max_in_flight or any(f.exclusive for f in window):
            return None
        residents = list(self._residency.resident.values())
        prompt = oldest_prompt(residents)
        if prompt is not None:  # prefill first, alone in the window
            if window:
                return None
            choice = choose_prefill(prompt, self.catalog)
            return None if choice is None else self._build(choice, exclusive=True)
        choice = choose_decode(decoders_by_service(residents), self.catalog)
        if choice is None:
            return None
        if choice.discovery and window:
            return None  # discovery waits for an empty window and completion feedback
        return self._build(choice, exclusive=choice.discovery)

    def _build(self, choice: Choice, exclusive: bool) -> ScheduledPlan:
        graph = choice.graph
        lanes = []
        for r in choice.requests:
            if graph.kind is GraphKind.PREFILL:
                start, tokens = r.consumed_prompt, choice.prompt_tokens
                ends = start + tokens == r.spec.prompt_len
                lanes.append(
                    LaneWork(
                        r.handle,
                        r.slot,
                        r.generation,
                        LanePhase.PREFILL,
                        start,
                        tokens,
                        r.committed_output,
                        1 if ends else 0,
                        1.0 if ends else 0.0,
                        0.0,
                        float(tokens),
                    )
                )
            else:
                lanes.append(
                    LaneWork(
                        r.handle,
                        r.slot,
                        r.generation,
                        LanePhase.DECODE,
                        r.spec.prompt_len,
                        0,
                        r.committed_output,
                        1,
                        1.0,
                        1.0,
                        1.0,
                    )
                )
        self._next_plan += 1
        return ScheduledPlan(
            plan_id=self._next_plan,
            graph=graph,
            lanes=tuple(lanes),
            estimated_duration_ns=choice.estimate_ns,
            reason=SelectionReason.DISCOVERY if choice.discovery else SelectionReason.ORDINARY,
            requires_empty_window=exclusive,
            planned_at_ns=self.now_ns,
            expected_start_ns=self._expected_end(),
            value_rate_scaled=choice.rate,
            log_scale=0.0,
            useful_value=choice.value,
            catalog_version=0,
        )

    def _expected_end(self) -> int:
        """When the frames in flight should be done (now, if none)."""
        return max(self.now_ns, self._window[-1].expected_end_ns) if self._window else self.now_ns

    # --------------------------------------------------------------- commit
    def commit(self, plan: ScheduledPlan, fence: int) -> None:
        """Submit ``plan`` as ``fence``; rechecks everything, changes nothing on refusal."""
        if not isinstance(plan, ScheduledPlan):
            raise CommitError("commit takes a ScheduledPlan")
        if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
            raise CommitError(f"fence must be a non-negative integer, got {fence!r}")
        if self._last_fence is not None and fence <= self._last_fence:
            raise CommitError(f"fence {fence} is not newer than fence {self._last_fence}")
        graph = plan.graph
        if graph not in self.catalog:
            raise CommitError(f"graph not in catalog: {graph.describe()}")
        if graph.kind not in (GraphKind.PREFILL, GraphKind.DECODE):
            raise CommitError(f"direct mode runs prefill and decode programs, not {graph.kind}")
        entry = self.catalog.entry(graph)
        exclusive = (
            plan.requires_empty_window or graph.kind is GraphKind.PREFILL or not entry.measured
        )
        window = self._window
        if len(window) >= self.direct.max_in_flight:
            raise CommitError(f"{len(window)} frames are in flight already")
        if window and (exclusive or any(f.exclusive for f in window)):
            raise CommitError("plan needs an empty window (completion feedback) first")
        requests = self._check_lanes(plan)

        # -- nothing below may fail ----------------------------------------------
        for r in requests:  # in lane order, so a round's leftovers keep their turn
            self._served += 1
            r.fence = fence
            r.last_served = self._served
        window.append(
            InFlight(fence, plan, requests, exclusive, self._expected_end() + entry.estimate_ns)
        )
        self._last_fence = fence
        self._trace.append(
            commit_record(
                plan, fence, self.now_ns, entry.estimate_ns, entry.observation_age_ns(self.now_ns)
            )
        )

    def _check_lanes(self, plan: ScheduledPlan) -> tuple[DirectRequest, ...]:
        """The lanes' requests, or CommitError naming the broken lane invariant."""
        graph = plan.graph
        lanes = plan.lanes
        if not lanes:
            raise CommitError("plan has no lanes")
        if len(lanes) > graph.batch_capacity:
            raise CommitError("plan has more lanes than its batch capacity")
        prefill = graph.kind is GraphKind.PREFILL
        if prefill and (len(lanes), lanes[0].phase) != (1, LanePhase.PREFILL):
            raise CommitError("a prefill plan has exactly one lane, its prompt row")
        if not prefill and any(lane.phase is not LanePhase.DECODE for lane in lanes):
            raise CommitError("a decode plan has decode lanes only")
        out: list[DirectRequest] = []
        seen: set[int] = set()
        for lane in lanes:
            rid = lane.handle.id
            r = self._residency.requests.get(rid)
            if r is None or not r.runnable:
                raise CommitError(f"request {rid} is no longer runnable")
            if rid in seen:
                raise CommitError(f"request {rid} appears twice in the plan")
            seen.add(rid)
            if r.in_flight:
                raise CommitError(f"request {rid} is in a frame in flight already")
            if (lane.slot, lane.generation) != (r.slot, r.generation):
                raise CommitError(f"request {rid}: slot epoch changed")
            if lane.output_start != r.committed_output:
                raise CommitError(f"request {rid}: output epoch changed")
            if prefill:
                if r.phase is not Phase.PREFILL or lane.prompt_start != r.consumed_prompt:
                    raise CommitError(f"request {rid}: prompt epoch changed")
                if not 0 < lane.prompt_tokens <= min(r.prompt_left(), graph.prompt_capacity):
                    raise CommitError(f"request {rid}: prompt extent out of range")
                ends = lane.prompt_start + lane.prompt_tokens == r.spec.prompt_len
                if lane.max_tokens != (1 if ends else 0):
                    raise CommitError(
                        f"request {rid}: a prompt row commits one token exactly when it ends "
                        "the prompt"
                    )
            else:
                if r.phase is not Phase.DECODE:
                    raise CommitError(f"request {rid} is not decoding")
                if lane.prompt_tokens or lane.prompt_start != r.spec.prompt_len:
                    raise CommitError(f"request {rid}: a decode row takes no prompt tokens")
                if lane.max_tokens != 1 or r.remaining_output < 1:
                    raise CommitError(f"request {rid}: a decode row commits exactly one token")
            out.append(r)
        return tuple(out)

    # ----------------------------------------------------------- completion
    def complete(
        self, fence: int, records: Sequence[CompletionRecord], timing: ExecutionTiming
    ) -> list[GeneratedToken]:
        """Apply the oldest frame in flight; validates everything before any change."""
        head = self._window[0] if self._window else None
        if head is None or head.fence != fence:
            expected = None if head is None else head.fence
            raise CompletionError(f"completion for fence {fence}, expected fence {expected}")
        validate_timing(timing)
        validate_records(fence, head.plan.lanes, records)

        # -- validated: apply ------------------------------------------------------
        self._window.popleft()
        end = self.now_ns  # the frames behind start from the observed completion
        for frame in self._window:
            end += frame.plan.estimated_duration_ns
            frame.expected_end_ns = end
        plan = head.plan
        self.catalog.observe(plan.graph, cost_sample_ns(timing), self.now_ns)
        # Device time (max(device, wall) when dispatched alone), or wall without one.
        charged = timing.credited_ns if timing.raw_device_ns > 0 else timing.host_wall_ns
        self.executions[plan.reason] += 1
        self.execution_ns[plan.reason] += charged

        generated: list[GeneratedToken] = []
        for lane, r, record in zip(plan.lanes, head.requests, records):
            r.fence = None
            if not r.runnable:
                continue  # cancelled meanwhile: its results are discarded
            first = r.committed_output == 0
            r.consumed_prompt += lane.prompt_tokens
            tokens = tuple(record.tokens)
            if not tokens:
                continue
            r.committed_output += len(tokens)
            if record.finish_reason is not None:
                r.finish_reason = record.finish_reason
            elif r.committed_output >= r.spec.max_output_tokens:
                r.finish_reason = "length"
            generated.append(
                GeneratedToken(r.handle, fence, tokens, first, r.finished, r.finish_reason)
            )
        for r in head.requests:
            self._residency.retire_if_done(r)
        return generated

    def complete_with_survival(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        survival: Sequence[Sequence[float]],
    ) -> list[GeneratedToken]:
        """Direct mode runs no speculative rounds: CompletionError."""
        raise CompletionError(f"fence {fence}: direct mode runs no speculative rounds")

    def complete_packed_round(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        confidence: Confidence,
    ) -> list[GeneratedToken]:
        """Direct mode runs no speculative rounds: CompletionError."""
        raise CompletionError(f"fence {fence}: direct mode runs no speculative rounds")

    def complete_packed_round_with_survival(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        confidence: Confidence,
        survival: Sequence[Sequence[float]],
    ) -> list[GeneratedToken]:
        """Direct mode runs no speculative rounds: CompletionError."""
        raise CompletionError(f"fence {fence}: direct mode runs no speculative rounds")

    # ---------------------------------------------------------- publication
    def published_output(self, handle: RequestHandle, fence: int, at_ns: int | None = None) -> bool:
        """Direct mode prices no delivery: True while ``handle`` is live, else False."""
        if not isinstance(handle, RequestHandle):
            raise PublicationError(f"published_output takes a RequestHandle, got {handle!r}")
        for name, value in (("fence", fence), ("at_ns", at_ns)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise PublicationError(f"{name} must be an integer, got {value!r}")
        r = self._residency.requests.get(handle.id)
        return r is not None and not r.cancelled

    # ---------------------------------------------------------- inspection
    def drain_trace(self) -> list[TraceRecord]:
        return self._trace.drain()

    def trim_trace(self, keep: int) -> None:
        """Drop all but the newest ``keep`` undrained records (as Scheduler.trim_trace)."""
        self._trace.trim(keep)

    @property
    def trace_dropped(self) -> int:
        """Trace records dropped undrained (the buffer holds the newest ``TRACE_LIMIT``)."""
        return self._trace.dropped

    def request(self, handle: RequestHandle) -> DirectRequest | None:
        """The request, or None once it is retired (or was never admitted)."""
        return self._residency.requests.get(handle.id)

    def page_table(self, handle: RequestHandle) -> list[int]:
        r = self._residency.requests.get(handle.id)
        return list(r.pages) if r is not None else []

    def generation_start(self, handle: RequestHandle) -> GenerationStart | None:
        """Direct mode starts every generation plainly (no cached prefix, no
        copies, no restored output): None."""
        return None

    def memory_stats(self) -> dict[str, int]:
        """Direct mode keeps no KV memory or prefix-cache counters: empty."""
        return {}

    @property
    def in_flight(self) -> int:
        """Frames committed and not yet completed."""
        return len(self._window)

    @property
    def queue_fences(self) -> list[int]:
        return [f.fence for f in self._window]

    @property
    def running(self) -> int:
        return sum(1 for r in self._residency.resident.values() if r.runnable)

    @property
    def waiting(self) -> int:
        return len(self._residency.waiting)

    @property
    def free_pages(self) -> int:
        return self._residency.pages.free_count

    def active_requests(self) -> list[DirectRequest]:
        return list(self._residency.requests.values())
