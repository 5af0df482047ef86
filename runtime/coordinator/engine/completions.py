"""Completions: the ranks' answers, applied strictly in fence order.

:class:`CompletionHandling` (on :class:`~runtime.coordinator.engine.inflight.InFlightFrames`)
takes each message from the ranks: answers to questions, errors, and
completions, which wait until every rank has answered their fence.  The
head fence is then applied: rank 0's lanes and every rank's timing go to the
scheduler (:meth:`CompletionHandling._complete`, which picks the scheduler's
``complete`` method for the frame's sidecars), the committed tokens and their
log probabilities go to their streams, and requests the scheduler retired are
forgotten (their slots are released on the ranks with the next frame).
"""

from __future__ import annotations

import logging
import time

from runtime.catalog import GraphKind
from runtime.coordinator.engine.answers import (
    check_token_ids,
    completion_records,
    execution_timing,
    lane_logprobs,
    prompt_scores,
    sidecar_rows,
    token_logprobs,
)
from runtime.coordinator.engine.config import EngineError
from runtime.coordinator.engine.frames import Dispatch, Live
from runtime.coordinator.engine.inflight import InFlightFrames
from runtime.coordinator.engine.stats import FrameStat
from runtime.coordinator.engine.vision_frames import plan_records
from runtime.coordinator.errors import CompletionError
from runtime.coordinator.records import CompletionRecord, ExecutionTiming, GeneratedToken
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.completion import Completion
from runtime.transport.control import Control

log = logging.getLogger("runtime.coordinator.engine")

UNREAD_TRACE_RECORDS = 2048  # scheduler trace records kept when no trace file reads them


class CompletionHandling(InFlightFrames):
    """Messages from the ranks, and completions applied (see the module docstring)."""

    def _on_message(self, message: object) -> bool:
        if self._queries.is_answer(message):
            self._answered(message)
            return False
        if isinstance(message, Control) and message.command == "error":
            # The rank could not decode something the coordinator sent: a frame may
            # be lost, and waiting for its completion would stall; fail fast.
            fences = ", ".join(str(d.fence) for d in self._inflight) or "none"
            raise EngineError(
                f"rank {message.rank} could not decode a message from the coordinator "
                f"({message.reason}); frames in flight fail: fence(s) {fences}"
            )
        if not isinstance(message, Completion):
            kind = type(message).__name__
            if isinstance(message, (CatalogReport, Control)):
                log.warning("ignoring %s from rank %d after start-up", kind, message.rank)
            else:
                log.warning("ignoring unexpected %s", kind)
            self.stats.add(ignored_messages=1)
            return False
        dispatch = self._by_fence.get(message.fence)
        if dispatch is None:
            log.warning(
                "ignoring completion from rank %d for fence %d: not in flight%s",
                message.rank,
                message.fence,
                "" if message.error is None else f" (its error: {message.error})",
            )
            self.stats.add(ignored_messages=1)
            return False
        if message.rank in dispatch.answers:
            log.warning(
                "ignoring duplicate completion from rank %d for fence %d",
                message.rank,
                message.fence,
            )
            self.stats.add(ignored_messages=1)
            return False
        if message.error is not None:
            # The ranks may now disagree with the scheduler: stop rather than guess.
            raise EngineError(
                f"rank {message.rank} could not run frame {message.fence}: {message.error}"
            )
        dispatch.answers[message.rank] = message
        if self.trace is not None:
            self.trace.arrived(message.fence, message.rank, time.monotonic_ns())
        self.stats.add(completion_messages=1)
        applied = False
        while self._inflight and len(self._inflight[0].answers) == self._world:
            self._apply(self._inflight.popleft())
            self._head_since_ns = time.monotonic_ns()
            applied = True
        return applied

    def _apply(self, dispatch: Dispatch) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        now = time.monotonic_ns()
        if dispatch.plan is None:  # an empty frame
            self._apply_empty(dispatch, now)
            return
        scheduler.advance_to(now)
        del self._by_fence[dispatch.fence]
        answers = dispatch.answers
        timing = execution_timing(dispatch, now, self._world)
        assert self.facts is not None
        vocab = self.facts.vocab_size
        check_token_ids(answers[0], vocab)  # a corrupt or forged answer fails fast
        if dispatch.plan.graph.kind is GraphKind.SCORED_PREFILL:  # the prompt's scores
            streams = [self._by_handle[lane.handle.id].stream for lane in dispatch.plan.lanes]
            prompt_scores(answers[0], dispatch.plan, streams, vocab)
        records = plan_records(dispatch.plan, completion_records(answers[0], dispatch.ignore_eos))
        try:
            generated = self._complete(dispatch, records, timing)
        except CompletionError as exc:
            raise EngineError(
                f"fence {dispatch.fence}: rank 0's results were refused: {exc}"
            ) from exc
        self.rank_metrics.record(answers, dispatch.plan.reason.value)
        if self.trace is not None:
            self.trace.applied(dispatch, now, scheduler.drain_trace())
        else:  # no trace file: keep a short recent tail for in-process readers, so an
            # undrained buffer does not grow for the server's life
            scheduler.trim_trace(UNREAD_TRACE_RECORDS)
        self._stream_tokens(dispatch, generated, now)
        self.stats.record_frame(
            FrameStat(
                fence=dispatch.fence,
                graph=dispatch.plan.graph.describe(),
                lanes=len(dispatch.plan.lanes),
                queued=dispatch.queued,
                plan_ns=dispatch.plan_ns,
                sent_ns=dispatch.sent_ns,
                completed_ns=now,
                rank_device_ns=timing.rank_device_ns,
                readiness_delay_ns=timing.readiness_delay_ns,
            ),
            dispatch.plan.graph.kind.value,
        )

    def _apply_empty(self, dispatch: Dispatch, now: int) -> None:
        """An empty frame answered: slot releases, or a round-trip probe's frame."""
        self.rank_metrics.record(dispatch.answers, None)
        del self._by_fence[dispatch.fence]
        if not dispatch.probe:  # releases only
            return
        probe = self._probes[0]
        probe.round_trips_ns.append(now - dispatch.sent_ns)
        if self.trace is not None:
            self.trace.applied(dispatch, now, [])
        if len(probe.round_trips_ns) >= probe.count:
            self._probes.popleft().done.set()

    def _stream_tokens(self, dispatch: Dispatch, generated: list[GeneratedToken], now: int) -> None:
        """The frame's committed tokens (and their log probabilities) to their streams;
        published at once unless ``external_publication``; gone requests retire."""
        scheduler, plan = self.scheduler, dispatch.plan
        assert scheduler is not None and plan is not None and self.facts is not None
        answer = dispatch.answers[0]
        vocab = self.facts.vocab_size
        lanes = plan.lanes
        asked = [self._by_handle[lane.handle.id].stream.sampling.logprobs for lane in lanes]
        graph = plan.graph
        if graph.kind is GraphKind.SPECULATIVE or graph.token_capacity > 1:  # a row per token
            entries = token_logprobs(answer, asked, vocab)
        else:
            entries = [None if e is None else (e,) for e in lane_logprobs(answer, asked, vocab)]
        by_handle = {
            lane.handle.id: entry for lane, entry in zip(lanes, entries) if entry is not None
        }
        tokens = finished = 0
        for item in generated:
            live = self._by_handle.get(item.handle.id)
            if live is None:  # pragma: no cover - the scheduler only reports live requests
                continue
            reason = item.finish_reason if item.finished else None
            entry = by_handle.get(item.handle.id)
            logprobs = entry if entry is not None and len(item.tokens) == len(entry) else ()
            stream = live.stream
            stream.cached_tokens = item.cached_tokens
            scores: tuple = ()
            if stream.prompt_logprobs >= 0 and not stream.prompt_scores_sent:
                # With the first output (or the finish of a request of none).
                stream.prompt_scores_sent = True
                held = stream.prompt_scores
                scores = tuple(held[p] for p in range(1, len(stream.prompt_token_ids)) if p in held)
            if stream._push(item.tokens, reason, item.fence, logprobs, scores):
                tokens += len(item.tokens)
                finished += item.finished
            if item.tokens and not self.config.external_publication:
                # (A terminal snapshot's finish carries no tokens: nothing to publish.)
                scheduler.published_output(item.handle, item.fence, now)
        for lane in lanes:
            live = self._by_handle.get(lane.handle.id)
            if live is not None:
                self._retire_if_gone(live)
        self.stats.add(tokens_out=tokens, requests_finished=finished)

    def _complete(
        self, dispatch: Dispatch, records: list[CompletionRecord], timing: ExecutionTiming
    ) -> list[GeneratedToken]:
        """Hand the frame to the scheduler (the one place that chooses among its four
        ``complete`` methods, runtime.coordinator.interface); a speculative round with its sidecars:
        rank 0's confidence [2, slots, depth] (device-allocated programs) and
        survival rows [lanes, depth] (when the program writes them); every
        rank's must be valid probabilities."""
        scheduler = self.scheduler
        assert scheduler is not None and dispatch.plan is not None
        graph = dispatch.plan.graph
        if graph.kind is not GraphKind.SPECULATIVE:
            return scheduler.complete(dispatch.fence, records, timing)
        confidence = survival = None
        for rank, answer in sorted(dispatch.answers.items()):
            c, s = sidecar_rows(answer, "confidence", 3), sidecar_rows(answer, "survival", 2)
            if rank == 0:
                confidence, survival = c, s
        if graph.device_allocated:
            if confidence is None:
                raise EngineError(
                    f"fence {dispatch.fence}: rank 0 sent no confidence sidecar for the "
                    f"device-allocated {graph.describe()}"
                )
            if survival is not None:
                return scheduler.complete_packed_round_with_survival(
                    dispatch.fence, records, timing, confidence, survival
                )
            return scheduler.complete_packed_round(dispatch.fence, records, timing, confidence)
        if survival is not None:
            return scheduler.complete_with_survival(dispatch.fence, records, timing, survival)
        return scheduler.complete(dispatch.fence, records, timing)

    def _retire_if_gone(self, live: Live) -> None:
        """Forget a request the scheduler retired; its slot is released on the ranks."""
        assert self.scheduler is not None
        if self.scheduler.request(live.handle) is not None:
            return
        self._by_handle.pop(live.handle.id, None)
        self._by_request.pop(live.stream.request_id, None)
        if live.slot >= 0:
            self._release.add(live.slot)
