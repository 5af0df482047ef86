"""Frames in flight: planning and sending them, waiting for their completions.

:class:`InFlightFrames` (on :class:`~runtime.coordinator.engine.lifecycle.EngineLifecycle`)
asks the scheduler for plans while it offers them, commits each under the
next fence and publishes it as a wire :class:`Frame` (empty frames carry
round-trip probes, or slot releases when nothing else runs), waits for the
ranks' messages (spinning across the head frame's expected end with
``poll_spin_us``), sends the ranks' questions (inspect, profile) and holds the
per-frame watchdog on the head frame.
"""

from __future__ import annotations

import time

from runtime.coordinator.engine.config import EngineError, frame_watchdog_ns
from runtime.coordinator.engine.frames import Dispatch, Live, build_frame, mark_pages_sent
from runtime.coordinator.engine.lifecycle import EngineLifecycle
from runtime.coordinator.engine.ranks import RankAsk
from runtime.coordinator.plan import ScheduledPlan
from runtime.transport.frame import Frame


class InFlightFrames(EngineLifecycle):
    """Dispatch, waiting and the watchdog (see the module docstring)."""

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self) -> bool:
        scheduler, channel = self.scheduler, self._channel
        assert scheduler is not None and channel is not None
        if self._probes:  # a measurement waits for an empty window and holds planning
            return self._send_probe()
        sent = False
        while True:
            plan_ns = time.monotonic_ns()
            scheduler.advance_to(plan_ns)
            plan = scheduler.plan()
            if plan is None:
                if self._release and not self._inflight:  # idle: free the ranks' slots now
                    return self._send_empty(probe=False) or sent
                return sent
            fence = self._next_fence
            frame, lives = self._frame(plan, fence)
            queued = scheduler.in_flight > 0
            scheduler.commit(plan, fence)
            self._next_fence += 1
            self._release.clear()  # carried by this frame (or replaced by a new tenant)
            sent_ns = time.monotonic_ns()
            start_ns = max(sent_ns, self._inflight[-1].expected_end_ns) if queued else sent_ns
            dispatch = Dispatch(
                fence,
                plan,
                tuple(live.stream.ignore_eos for live in lives),
                queued,
                plan_ns,
                sent_ns,
                start_ns + plan.estimated_duration_ns,
            )
            channel.publish(frame)
            mark_pages_sent(lives, plan)
            self._inflight.append(dispatch)
            self._by_fence[fence] = dispatch
            self.stats.add(frames_sent=1)
            sent = True

    def _send_probe(self) -> bool:
        """Publish the next empty frame of the head probe once nothing is in flight."""
        return False if self._inflight else self._send_empty(probe=True)

    def _send_empty(self, probe: bool) -> bool:
        """An empty frame: a probe's, or one that carries slot releases only."""
        channel, facts = self._channel, self.facts
        assert channel is not None and facts is not None
        fence = self._next_fence
        self._next_fence += 1
        program = min(facts.descriptors, key=lambda d: (d.batch_capacity, d.prompt_capacity))
        frame = Frame(fence, program, release_slots=tuple(sorted(self._release)))
        self._release.clear()
        now = time.monotonic_ns()
        dispatch = Dispatch(fence, None, (), False, now, time.monotonic_ns(), now, probe=probe)
        channel.publish(frame)
        self._inflight.append(dispatch)
        self._by_fence[fence] = dispatch
        return True

    def _frame(self, plan: ScheduledPlan, fence: int) -> tuple[Frame, list[Live]]:
        """The wire frame of ``plan`` and its lanes' requests, in lane order."""
        scheduler = self.scheduler
        assert scheduler is not None
        lives = []
        for lane in plan.lanes:
            live = self._by_handle[lane.handle.id]
            if (live.slot, live.generation) != (lane.slot, lane.generation):
                live.reside(lane.slot, lane.generation, scheduler.generation_start(lane.handle))
                live.stream.slot, live.stream.generation = lane.slot, lane.generation
            live.pages = scheduler.page_table(lane.handle)  # pages on demand: it grows
            lives.append(live)
        window_rows = self.facts.window_rows if self.facts is not None else 0
        return build_frame(plan, fence, lives, self._release, window_rows), lives

    def _await_message(self, wait_ms: int) -> object | None:
        """The next message from the ranks within ``wait_ms``, or None.

        With ``poll_spin_us``, sleeps in ``zmq_poll`` until shortly before the
        head frame's expected end, then busy-polls across it: the completion
        is then seen within microseconds instead of after a wake-up.
        """
        channel = self._channel
        assert channel is not None
        spin_us = self.config.poll_spin_us
        if not spin_us or wait_ms == 0 or not self._inflight:
            return channel.recv(timeout_ms=wait_ms)
        deadline_ns = time.monotonic_ns() + wait_ms * 1_000_000
        lead_ms = (self._inflight[0].expected_end_ns - spin_us * 1000 - time.monotonic_ns()) // (
            1_000_000
        )
        if lead_ms > 0:
            message = channel.recv(timeout_ms=min(lead_ms, wait_ms))
            if message is not None:
                return message
        remaining_ms = max(0, -(-(deadline_ns - time.monotonic_ns()) // 1_000_000))
        return channel.recv(timeout_ms=remaining_ms, spin_us=2 * spin_us)

    def _check_overdue(self) -> None:
        """The per-frame watchdog (and the ``completion_timeout_s`` cap) on the head
        frame; tells the liveness watcher when the head frame should end."""
        liveness = self.liveness
        if not self._inflight:
            if liveness is not None:
                liveness.expect_until(0)
            return
        head = self._inflight[0]
        if liveness is not None:
            liveness.expect_until(head.expected_end_ns)
        cfg = self.config
        now = time.monotonic_ns()
        since = max(head.sent_ns, self._head_since_ns)  # queued: from the frame before's end
        expected = head.plan.estimated_duration_ns if head.plan is not None else 0
        limit = frame_watchdog_ns(
            expected,
            cfg.frame_watchdog_multiple,
            cfg.frame_watchdog_margin_s,
            cfg.frame_watchdog_floor_s,
            known=True if head.plan is None else None,
        )
        what = "frame watchdog"
        cap = cfg.completion_timeout_s
        if cap is not None and cap * 1e9 < limit:
            since, limit, what = head.sent_ns, round(cap * 1e9), "completion_timeout_s"
        if now - since <= limit:
            return
        missing = sorted(set(range(self._world)) - set(head.answers))
        cost = f"expected {expected / 1e6:.3f} ms" if expected else "cost still unknown"
        raise EngineError(
            f"fence {head.fence}: no completion from rank(s) {missing} within "
            f"{limit / 1e9:.6g} s ({what}; {cost}); a hung rank or collective cannot be "
            "recovered in place: the deployment shuts down"
        )

    # ------------------------------------------------------------------ rank questions
    def _send_ask(self, ask: RankAsk) -> None:
        channel = self._channel
        assert channel is not None
        channel.publish(self._queries.open(ask, time.monotonic_ns()))

    def _answered(self, message: object) -> None:
        ask = self._queries.take(message)
        if ask is not None and ask.internal:
            self.rank_metrics.refreshed(ask.answers, time.monotonic_ns())  # type: ignore[arg-type]

    def _expire_queries(self) -> None:
        now = time.monotonic_ns()
        for ask in self._queries.expire(now):
            if ask.internal:
                self.rank_metrics.refreshed(ask.answers, now)  # type: ignore[arg-type]
        if self.rank_metrics.refresh_due(now):  # someone reads the ranks' memory
            self.rank_metrics.refreshing = True
            self._send_ask(RankAsk("inspect", internal=True))

    @property
    def in_flight_fences(self) -> list[int]:
        with self._state_lock:
            return [d.fence for d in self._inflight]
