"""Completion and publication: what the ranks ran, applied in fence order.

:class:`SchedulerCompletion` (on :class:`~runtime.coordinator.planning.SchedulerPlanning`)
checks a completion against the head of the execution queue before it changes
anything (records, timing, a round's confidence sidecar and survival rows),
then applies it: the cost sample, the execution class's accounting, each
lane's committed tokens and the round observations, service accounting,
retirement and memory.  ``published_output`` applies the frontend's
publications (the delivery half of the service accounting).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from runtime.catalog import GraphKind
from runtime.coordinator.cost import cost_sample_ns
from runtime.coordinator.errors import CompletionError, PublicationError
from runtime.coordinator.plan import LanePhase, LaneWork, SelectionReason
from runtime.coordinator.planning import SchedulerPlanning
from runtime.coordinator.queue import QueuedFrame
from runtime.coordinator.records import (
    CompletionRecord,
    Confidence,
    ExecutionTiming,
    GeneratedToken,
    validate_records,
    validate_timing,
)
from runtime.coordinator.requests import Request, RequestHandle
from runtime.coordinator.service import account_interval, starting_rate
from runtime.coordinator.sidecars import check_confidence, check_survival, round_offers
from runtime.coordinator.vision_checks import IMAGE_PHASES, after_prefill, complete_image_lane

# Bursts kept per request awaiting publication (oldest dropped beyond this).
MAX_UNPUBLISHED = 64


class SchedulerCompletion(SchedulerPlanning):
    """Completions (``complete`` and its sidecar forms) and publications."""

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
        offers, joint, rows = self._check_completion(fence, records, timing, confidence, survival)

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
        graph = frame.plan.graph
        # Forecasts observe up to the program's frozen min(D + 1, W), whatever a
        # lane's output limit: the sidecar holds every produced prefix.
        reach = min(graph.proposal_depth + 1, graph.token_capacity)
        for i, (lane, r, record) in enumerate(zip(frame.plan.lanes, frame.lane_requests, records)):
            sidecars = (i, offers, joint, rows, reach)
            item = self._apply_lane(fence, lane, r, record, frame_ms, sidecars)
            if item is not None:
                generated.append(item)
        if raw > 0:
            self._account_service(frame, credited)
        for r in frame.lane_requests:
            self._retire_if_done(r)
        self._settle_memory()
        if self.config.debug_page_accounting:
            self._res.check()
        self._check_idle()
        return generated

    def _check_completion(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        confidence: Confidence | None,
        survival: Sequence[Sequence[float]] | None,
    ) -> tuple[list[int] | None, list[list[float]] | None, list[list[float]] | None]:
        """Everything a completion of ``fence`` brings, checked before any change:
        a round's offered prefixes, its joint prefix probabilities (from the
        confidence sidecar) and its survival rows (None where they do not apply)."""
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
        return offers, joint, rows

    def _apply_lane(
        self,
        fence: int,
        lane: LaneWork,
        r: Request,
        record: CompletionRecord,
        frame_ms: float,
        sidecars: tuple[
            int, list[int] | None, list[list[float]] | None, list[list[float]] | None, int
        ],
    ) -> GeneratedToken | None:
        """One lane's results applied to its request; what it gives the caller, if anything.
        ``sidecars``: the lane's index and the round's checked offers, joint
        probabilities and survival rows (:meth:`_check_completion`), and the
        program's forecast ceiling min(D + 1, W)."""
        now = self.now_ns
        r.inflight_fences.remove(fence)
        r.inflight_prompt -= lane.prompt_tokens
        self.prompt_tokens_computed += lane.prompt_tokens
        r.inflight_output -= lane.max_tokens
        self._res.copied(r, fence)
        if lane.phase in IMAGE_PHASES:  # a vision or window row: no token
            complete_image_lane(lane, r, self._res.slots)
            return None
        if lane.phase is LanePhase.RESTORE:
            r.restore_pending = False
            if r.consumed_prompt == r.prefill_target - 1:
                r.consumed_prompt = r.prefill_target  # decode-ready: its pending token
                if r.became_decoder_ns is None:
                    r.became_decoder_ns = now
            return None
        if lane.phase is LanePhase.TERMINAL:  # the snapshot completes the response
            item = None
            if r.finished and not r.cancelled:
                item = GeneratedToken(
                    r.handle, fence, (), False, True, r.finish_reason, r.cached_tokens or 0
                )
            self._retire_if_done(r, snapshot=True)
            return item
        if r.cancelled or r.finished:
            self._retire_if_done(r)
            return None  # results are discarded (a preempted request keeps its own)
        first = r.committed_output == 0
        if lane.phase is LanePhase.PREFILL:
            r.consumed_prompt += lane.prompt_tokens
            if r.spec.score_prompt:
                r.scored_through = max(r.scored_through, r.consumed_prompt)
            if r.consumed_prompt >= r.prefill_target and r.became_decoder_ns is None:
                r.became_decoder_ns = now
            self._res.publish_computed(r)  # its full pages, for requests sharing them
            if r.vision is not None:
                after_prefill(r, self._windows)
        tokens = tuple(record.tokens)
        if r.speculation is not None and tokens:
            i, offers, joint, rows, reach = sidecars
            self._observe_round(
                r, record, None if offers is None else offers[i],
                None if joint is None else (joint[i], reach),
                None if rows is None else rows[i],
            )  # fmt: skip
        if not tokens:
            no_output = lane.phase is LanePhase.PREFILL and r.spec.max_output_tokens == 0
            if no_output and r.consumed_prompt >= r.prefill_target:
                return self._finish_without_output(r, fence)
            return None
        return self._commit_tokens(r, fence, record, tokens, first, frame_ms)

    def _finish_without_output(self, r: Request, fence: int) -> GeneratedToken:
        """A request of no output (a scored prompt's ``max_output_tokens`` 0)
        finishes when its prompt completes: "length", no tokens; visible now, or
        with its terminal snapshot when snapshot programs run."""
        r.finish_reason = "length"
        r.terminal_since_ns = self.now_ns
        visible = not self._snapshots
        return GeneratedToken(
            r.handle, fence, (), False, visible, r.finish_reason if visible else None,
            r.cached_tokens or 0,
        )  # fmt: skip

    def _commit_tokens(
        self,
        r: Request,
        fence: int,
        record: CompletionRecord,
        tokens: tuple[int, ...],
        first: bool,
        frame_ms: float,
    ) -> GeneratedToken:
        """``tokens`` committed to ``r``'s output, awaiting publication."""
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
            r.terminal_since_ns = self.now_ns
        return GeneratedToken(
            r.handle,
            fence,
            tokens,
            first,
            visible,
            r.finish_reason if visible else None,
            r.cached_tokens or 0,
        )

    def _account_service(self, frame: QueuedFrame, credited: int) -> None:
        """The measured interval's service accounting (runtime.coordinator.service)."""
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
        completed joint prefix probabilities into the forecast, up to the
        program's frozen min(D + 1, W) (not shortened by the lane's output
        limit).  Every committed token ages the request's estimates."""
        state = r.speculation
        assert state is not None  # a speculative round's requests were admitted speculating
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
        if raw_ns <= 0:
            charged = wall_ns  # no device interval: the isolated wall time pays
        elif reason is SelectionReason.ACCEPTANCE_LEARNING:
            charged = raw_ns  # one complete graph interval, readiness stalls included
        else:
            charged = credited_ns
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
