"""The coordinator's scheduler: plan, commit, complete, publish.

Pure Python: no torch, no sockets, no clocks.  Time enters only through
:meth:`Scheduler.advance_to`.  One decision is ``plan()`` (a pure function of
state returning an immutable :class:`ScheduledPlan` or ``None``), then
``commit(plan, fence)`` when the caller dispatches it, ``complete(fence, ...)``
when the ranks report, and ``published_output(handle, fence)`` when the
frontend makes output visible.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

from runtime.catalog import GraphDescriptor, GraphKind, within_speculative_envelope
from runtime.coordinator import policy as selection
from runtime.coordinator.commit_checks import (
    STATE_KINDS,
    STATE_PHASES,
    check_lane,
    check_shape,
    check_state_lane,
)
from runtime.coordinator.config import PolicyConfig, SchedulerConfig
from runtime.coordinator.cost import CostCatalog, cost_sample_ns
from runtime.coordinator.errors import (
    CommitError,
    CompletionError,
    PublicationError,
    SchedulerError,
)
from runtime.coordinator.learning import acceptance_ledger, choose_probe
from runtime.coordinator.plan import (
    LanePhase,
    LaneWork,
    ScheduledPlan,
    SelectionReason,
    TraceRecord,
)
from runtime.coordinator.projection import CatalogView, build_context
from runtime.coordinator.queue import ExecutionQueue, Frame, Participant
from runtime.coordinator.records import (
    CompletionRecord,
    ExecutionTiming,
    GeneratedToken,
    validate_records,
    validate_timing,
)
from runtime.coordinator.refresh import choose_refresh, timing_ledger
from runtime.coordinator.requests import (
    GenerationStart,
    Request,
    RequestHandle,
    RequestSpec,
)
from runtime.coordinator.residency import Residency
from runtime.coordinator.rounds import (
    expected_tokens,
    round_candidates,
    speculative_candidates,
)
from runtime.coordinator.service import account_interval, starting_rate
from runtime.coordinator.sidecars import Confidence, check_confidence, check_survival, round_offers
from runtime.coordinator.speculation import SpeculationModel
from runtime.coordinator.state_ops import RESTORE as RESTORE_ROLE
from runtime.coordinator.state_ops import state_candidates
from runtime.coordinator.utility import log_scale_for

# Bursts kept per request awaiting publication (oldest dropped beyond this).
MAX_UNPUBLISHED = 64
# Trace records kept between drains.
TRACE_LIMIT = 65536


class Scheduler:
    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        config: SchedulerConfig | None = None,
        policy: PolicyConfig | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.policy = policy or PolicyConfig()
        # Estimates start indeterminate whatever the descriptors carried.
        descriptors = [replace(d, estimated_duration_ns=0) for d in catalog]
        envelope = self.config.speculative_token_capacity
        if envelope:  # load-time selection within --speculative-token-capacity
            descriptors = [d for d in descriptors if within_speculative_envelope(d, envelope)]
        self.catalog = CostCatalog(descriptors, self.policy.estimate_ttl_ns)
        self.now_ns = 0
        self._queue = ExecutionQueue()
        config = self.config
        kinds = {d.kind for d in descriptors}
        # Terminal snapshots retire finished and preempted requests when the
        # catalog has snapshot programs (else they retire at once).
        self._snapshots = GraphKind.SNAPSHOT in kinds
        self._res = Residency(
            config.max_slots,
            config.num_pages,
            config.page_size,
            prefix_caching=config.enable_prefix_caching,
            max_chunk=max((d.prompt_capacity for d in descriptors), default=1),
            max_width=max((d.token_capacity for d in descriptors), default=1),
            restore_programs=GraphKind.RESTORE in kinds and self._snapshots,
        )
        self._requests: dict[int, Request] = {}  # admitted and not yet retired
        self._resident = self._res.resident
        self._next_handle = 0
        self._next_plan = 0
        self._selection_seq = 0
        self._last_fence: int | None = None
        self._pending_corrections: list[Request] = []
        self._admitted_any = False
        self.refresh_ledger = timing_ledger()
        self.learning_ledger = acceptance_ledger()
        self.prompt_tokens_computed = 0  # prompt (and restored) tokens prefill lanes ran
        self.executions = {reason: 0 for reason in SelectionReason}
        self.execution_ns = {reason: 0 for reason in SelectionReason}
        # Trace records since the last drain_trace(); bounded so a runtime that
        # never drains cannot grow without limit (trace_dropped counts the loss).
        self._trace: deque[TraceRecord] = deque(maxlen=TRACE_LIMIT)
        self.trace_dropped = 0
        self._view = CatalogView(self.catalog)
        # Acceptance estimates exist when speculative programs do (rounds.py).
        depth = max(
            (d.token_capacity - 1 for d in descriptors if d.kind is GraphKind.SPECULATIVE),
            default=0,
        )
        self.speculation = SpeculationModel(depth) if depth > 0 else None
        self._fixed_width = self.config.fixed_speculative_width

    # ------------------------------------------------------------------ setup
    def configure_policy(self, policy: PolicyConfig) -> None:
        """Replace the policy; allowed only before the first admission."""
        if not isinstance(policy, PolicyConfig):
            raise TypeError("configure_policy takes a PolicyConfig")
        if self._admitted_any:
            raise SchedulerError("configure_policy must be called before admission")
        self.policy = policy
        self.catalog.ttl_ns = policy.estimate_ttl_ns

    def advance_to(self, now_ns: int) -> None:
        if now_ns < self.now_ns:
            raise SchedulerError(f"time cannot go backwards: {now_ns} < {self.now_ns}")
        self.now_ns = now_ns
        self._check_idle()

    # ------------------------------------------------------------- admission
    def admit(self, spec: RequestSpec) -> RequestHandle:
        if not isinstance(spec, RequestSpec):
            raise TypeError("admit takes a RequestSpec")
        needed = -(-(spec.prompt_len + spec.max_output_tokens) // self.config.page_size)
        if needed > self.config.num_pages:
            raise SchedulerError(
                f"request needs {needed} KV pages (prompt_len + max_output_tokens), "
                f"the pool has {self.config.num_pages}"
            )
        handle = RequestHandle(self._next_handle)
        self._next_handle += 1
        request = Request(handle, spec, self.now_ns)
        if self.speculation is not None:
            request.speculation = self.speculation.new_request()
        self._requests[handle.id] = request
        self._res.enqueue(request)
        self._admitted_any = True
        self._settle_memory()
        return handle

    def cancel(self, handle: RequestHandle) -> bool:
        """Stop selecting ``handle`` now; resources stay owned through its last fence."""
        request = self._requests.get(handle.id)
        if request is None or request.cancelled or request.finished:
            return False
        request.cancelled = True
        if not request.resident:
            self._res.dequeue(request)
            del self._requests[handle.id]
        else:
            self._retire_if_done(request)
        self._settle_memory()
        self._check_idle()
        return True

    def _retire_if_done(self, request: Request, snapshot: bool = False) -> None:
        """Release a resident request that will run nothing more: finished,
        cancelled or preempted, with its last fence completed.  With snapshot
        programs a finished or preempted request first waits for its terminal
        snapshot (``snapshot``: it just completed); cancellation never waits."""
        if request.runnable or request.inflight_fences or not request.resident:
            return
        if not request.cancelled and not snapshot:
            if request.restore_pending:
                return  # resumed: its restore row is still to run
            if self._snapshots and not self._res.unstarted(request):
                return  # terminal: awaits its snapshot (state_ops); an unstarted
                # generation has nothing on the ranks to snapshot
        self._res.retire(request)
        if not request.preempted or request.cancelled or request.finished:
            self._requests.pop(request.handle.id, None)

    def _settle_memory(self) -> None:
        """Pages for every runnable request's next frame; preemption when one
        lacks a page (module docstring of runtime.coordinator.residency); then
        admission, unless a request still waits for pages."""
        res = self._res
        res.refresh_unstarted()
        for _ in range(len(res.resident) + 1):
            lacking = res.provision()
            if not lacking:
                break
            if any(r.preempted or r.finished for r in res.resident.values()):
                return  # a victim's (or a terminal request's) pages are still to come back
            victim = self._victim()
            if victim is None:
                return
            res.preempt(victim)
            victim.terminal_since_ns = self.now_ns  # its retirement's age starts now
            if victim.inflight_fences:
                return  # its pages come back when its last fence completes
            self._retire_if_done(victim)
        else:
            return
        if res.admit_waiting():
            res.provision()

    def _victim(self) -> Request | None:
        """The resident request with the lowest lane value per held page (ties:
        the most recently admitted), among those that name their tokens (so they
        can resume).  A lane's value is what selection would give its next frame
        now; a request selection cannot serve now (waiting on feedback) ranks
        after every servable one."""
        candidates = [
            r for r in self._resident.values() if r.runnable and r.pages and r.spec.prompt_tokens
        ]
        if not candidates:
            return None
        values: dict[int, float] = {}
        ctx = self._context()
        if ctx is not None:
            for view in ctx.decode:
                values[view.request.handle.id] = view.decode_value
            for view in ctx.prefill:
                tokens = min(view.available, self._res.max_chunk)
                values[view.request.handle.id] = selection.prompt_lane_value(view, tokens, 0.0)
        return min(
            candidates,
            key=lambda r: (
                r.handle.id not in values,
                values.get(r.handle.id, 0.0) / len(r.pages),
                -r.admitted_seq,
            ),
        )

    def _check_idle(self) -> None:
        if self._queue.empty and not any(
            r.runnable or self._awaits_state_program(r) for r in self._resident.values()
        ):
            self.refresh_ledger.idle()
            self.learning_ledger.idle()

    def _awaits_state_program(self, r: Request) -> bool:
        """A resident request whose next step is a state program's row: its
        restore, or its terminal snapshot."""
        if not r.resident or r.cancelled or r.inflight_fences:
            return False
        if r.restore_pending:
            return True
        return self._snapshots and (r.finished or r.preempted) and not self._res.unstarted(r)

    # ----------------------------------------------------------- selection
    def _context(self) -> selection.SelectionContext | None:
        runnable = []
        terminal = []
        restoring = []
        for r in self._resident.values():
            if r.runnable:
                runnable.append(r)
            elif self._awaits_state_program(r):
                (restoring if r.restore_pending else terminal).append(r)
        terminal.sort(key=lambda r: (r.terminal_since_ns or 0, r.handle.id))
        return build_context(
            self.now_ns,
            runnable,
            self._queue,
            self.policy,
            self.catalog,
            self._view,
            self.config.page_size,
            terminal,
            restoring,
        )

    def plan(self) -> ScheduledPlan | None:
        """The best next program, or ``None`` when nothing may be submitted now."""
        queue = self._queue
        if not queue.accepts_queued(self.now_ns):
            return None
        ctx = self._context()
        if ctx is None:
            return None
        cands = self._candidates(ctx)
        winner = selection.best(cands)
        if winner is None:
            return None
        reason = SelectionReason.DISCOVERY if winner.unknown else SelectionReason.ORDINARY
        alternative = choose_refresh(cands, winner, self.refresh_ledger)
        if alternative is not None:
            winner, reason = alternative, SelectionReason.TIMING_REFRESH
        else:  # timing refresh takes precedence over acceptance learning
            probe = self._probe(ctx, winner)
            if probe is not None:
                winner, reason = probe, SelectionReason.ACCEPTANCE_LEARNING
        requires_empty = winner.requires_feedback or reason in (
            SelectionReason.TIMING_REFRESH,
            SelectionReason.ACCEPTANCE_LEARNING,
        )
        if requires_empty and not queue.empty:
            return None  # the gate: submit nothing until queued work drains, then replan
        magnitude = max(abs(c.value) for c in cands)
        log_scale = log_scale_for(magnitude)
        return self._build_plan(winner, reason, requires_empty, ctx, log_scale)

    def _candidates(self, ctx: selection.SelectionContext) -> list[selection.Candidate]:
        cands = selection.candidates(ctx)
        if ctx.states is not None:
            state_candidates(ctx, ctx.states, self.policy, cands)
        fixed = self._fixed_width
        if self.speculation is not None and fixed != 1:
            round_candidates(
                ctx, cands, self._survival, self.policy.adaptive_verification_alpha, fixed,
                self._forecast,
            )  # fmt: skip
            if fixed > 1:  # fixed-width execution: decode rounds run at that width only
                cands = [c for c in cands if _fixed_width_allows(c, fixed)]
        return cands

    def _probe(
        self, ctx: selection.SelectionContext, winner: selection.Candidate
    ) -> selection.Candidate | None:
        """A funded acceptance probe instead of ``winner`` (learning.choose_probe)."""
        if self.speculation is None or self._fixed_width or not self.learning_ledger.can_open():
            return None
        optimistic: list[selection.Candidate] = []
        speculative_candidates(
            ctx, optimistic, self._optimistic, self.policy.adaptive_verification_alpha, 0,
            self._forecast,
        )  # fmt: skip
        source = self.config.proposer

        def weight(cand: selection.Candidate, i: int, depth: int) -> float:
            return cand.lanes[i].request.speculation.acceptance(source).weight(depth)

        return choose_probe(optimistic, winner, self.learning_ledger, weight)

    def _optimistic(self, lane: selection.LaneView, depth: int) -> list[float]:
        state = lane.request.speculation
        if state is None or depth <= 0:
            return []
        return state.acceptance(self.config.proposer).optimistic(depth)

    def _forecast(self, lane: selection.LaneView, depth: int) -> list[float]:
        """The request's forecast joint prefix probabilities (device allocation)."""
        state = lane.request.speculation
        return [] if state is None or depth <= 0 else state.forecast.means(depth)

    def _survival(self, lane: selection.LaneView, depth: int) -> list[float]:
        """The request's prefix-survival means s_1..s_depth for this deployment's proposer."""
        state = lane.request.speculation
        if state is None or depth <= 0:
            return []
        return state.acceptance(self.config.proposer).means(depth)

    def _build_plan(
        self,
        winner: selection.Candidate,
        reason: SelectionReason,
        requires_empty: bool,
        ctx: selection.SelectionContext,
        log_scale: float,
    ) -> ScheduledPlan:
        desc = winner.entry.descriptor
        lanes: list[LaneWork] = []
        beta = ctx.beta
        queries, ceilings = winner.queries, winner.ceilings
        roles = winner.roles or ()
        for i, view in enumerate(winner.lanes):
            r = view.request
            if roles:  # a state program's row: it feeds and commits nothing
                phase = LanePhase.RESTORE if roles[i] == RESTORE_ROLE else LanePhase.TERMINAL
                lanes.append(
                    LaneWork(
                        r.handle, r.slot, r.generation, phase, r.consumed_prompt, 0,
                        r.committed_output, 0, 0.0, 0.0, 0.0,
                    )
                )  # fmt: skip
                continue
            if queries is not None and i != winner.prompt_row:  # a round lane
                q = queries[i]
                rows = q if ceilings is None else ceilings[i]
                lanes.append(
                    LaneWork(
                        r.handle, r.slot, r.generation, LanePhase.DECODE, r.spec.prompt_len, 0,
                        view.output_start, rows, expected_tokens(self._survival(view, q - 1), q),
                        1.0, view.decode_value + ctx.decode_age_slope * winner.t_ms,
                    )
                )  # fmt: skip
                continue
            if i == winner.prompt_row:
                tokens = winner.prompt_tokens
                finishes = view.prompt_pos + tokens == r.prefill_target
                lanes.append(
                    LaneWork(
                        r.handle,
                        r.slot,
                        r.generation,
                        LanePhase.PREFILL,
                        view.prompt_pos,
                        tokens,
                        view.output_start,
                        1 if finishes else 0,
                        1.0 if finishes else 0.0,
                        0.0,
                        selection.prompt_lane_value(view, tokens, beta),
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
                        view.output_start,
                        1,
                        1.0,
                        1.0,
                        view.decode_value + ctx.decode_age_slope * winner.t_ms,
                    )
                )
        self._next_plan += 1
        return ScheduledPlan(
            plan_id=self._next_plan,
            graph=desc,
            lanes=tuple(lanes),
            estimated_duration_ns=winner.entry.estimate_ns,
            reason=reason,
            requires_empty_window=requires_empty,
            planned_at_ns=ctx.now_ns,
            expected_start_ns=ctx.start_ns,
            value_rate_scaled=winner.score * math.exp(log_scale),
            log_scale=log_scale,
            useful_value=winner.value + winner.age_slope * winner.t_ms,
            catalog_version=self.catalog.version,
        )

    # --------------------------------------------------------------- commit
    def commit(self, plan: ScheduledPlan, fence: int) -> None:
        """Dispatch ``plan`` as ``fence``; rechecks without rerunning selection."""
        if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
            raise CommitError(f"fence must be a non-negative integer, got {fence!r}")
        if self._last_fence is not None and fence <= self._last_fence:
            raise CommitError(f"fence {fence} is not newer than fence {self._last_fence}")
        try:
            entry = self.catalog.entry(plan.graph)
        except KeyError as exc:
            raise CommitError(str(exc)) from None
        now = self.now_ns
        queue = self._queue
        # Freshness is rechecked: a saved plan can outlive its estimate's freshness.
        exclusive = (
            plan.requires_empty_window
            or not plan.graph.queueable
            or not entry.fresh(now, self.catalog.ttl_ns)
        )
        if not queue.empty:
            if exclusive:
                raise CommitError("plan needs an empty submission window (feedback) first")
            if not queue.accepts_queued(now):
                raise CommitError("the submission window accepts no queued frame now")
        lane_requests = self._check_lanes(plan)

        # -- nothing below may fail ---------------------------------------------
        self._selection_seq += 1
        expected_end = queue.expected_end_ns(now) + entry.estimate_ns
        participants = [Participant(r, r.decoding) for r in self._resident.values() if r.runnable]
        for lane, r in zip(plan.lanes, lane_requests):
            r.inflight_prompt += lane.prompt_tokens
            r.inflight_output += lane.max_tokens
            r.inflight_fences.append(fence)
            r.last_selected = self._selection_seq
            if r.copy_sources and r.copy_fence is None:
                r.copy_fence = fence  # the generation's first frame runs its copies
            self._res.started(r)
        entry.last_attempt_ns = now
        if plan.reason is SelectionReason.TIMING_REFRESH:
            self.refresh_ledger.open_episode()
        elif plan.reason is SelectionReason.ACCEPTANCE_LEARNING:
            self.learning_ledger.open_episode()
        queue.push(
            Frame(
                fence=fence,
                plan=plan,
                reason=plan.reason,
                dispatch_ns=now,
                expected_end_ns=expected_end,
                exclusive=exclusive,
                participants=participants,
                lane_requests=lane_requests,
                normalizers=self._view.normalizers(),
            )
        )
        self._last_fence = fence
        self._res.provision()  # pages for what the lanes may run behind this frame
        desc = plan.graph
        if len(self._trace) == TRACE_LIMIT:
            self.trace_dropped += 1
        self._trace.append(
            TraceRecord(
                fence=fence,
                committed_at_ns=now,
                graph=desc.describe(),
                kind=desc.kind.value,
                batch_capacity=desc.batch_capacity,
                token_capacity=desc.token_capacity,
                proposal_depth=desc.proposal_depth,
                target_capacity=desc.target_capacity,
                prompt_capacity=desc.prompt_capacity,
                active_rows=len(plan.lanes),
                selected_cost_ns=entry.estimate_ns,
                observation_age_ns=entry.observation_age_ns(now),
                reason=plan.reason.value,
                refresh_credit_ns=self.refresh_ledger.balance_ns,
                learning_credit_ns=self.learning_ledger.balance_ns,
                value_rate_scaled=plan.value_rate_scaled,
                log_scale=plan.log_scale,
                requests=tuple(lane.handle.id for lane in plan.lanes),
                prompt_row=plan.prompt_row,
                prompt_tokens=sum(lane.prompt_tokens for lane in plan.lanes),
                decode_rows=sum(1 for lane in plan.lanes if lane.phase is LanePhase.DECODE),
            )
        )

    def _check_lanes(self, plan: ScheduledPlan) -> list[Request]:
        if plan.reason is SelectionReason.TIMING_REFRESH and not self.refresh_ledger.can_open():
            raise CommitError("timing refresh plan without full refresh credit")
        if (
            plan.reason is SelectionReason.ACCEPTANCE_LEARNING
            and not self.learning_ledger.can_open()
        ):
            raise CommitError("acceptance probe plan without full learning credit")
        check_shape(plan)
        state_kind = plan.graph.kind in STATE_KINDS
        seen: set[int] = set()
        out: list[Request] = []
        for lane in plan.lanes:
            r = self._requests.get(lane.handle.id)
            if lane.handle.id in seen:
                raise CommitError(f"request {lane.handle.id} appears twice in the plan")
            seen.add(lane.handle.id)
            if (lane.phase in STATE_PHASES) != state_kind:
                raise CommitError(
                    f"request {lane.handle.id}: a {lane.phase.value} row in a "
                    f"{plan.graph.kind.value} program"
                )
            if state_kind:
                awaits = r is not None and self._awaits_state_program(r)
                out.append(check_state_lane(lane, r, plan.graph.kind, awaits))
            else:
                capacity = 0 if r is None else self._res.capacity(r)
                out.append(check_lane(lane, r, plan.graph, capacity))
        return out

    # ----------------------------------------------------------- completion
    def complete(
        self, fence: int, records: Sequence[CompletionRecord], timing: ExecutionTiming
    ) -> list[GeneratedToken]:
        """Apply the head frame's results; validates everything before any change.

        A device-allocated speculative program completes through
        :meth:`complete_packed_round` instead, with its confidence sidecar.
        """
        return self._complete(fence, records, timing, None, None)

    def complete_with_survival(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        survival: Sequence[Sequence[float]],
    ) -> list[GeneratedToken]:
        """:meth:`complete` with ``completion_speculative_survival`` rows per lane."""
        return self._complete(fence, records, timing, None, survival)

    def complete_packed_round(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        confidence: Confidence,
    ) -> list[GeneratedToken]:
        """A device-allocated round with its FP32 confidence sidecar
        [2, request_slots, draft_capacity] (:mod:`runtime.coordinator.sidecars`)."""
        return self._complete(fence, records, timing, confidence, None)

    def complete_packed_round_with_survival(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        confidence: Confidence,
        survival: Sequence[Sequence[float]],
    ) -> list[GeneratedToken]:
        return self._complete(fence, records, timing, confidence, survival)

    def _complete(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        confidence: Confidence | None,
        survival: Sequence[Sequence[float]] | None,
    ) -> list[GeneratedToken]:
        head = self._queue.head
        if head is None or head.fence != fence:
            expected = None if head is None else head.fence
            raise CompletionError(f"completion for fence {fence}, expected fence {expected}")
        validate_timing(timing)
        plan = head.plan
        speculative = plan.graph.kind is GraphKind.SPECULATIVE or (
            plan.graph.kind is GraphKind.MIXED and plan.graph.token_capacity > 1
        )
        validate_records(head.fence, plan.lanes, records, speculative)
        if plan.graph.device_allocated and confidence is None:
            raise CompletionError(
                f"fence {fence}: a device-allocated program completes through "
                "complete_packed_round, with its confidence sidecar"
            )
        if confidence is not None and not plan.graph.device_allocated:
            raise CompletionError(f"fence {fence}: a confidence sidecar for a host-allocated plan")
        joint = None if confidence is None else check_confidence(fence, plan, confidence)
        rows = check_survival(fence, plan, survival) if survival is not None else None
        offers = round_offers(fence, plan, records, joint) if speculative else None

        # -- validated: apply ----------------------------------------------------
        frame = self._queue.pop_head(self.now_ns)
        now = self.now_ns
        for r in self._pending_corrections:
            r.pending_delivery = None  # publication must precede the next completion
        self._pending_corrections = []

        raw = timing.raw_device_ns
        credited = timing.credited_ns
        sample = cost_sample_ns(
            timing.rank_device_ns, timing.readiness_delay_ns, timing.rank_launch_wait_ns
        )
        self.catalog.observe(frame.plan.graph, sample, now)
        self._account_execution(frame.reason, raw, credited, timing.host_wall_ns)

        generated: list[GeneratedToken] = []
        frame_ms = credited / 1e6 if raw > 0 else 0.0  # no device interval: not measured
        for i, (lane, r, record) in enumerate(zip(frame.plan.lanes, frame.lane_requests, records)):
            r.inflight_fences.remove(fence)
            r.inflight_prompt -= lane.prompt_tokens
            self.prompt_tokens_computed += lane.prompt_tokens
            r.inflight_output -= lane.max_tokens
            self._res.copied(r, fence)
            if lane.phase is LanePhase.RESTORE:
                r.restore_pending = False
                if r.consumed_prompt == r.prefill_target - 1:
                    r.consumed_prompt = r.prefill_target  # decode-ready: its pending token
                    if r.became_decoder_ns is None:
                        r.became_decoder_ns = now
                continue
            if lane.phase is LanePhase.TERMINAL:  # the snapshot completes the response
                if r.finished and not r.cancelled:
                    generated.append(
                        GeneratedToken(
                            r.handle, fence, (), False, True, r.finish_reason,
                            r.cached_tokens or 0,
                        )
                    )  # fmt: skip
                self._retire_if_done(r, snapshot=True)
                continue
            if r.cancelled or r.finished:
                self._retire_if_done(r)
                continue  # results are discarded (a preempted request keeps its own)
            first = r.committed_output == 0
            if lane.phase is LanePhase.PREFILL:
                r.consumed_prompt += lane.prompt_tokens
                if r.consumed_prompt >= r.prefill_target and r.became_decoder_ns is None:
                    r.became_decoder_ns = now
                self._res.publish_computed(r)  # its full pages, for requests sharing them
            tokens = tuple(record.tokens)
            if r.speculation is not None and tokens:
                self._observe_round(
                    r, record, None if offers is None else offers[i],
                    None if joint is None else (joint[i], lane.max_tokens),
                    None if rows is None else rows[i],
                )  # fmt: skip
            if tokens:
                r.committed_output += len(tokens)
                r.output_tokens += tokens
                r.unpublished[fence] = frame_ms
                if len(r.unpublished) > MAX_UNPUBLISHED:  # a frontend that never publishes
                    del r.unpublished[next(iter(r.unpublished))]
                if record.finish_reason is not None:
                    r.finish_reason = record.finish_reason
                elif r.committed_output >= r.spec.max_output_tokens:
                    r.finish_reason = "length"
                # With snapshot programs the response completes visibly when its
                # terminal snapshot does; its terminal age starts now.
                visible = r.finished and not self._snapshots
                if r.finished:
                    r.terminal_since_ns = now
                generated.append(
                    GeneratedToken(
                        r.handle,
                        fence,
                        tokens,
                        first,
                        visible,
                        r.finish_reason if visible else None,
                        r.cached_tokens or 0,
                    )
                )
        if raw > 0:
            population = len(frame.participants)
            self._pending_corrections = account_interval(
                frame.participants,
                {r.handle.id for r in frame.lane_requests},
                frame.fence,
                frame.normalizers,
                self._view.normalizers(),
                credited,
                self.policy.adaptation_ms,
                starting_rate(self._view.decode_sigma_ms(population), population),
            )
        for r in frame.lane_requests:
            self._retire_if_done(r)
        self._settle_memory()
        if self.config.debug_page_accounting:
            self._res.check()
        self._check_idle()
        return generated

    def _observe_round(
        self,
        r: Request,
        record: CompletionRecord,
        offered_rows: int | None,
        forecast: tuple[list[float], int] | None,
        survival: list[float] | None,
    ) -> None:
        """A verified round's observations (spec, "Completed confidence and
        acceptance"): acceptance of its offered proposals against the tokens it
        committed (a stop or the output limit inside the accepted run censors the
        rest; survival rows replace the binary values at their depths); the
        completed joint prefix probabilities into the forecast, up to the lane's
        frozen ceiling.  Every committed token ages the request's estimates."""
        state = r.speculation
        count = len(record.tokens)
        if offered_rows is not None and offered_rows > 1:
            terminated = record.finish_reason is not None or (
                r.committed_output + count >= r.spec.max_output_tokens
            )
            # A program's survival rows span its depth: the offered prefixes count.
            state.acceptance(self.config.proposer).observe_round(
                offered_rows - 1, count - 1, terminated, (survival or ())[: offered_rows - 1]
            )
        if forecast is not None:
            joint, ceiling = forecast
            state.forecast.observe(joint, ceiling)
        state.age(count)

    def _account_execution(
        self, reason: SelectionReason, raw_ns: int, credited_ns: int, wall_ns: int
    ) -> None:
        charged = credited_ns if raw_ns > 0 else wall_ns
        self.executions[reason] += 1
        self.execution_ns[reason] += charged
        if reason is SelectionReason.ORDINARY and raw_ns > 0:
            self.refresh_ledger.earn(credited_ns)
            self.learning_ledger.earn(raw_ns)  # exploration budgets use raw physical time
        elif reason is SelectionReason.TIMING_REFRESH:
            self.refresh_ledger.close_episode(charged)
        elif reason is SelectionReason.ACCEPTANCE_LEARNING:
            self.learning_ledger.close_episode(charged)

    # ---------------------------------------------------------- publication
    def published_output(self, handle: RequestHandle, fence: int, at_ns: int | None = None) -> bool:
        """The frontend made ``fence``'s output for ``handle`` visible at ``at_ns``.

        The first visible publication of the latest completion's burst replaces
        that interval's zero delivery with one delivery.  Returns False for a
        request that is gone (retired or cancelled).
        """
        if at_ns is not None and (isinstance(at_ns, bool) or not isinstance(at_ns, int)):
            raise PublicationError(f"at_ns must be an integer of nanoseconds, got {at_ns!r}")
        at = self.now_ns if at_ns is None else at_ns
        r = self._requests.get(handle.id)
        if r is None or r.cancelled:
            return False
        if fence not in r.unpublished:
            raise PublicationError(
                f"request {handle.id} has no unpublished output at fence {fence} "
                "(never produced, or already published)"
            )
        frame_ms = r.unpublished[fence]
        for f in [f for f in r.unpublished if f <= fence]:
            del r.unpublished[f]
        tau = self.policy.adaptation_ms
        if r.delivery_rate is None:
            # A first published burst: one delivery over its measured frame duration.
            if frame_ms > 0:
                r.delivery_rate = 1.0 / frame_ms
        elif r.pending_delivery is not None and r.pending_delivery[0] == fence:
            dref = r.pending_delivery[1]
            if dref:
                r.delivery_rate *= math.exp(min(60.0, 1.0 / (tau * dref)))
        if r.pending_delivery is not None and r.pending_delivery[0] <= fence:
            r.pending_delivery = None
        r.last_visible_ns = at
        return True

    # ---------------------------------------------------------- inspection
    def drain_trace(self) -> list[TraceRecord]:
        out = list(self._trace)
        self._trace.clear()
        return out

    def trim_trace(self, keep: int) -> None:
        """Drop all but the newest ``keep`` undrained records (not counted as dropped:
        the caller reads none of them)."""
        while len(self._trace) > keep:
            self._trace.popleft()

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


def _fixed_width_allows(candidate: selection.Candidate, width: int) -> bool:
    """Fixed-width execution: decode rows run at ``width`` only (prefills stay)."""
    desc = candidate.entry.descriptor
    if desc.kind is GraphKind.DECODE:
        return False
    if desc.kind is GraphKind.MIXED and desc.token_capacity != width:
        return candidate.prompt_row >= 0 and len(candidate.lanes) == 1
    return True
