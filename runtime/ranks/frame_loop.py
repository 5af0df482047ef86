"""A rank's frame loop: answer the frames a channel brings until a shutdown
control arrives.

The slot table is updated at launch, so on CUDA the loop checks and packs
frame N+1 while frame N runs (the spec's two-slot queue, seen from the rank; a
third waits in the socket until the first is answered, since the host buffers
are double) and polls events instead of blocking, watching each frame's
deadline (``multiple`` x its expected duration + a margin); a missed deadline
is reported as an error completion naming the fence and the rank, and the rank
exits (:class:`RankHang`).  On CPU frames run synchronously; a watchdog thread
with its own socket does the same.  Controls (``inspect``, ``profile``,
``shutdown``) are answered between frames; a frame the rank refuses is answered
with an error completion, the rank's state unchanged.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from runtime.ranks.checked_frame import FrameError
from runtime.ranks.completions import error_completion
from runtime.ranks.heap import release_free_memory
from runtime.ranks.launch import Launch
from runtime.ranks.shapes import ProgramError
from runtime.ranks.watchdog import Watchdog, hang_message
from runtime.ranks.worker import RankWorker
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.frame import Frame

log = logging.getLogger("runtime.ranks")


class RankHang(RuntimeError):
    """A frame missed its deadline; the rank reported it and must exit."""


def serve_frames(worker: RankWorker, channel, spin_us: int = 0) -> None:
    """Send the worker's catalog report, then answer frames until a shutdown
    control arrives.

    ``spin_us``: after each completion, busy-poll that long for the next
    frame before blocking (the coordinator usually sends it within a round
    trip, and waking a blocked process costs more than the spin).
    """
    channel.send(worker.report())
    watchdog = None
    if worker.device.type != "cuda":
        # A tick of an eighth of the margin (at most 1 s): few wake-ups, an
        # early enough report.
        tick = min(1.0, worker.frame_timeout_margin_s / 8)
        watchdog = Watchdog(
            channel.endpoints.completions, worker.rank, worker.world_size, tick_s=tick,
            keys=getattr(channel, "keys", None),
        )  # fmt: skip
    try:
        FrameLoop(worker, channel, spin_us, watchdog).run()
    finally:
        if watchdog is not None:
            watchdog.close()


class FrameLoop:
    """The frames in flight of one worker on one channel, answered in fence order."""

    def __init__(
        self, worker: RankWorker, channel, spin_us: int = 0, watchdog: Watchdog | None = None
    ) -> None:
        self.worker = worker
        self.channel = channel
        self.spin_us = spin_us
        self.watchdog = watchdog
        # (frame, launch or answer, receive ns), in fence order.
        self.queue: deque[tuple[Frame, Launch | Completion, int]] = deque()
        self.head_since = 0  # when the head of the queue became the head

    def run(self) -> None:
        """Until a shutdown control: publish what finished, then take a message."""
        worker, channel, queue = self.worker, self.channel, self.queue
        trimmed = True  # freed memory was handed back since the last message
        spin = 0
        while True:
            if self._publish_finished():
                spin = self.spin_us
            if sum(isinstance(item, Launch) for _, item, _ in queue) >= len(worker.host_buffers):
                continue  # both host buffers are in flight: the head must finish first
            t0 = time.perf_counter_ns()
            message = channel.recv(timeout_ms=0 if queue else 1000, spin_us=0 if queue else spin)
            received = time.perf_counter_ns() - t0
            if message is None:
                if not queue and not trimmed:  # idle for a second: hand freed memory back
                    release_free_memory()
                    trimmed = True
                continue
            received_at = time.monotonic_ns()
            spin = 0
            trimmed = False
            if isinstance(message, Control):
                if self._control(message):
                    return
                continue
            if not isinstance(message, Frame):
                log.warning("rank %d: ignoring %s", worker.rank, type(message).__name__)
                continue
            item = self._take(message, received, received_at)
            if not queue:
                self.head_since = time.monotonic_ns()
            queue.append((message, item, received))

    def _publish_finished(self) -> bool:
        """Publish the finished head of the queue, in order; whether any was.
        Raises :class:`RankHang` (after an error completion) when the head missed
        its deadline."""
        worker, queue = self.worker, self.queue
        published = False
        while queue:
            frame, item, _ = queue[0]
            if isinstance(item, Launch) and not item.finished():
                waited = time.monotonic_ns() - self.head_since
                limit = worker.deadline_ns(frame)
                if waited > limit:
                    reason = hang_message(frame.fence, worker.rank, limit, frame.expected_ns)
                    log.error("%s; this rank exits", reason)
                    self.channel.send(self._error(frame.fence, reason))
                    raise RankHang(reason)
                break
            queue.popleft()
            self.head_since = time.monotonic_ns()
            self._publish(item)
            published = True
        return published

    def _control(self, message: Control) -> bool:
        """Answer a control; True for ``shutdown`` (the frames in flight are
        answered first, then the frames profiled so far)."""
        worker, channel = self.worker, self.channel
        if message.command == "inspect":
            channel.send(worker.inspect(message.nonce))
        elif message.command == "profile":
            refused = worker.profiler.start(message.nonce, message.count)
            if refused is not None:
                channel.send(refused)
        elif message.command == "shutdown":
            while self.queue:  # the frames in flight finish and are answered first
                self._publish(self.queue.popleft()[1])
            if worker.profiler.active:  # the frames profiled so far
                channel.send(worker.profiler.finish())
            return True
        return False

    def _take(self, frame: Frame, received: int, received_at: int) -> Launch | Completion:
        """Start ``frame`` under the watchdog: its launch, or the error completion
        of a frame this rank refuses.  Any other failure is reported, then raised."""
        worker, watchdog = self.worker, self.watchdog
        if watchdog is not None:
            watchdog.arm(frame.fence, worker.deadline_ns(frame), frame.expected_ns)
        try:
            self._check_fresh(frame)
            item = worker.start(frame, received, received_at)
            # Only a frame taken advances the mark: a refused one changes nothing.
            worker.last_received_fence = frame.fence
        except (FrameError, ProgramError) as exc:
            # A frame this rank cannot run is a coordinator bug: say so at once
            # (the slot state is unchanged) so the coordinator fails fast.
            log.error("rank %d: rejected frame %d: %s", worker.rank, frame.fence, exc)
            item = self._error(frame.fence, f"rejected: {exc}")
        except Exception as exc:
            # Out of memory, a failed collective: report, then stop this rank.
            log.exception("rank %d: frame %d failed", worker.rank, frame.fence)
            self.channel.send(self._error(frame.fence, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            if watchdog is not None:
                watchdog.disarm()
        return item

    def _check_fresh(self, frame: Frame) -> None:
        """Refuse a replayed frame: fences only grow, so a fence at or below the
        highest this rank took was sent before (raises FrameError)."""
        last = self.worker.last_received_fence
        if frame.fence <= last:
            raise FrameError(
                f"fence {frame.fence} replayed: not greater than fence {last}, "
                "the last frame this rank received"
            )

    def _publish(self, item: Launch | Completion) -> None:
        """Send an answer, or finish a launch and send its completion (timing the
        publish stage), then a finished profile's report."""
        worker, channel = self.worker, self.channel
        if isinstance(item, Completion):
            channel.send(item)
            return
        with worker.profiler.range("publish"):
            completion = worker.finish(item)
            t0 = time.perf_counter_ns()
            channel.send(completion)
        item.stages["publish"] += time.perf_counter_ns() - t0
        worker.last_publish_ns = item.stages["publish"]
        worker.stages.append(dict(item.stages))
        profiled = worker.profiler.frame_done()
        if profiled is not None:
            channel.send(profiled)

    def _error(self, fence: int, reason: str) -> Completion:
        return error_completion(fence, self.worker.rank, self.worker.world_size, reason)
