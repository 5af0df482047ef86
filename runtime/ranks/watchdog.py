"""A rank's hang detector: a per-frame deadline watched from a second thread.

On CPU a program runs synchronously, so a hung frame never returns to the
rank's loop.  The watchdog thread owns its own PUSH socket to the
coordinator's completions endpoint (ZeroMQ sockets are not thread-safe); when
an armed deadline passes, it sends an error completion naming the fence and the
rank, then ends the process (the hung call cannot be interrupted).  On CUDA
the rank's loop polls events and applies the same deadline itself
(:func:`frame_deadline_ns`).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from runtime.transport.codec import encode
from runtime.transport.schema import Completion

log = logging.getLogger("runtime.ranks")

HANG_EXIT_CODE = 3


def frame_deadline_ns(expected_ns: int, multiple: float, margin_s: float) -> int:
    """How long a frame may take: ``multiple`` x its expected duration + ``margin_s``."""
    return round(multiple * max(0, expected_ns) + margin_s * 1e9)


def hang_message(fence: int, rank: int, waited_ns: int, expected_ns: int) -> str:
    return (
        f"hung: rank {rank}: frame fence {fence} did not finish within "
        f"{waited_ns / 1e9:.3f} s (expected {expected_ns / 1e6:.3f} ms)"
    )


class Watchdog:
    """Arm before running a frame, disarm after; a missed deadline reports and exits."""

    def __init__(
        self, endpoint: str, rank: int, world_size: int, *, exit_process: bool = True
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.exit_process = exit_process
        self.fired: str | None = None
        self._endpoint = endpoint
        self._cond = threading.Condition()
        self._armed: tuple[int, int, int, int] | None = None  # fence, start, limit, expected
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"rank{rank}-watchdog", daemon=True)
        self._thread.start()

    def arm(self, fence: int, limit_ns: int, expected_ns: int) -> None:
        with self._cond:
            self._armed = (fence, time.monotonic_ns(), limit_ns, expected_ns)
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        # A context of its own: terminating it flushes the report before the
        # process ends, without waiting on the rank's other sockets.
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(self._endpoint)
        try:
            while True:
                with self._cond:
                    while not self._stop and self._armed is None:
                        self._cond.wait()
                    if self._stop:
                        return
                    fence, start, limit, expected = self._armed
                    left = start + limit - time.monotonic_ns()
                    if left > 0:
                        self._cond.wait(timeout=left / 1e9)
                        continue  # re-read: disarmed, re-armed or still due
                    self._armed = None
                reason = hang_message(fence, self.rank, limit, expected)
                log.error("%s; this rank exits", reason)
                error = Completion(
                    fence=fence, rank=self.rank, world_size=self.world_size, device_ns=0,
                    error=reason,
                )  # fmt: skip
                self.fired = reason
                sock.send(encode(error))
                if self.exit_process:
                    sock.close(linger=2000)
                    context.term()  # returns once the report left (or 2 s passed)
                    os._exit(HANG_EXIT_CODE)
        finally:
            if not sock.closed:
                sock.close(linger=0)
            context.term()
