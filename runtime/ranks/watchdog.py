"""A rank's hang detector: a per-frame deadline watched from a second thread.

On CPU a program runs synchronously, so a hung frame never returns to the
rank's loop.  The watchdog thread owns its own PUSH socket to the
coordinator's completions endpoint (ZeroMQ sockets are not thread-safe); when
an armed deadline passes, it sends an error completion naming the fence and the
rank and where the rank's loop is stuck (the innermost Python frame of its
thread, and the innermost of this runtime's: a rank stuck in a collective
waits for another, the one stuck elsewhere is the cause), logs the whole
stack, then ends the process (the hung call cannot be interrupted).  On CUDA
the rank's loop polls events and applies the same deadline itself
(:func:`frame_deadline_ns`).

Arming is one attribute store (no lock, no wake-up: the rank's loop pays
nothing per frame); the thread looks at the armed deadline every ``tick_s``
(the rank uses an eighth of the margin, at most 1 s), so a report comes at
most that late, against deadlines of seconds, and the thread takes the GIL
rarely.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

import zmq

from runtime.transport.codec import encode
from runtime.transport.completion import Completion
from runtime.transport.security import ClientKeys, secure_client

log = logging.getLogger("runtime.ranks")

HANG_EXIT_CODE = 3
TICK_S = 0.05


def frame_deadline_ns(expected_ns: int, multiple: float, margin_s: float) -> int:
    """How long a frame may take: ``multiple`` x its expected duration + ``margin_s``."""
    return round(multiple * max(0, expected_ns) + margin_s * 1e9)


def hang_message(fence: int, rank: int, waited_ns: int, expected_ns: int) -> str:
    return (
        f"hung: rank {rank}: frame fence {fence} did not finish within "
        f"{waited_ns / 1e9:.3f} s (expected {expected_ns / 1e6:.3f} ms)"
    )


def where_stuck(thread_id: int) -> tuple[str, str]:
    """Where thread ``thread_id`` is now: a one-line summary, and its whole stack."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "", ""
    stack = traceback.extract_stack(frame)
    inner = stack[-1]
    line = f"stuck in {inner.name} ({os.path.basename(inner.filename)}:{inner.lineno})"
    ours = next((f for f in reversed(stack) if f"{os.sep}runtime{os.sep}" in f.filename), None)
    if ours is not None and ours is not inner:
        line += f" from {ours.name} ({os.path.basename(ours.filename)}:{ours.lineno})"
    return line, "".join(traceback.format_list(stack[-12:]))


class Watchdog:
    """Arm before running a frame, disarm after; a missed deadline reports and exits."""

    def __init__(
        self,
        endpoint: str,
        rank: int,
        world_size: int,
        *,
        exit_process: bool = True,
        tick_s: float = TICK_S,
        keys: ClientKeys | None = None,
    ) -> None:
        self.rank = rank
        self._keys = keys  # the rank channel's CURVE keys: the coordinator admits no other
        self.world_size = world_size
        self.exit_process = exit_process
        self.fired: str | None = None
        self._endpoint = endpoint
        self._tick_s = tick_s
        self._watched = threading.get_ident()  # the rank's loop builds the watchdog
        # (fence, start ns, limit ns, expected ns), replaced whole: atomic under the GIL.
        self._armed: tuple[int, int, int, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rank{rank}-watchdog", daemon=True)
        self._thread.start()

    def arm(self, fence: int, limit_ns: int, expected_ns: int) -> None:
        self._armed = (fence, time.monotonic_ns(), limit_ns, expected_ns)

    def disarm(self) -> None:
        self._armed = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        # A context of its own: terminating it flushes the report before the
        # process ends, without waiting on the rank's other sockets.
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        if self._keys is not None:
            secure_client(sock, self._keys)
        sock.connect(self._endpoint)
        try:
            while not self._stop.wait(self._tick_s):
                armed = self._armed
                if armed is None:
                    continue
                fence, start, limit, expected = armed
                if time.monotonic_ns() - start <= limit:
                    continue
                self._armed = None
                reason = hang_message(fence, self.rank, limit, expected)
                where, stack = where_stuck(self._watched)
                if where:
                    reason = f"{reason}; {where}"
                log.error("%s; this rank exits; its loop's stack:\n%s", reason, stack)
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
