"""Planning and commitment: which program runs next, and dispatching it under a fence.

:class:`SchedulerPlanning` (on :class:`~runtime.coordinator.admission.SchedulerAdmission`)
runs selection: ``plan()`` is a pure function of state returning an immutable
:class:`~runtime.coordinator.plan.ScheduledPlan` (or None), with timing
refresh and acceptance probes displacing the winner when funded; ``commit``
rechecks a plan without rerunning selection and queues it under its fence.
"""

from __future__ import annotations

import math

from runtime.catalog import PREFILL_KINDS, GraphDescriptor, GraphKind
from runtime.coordinator.admission import SchedulerAdmission
from runtime.coordinator.commit_checks import (
    STATE_KINDS,
    STATE_PHASES,
    check_lane,
    check_shape,
    check_state_lane,
)
from runtime.coordinator.errors import CommitError
from runtime.coordinator.lanes import complete_prefix_value
from runtime.coordinator.learning import choose_probe
from runtime.coordinator.packing import packed_prefill_candidates
from runtime.coordinator.plan import (
    ImageRead,
    LanePhase,
    LaneWork,
    ScheduledPlan,
    SelectionReason,
    VisionImage,
    commit_record,
)
from runtime.coordinator.policy import (
    Candidate,
    LaneView,
    SelectionContext,
    best,
    candidates,
    prompt_lane_value,
)
from runtime.coordinator.queue import Participant, QueuedFrame
from runtime.coordinator.refresh import choose_refresh
from runtime.coordinator.requests import Request
from runtime.coordinator.rounds import expected_tokens, round_candidates, speculative_candidates
from runtime.coordinator.state_ops import RESTORE as RESTORE_ROLE
from runtime.coordinator.state_ops import state_candidates
from runtime.coordinator.utility import log_scale_for
from runtime.coordinator.vision import image_reads
from runtime.coordinator.vision_checks import WINDOW_PHASES, check_image_plan, commit_windows
from runtime.coordinator.vision_select import VisionCandidate, vision_candidates
from runtime.coordinator.window_select import WINDOW_RESTORE, WINDOW_SNAPSHOT


class SchedulerPlanning(SchedulerAdmission):
    """Selection (``plan``) and dispatch (``commit``)."""

    def plan(self) -> ScheduledPlan | None:
        """The best next program, or ``None`` when nothing may be submitted now."""
        queue = self._queue
        if not queue.accepts_queued(self.now_ns):
            return None
        ctx = self._context()
        if ctx is None:
            return None
        cands = self._candidates(ctx)
        winner = best(cands)
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

    def _candidates(self, ctx: SelectionContext) -> list[Candidate]:
        cands = candidates(ctx)
        for kind in PREFILL_KINDS:
            packed_prefill_candidates(ctx, cands, kind)
        fixed = self._fixed_width
        if ctx.vision is not None:
            vision_candidates(ctx, cands, fixed)
        if ctx.states is not None:
            rounds = self.speculation is not None and fixed != 1
            state_candidates(
                ctx, ctx.states, self.policy, cands, self._round_value if rounds else None, fixed
            )
        if self.speculation is not None and fixed != 1:
            round_candidates(
                ctx, cands, self._survival, self.policy.adaptive_verification_alpha, fixed,
                self._forecast,
            )  # fmt: skip
            if fixed > 1:  # fixed-width execution: decode rounds run at that width only
                cands = [c for c in cands if _fixed_width_allows(c, fixed)]
        return cands

    def _probe(self, ctx: SelectionContext, winner: Candidate) -> Candidate | None:
        """A funded acceptance probe instead of ``winner`` (learning.choose_probe)."""
        if (
            self.speculation is None
            or self._fixed_width
            or winner.unknown
            or not self.learning_ledger.can_open()
        ):
            return None  # (an unknown winner is discovery: choose_probe would decline)
        optimistic: list[Candidate] = []
        speculative_candidates(
            ctx, optimistic, self._optimistic, self.policy.adaptive_verification_alpha, 0,
            self._forecast, bound=True, floor=winner.score,
        )  # fmt: skip
        source = self.config.proposer

        def weight(cand: Candidate, i: int, depth: int) -> float:
            state = cand.lanes[i].request.speculation
            assert state is not None  # speculative candidates hold speculating requests
            return state.acceptance(source).weight(depth)

        return choose_probe(optimistic, winner, self.learning_ledger, weight)

    def _optimistic(self, lane: LaneView, depth: int) -> list[float]:
        state = lane.request.speculation
        if state is None or depth <= 0:
            return []
        return state.acceptance(self.config.proposer).optimistic(depth)

    def _round_value(self, lane: LaneView, desc: GraphDescriptor) -> float:
        """A decoder's value on round program ``desc`` at its complete prefix."""
        alpha = self.policy.adaptive_verification_alpha
        return complete_prefix_value(
            lane, desc, self._survival, alpha, self.policy.output_token_value
        )

    def _forecast(self, lane: LaneView, depth: int) -> list[float]:
        """The request's forecast joint prefix probabilities (device allocation)."""
        state = lane.request.speculation
        return [] if state is None or depth <= 0 else state.forecast.means(depth)

    def _survival(self, lane: LaneView, depth: int) -> list[float]:
        """The request's prefix-survival means s_1..s_depth for this deployment's proposer."""
        state = lane.request.speculation
        if state is None or depth <= 0:
            return []
        return state.acceptance(self.config.proposer).means(depth)

    def _build_plan(
        self,
        winner: Candidate,
        reason: SelectionReason,
        requires_empty: bool,
        ctx: SelectionContext,
        log_scale: float,
    ) -> ScheduledPlan:
        desc = winner.entry.descriptor
        lanes = [self._lane_work(winner, i, view, ctx) for i, view in enumerate(winner.lanes)]
        images: tuple[VisionImage, ...] = ()
        reads: tuple[ImageRead, ...] = ()
        if isinstance(winner, VisionCandidate):
            images = tuple(winner.images)
        elif any(view.request.vision is not None for view in winner.lanes):
            reads = image_reads(tuple(lanes), [view.request for view in winner.lanes])
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
            vision_images=images,
            image_reads=reads,
        )

    def _lane_work(
        self, winner: Candidate, i: int, view: LaneView, ctx: SelectionContext
    ) -> LaneWork:
        """Lane ``i`` of ``winner``'s plan: what it feeds, commits and is worth."""
        r = view.request
        if winner.chunks is not None:  # a packed prefill's row
            return _prompt_work(view, winner.chunks[i], ctx.beta)
        roles = winner.roles or ()
        if roles or isinstance(winner, VisionCandidate):  # feeds and commits no token
            phase = _ROLES.get(roles[i], LanePhase.TERMINAL) if roles else LanePhase.VISION
            return LaneWork(
                r.handle, r.slot, r.generation, phase, r.consumed_prompt, 0,
                r.committed_output, 0, 0.0, 0.0, 0.0,
            )  # fmt: skip
        queries, ceilings = winner.queries, winner.ceilings
        if queries is not None and i != winner.prompt_row:  # a round lane
            q = queries[i]
            rows = q if ceilings is None else ceilings[i]
            return LaneWork(
                r.handle, r.slot, r.generation, LanePhase.DECODE, r.spec.prompt_len, 0,
                view.output_start, rows, expected_tokens(self._survival(view, q - 1), q),
                1.0, view.decode_value + ctx.decode_age_slope * winner.t_ms,
            )  # fmt: skip
        if i == winner.prompt_row:
            return _prompt_work(view, winner.prompt_tokens, ctx.beta)
        return LaneWork(
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
        participants = [
            Participant(r, r.decoding) for r in self._resident.values() if r.participates
        ]
        if self._windows is not None:
            commit_windows(plan, lane_requests, self._windows)
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
            QueuedFrame(
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
        self._trace.append(
            commit_record(
                plan,
                fence,
                now,
                entry.estimate_ns,
                entry.observation_age_ns(now),
                self.refresh_ledger.balance_ns,
                self.learning_ledger.balance_ns,
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
        if plan.graph.kind is GraphKind.VISION or any(
            lane.phase in WINDOW_PHASES for lane in plan.lanes
        ):
            return check_image_plan(plan, self._requests, self._windows)
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


# State and window rows by their candidate role (state_ops, vision_select).
_ROLES = {
    RESTORE_ROLE: LanePhase.RESTORE,
    WINDOW_SNAPSHOT: LanePhase.WINDOW_SNAPSHOT,
    WINDOW_RESTORE: LanePhase.WINDOW_RESTORE,
}


def _prompt_work(view: LaneView, tokens: int, beta: float) -> LaneWork:
    """A prompt row taking ``tokens`` from its position: it commits the first
    output token when the chunk ends the prompt (none for a request of no
    output, a scored prompt's ``max_output_tokens`` 0)."""
    r = view.request
    finishes = view.prompt_pos + tokens == r.prefill_target and r.spec.max_output_tokens > 0
    return LaneWork(
        r.handle, r.slot, r.generation, LanePhase.PREFILL, view.prompt_pos, tokens,
        view.output_start, 1 if finishes else 0, 1.0 if finishes else 0.0, 0.0,
        prompt_lane_value(view, tokens, beta),
    )  # fmt: skip


def _fixed_width_allows(candidate: Candidate, width: int) -> bool:
    """Fixed-width execution: decode rows run at ``width`` only (prefills stay)."""
    desc = candidate.entry.descriptor
    if desc.kind is GraphKind.DECODE:
        return False
    if desc.kind is GraphKind.MIXED and desc.token_capacity != width:
        return candidate.prompt_row >= 0 and len(candidate.lanes) == 1
    return True
