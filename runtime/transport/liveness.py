"""Liveness both ways: heartbeats between the coordinator and every rank.

The frames and completions channels carry work; a peer that dies or stops
(SIGKILL, SIGSTOP, a lost host) shows there only as silence, which is
indistinguishable from a long frame.  So each side runs a dedicated thread with
a socket of its own on a third endpoint, ``heartbeat`` (ChannelEndpoints):

* the coordinator's :class:`CoordinatorLiveness` owns a ROUTER socket bound
  there (by :class:`~runtime.transport.coordinator_channel.CoordinatorChannel`, so the
  channel's security and size limits apply), sends ``Control("heartbeat")`` to
  every rank it has heard from every ``interval_s`` and records each rank's
  last heartbeat;
* a rank's :class:`RankHeartbeat` owns a DEALER socket connected to it, sends
  ``Control("heartbeat", rank)`` every ``interval_s`` and records the
  coordinator's last one.

Both threads wait in ``zmq_poll``, which releases the GIL, and so does torch
inside its kernels: a rank busy in a multi-second CPU frame keeps sending.  The
coordinator counts a rank's silence from the LATER of its last heartbeat and
the in-flight head frame's expected end (:meth:`CoordinatorLiveness.expect_until`,
set by the engine), so a frame expected to run long never makes its ranks look
dead.  A rank silent for ``timeout_s`` is reported once to ``on_gone(rank,
reason)`` (the engine fails, naming the rank and the fences in flight).  A rank
that has heard nothing from the coordinator for ``timeout_s`` logs why and ends
its process at once (``os._exit``: its main thread may be blocked in a receive
or a collective that never returns), with :data:`COORDINATOR_GONE_EXIT_CODE`.

Every message is decoded and validated; anything other than a heartbeat of a
rank of this deployment (or, on a rank, of the coordinator) is dropped with a
logged reason and counted in ``rejected``.  Sends never block (``NOBLOCK``: a
heartbeat that cannot be queued is skipped; the next one follows).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from runtime.transport.codec import decode, encode
from runtime.transport.control import COORDINATOR_RANK, Control
from runtime.transport.fields import ProtocolError

log = logging.getLogger("runtime.transport.liveness")

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0
COORDINATOR_GONE_EXIT_CODE = 4  # a rank whose coordinator stopped answering
MAX_POLL_S = 0.2  # the longest a thread waits before looking at its stop flag
# After the coordinator's farewell a rank waits this long for its frames to end
# and the shutdown to arrive before it leaves on its own.
FAREWELL_GRACE_S = 600.0
FAREWELL_LINGER_MS = 500  # how long the farewell may take to leave the socket
MAX_REJECT_LOGS = 20  # rejections logged per thread (all are counted)


@dataclass(frozen=True)
class LivenessConfig:
    """Heartbeat settings, the same on both sides: one every ``interval_s``; a
    peer silent for ``timeout_s`` is gone (``timeout_s`` > ``interval_s``)."""

    interval_s: float = HEARTBEAT_INTERVAL_S
    timeout_s: float = HEARTBEAT_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"heartbeat {name} must be a number of seconds, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"heartbeat {name} must be a finite number > 0, got {value!r}")
        if self.timeout_s <= self.interval_s:
            raise ValueError(
                f"heartbeat timeout_s ({self.timeout_s:g} s) must exceed interval_s "
                f"({self.interval_s:g} s): a peer would look gone between two heartbeats"
            )


class _Beat:
    """The loop both sides share: send every interval, take what arrives, check."""

    accepted: tuple[str, ...] = ("heartbeat",)  # the Control commands this side takes

    def __init__(self, sock: zmq.Socket, config: LivenessConfig, name: str) -> None:
        if not isinstance(config, LivenessConfig):
            raise TypeError(f"config must be a LivenessConfig, got {config!r}")
        self.config = config
        self.name = name
        self.rejected = 0  # messages dropped with a logged reason
        self.sent = 0
        self._sock = sock
        self._stop = threading.Event()
        self._say_farewell = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 5.0, *, farewell: bool = False) -> None:
        """Stop the thread; it closes its socket (call before the socket's context ends).
        ``farewell``: first tell the peers this is a stop, not a death."""
        self._say_farewell = farewell
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        if self.rejected <= MAX_REJECT_LOGS:
            log.warning("%s: rejected message: %s", self.name, reason)

    def _decode(self, data: bytes) -> Control | None:
        try:
            message = decode(data)
        except ProtocolError as exc:
            self._reject(str(exc))
            return None
        if not isinstance(message, Control) or message.command not in self.accepted:
            what = message.command if isinstance(message, Control) else type(message).__name__
            self._reject(f"{what!r} on the heartbeat socket")
            return None
        return message

    def _run(self) -> None:
        sock, interval_ns = self._sock, int(self.config.interval_s * 1e9)
        next_send = 0
        try:
            while not self._stop.is_set():
                now = time.monotonic_ns()
                if now >= next_send:
                    self._send_all()
                    next_send = now + interval_ns
                if self._check(time.monotonic_ns()):
                    return
                wait_ms = max(0, min(next_send - time.monotonic_ns(), MAX_POLL_S * 1e9)) / 1e6
                if sock.poll(math.ceil(wait_ms), zmq.POLLIN):
                    while True:
                        try:
                            parts = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._take(parts, time.monotonic_ns())
            if self._say_farewell:
                self._farewell()
        except zmq.ZMQError as exc:  # the context went away under us: nothing to watch
            if not self._stop.is_set():
                log.error("%s: heartbeat socket failed: %s", self.name, exc)
        finally:
            sock.close(linger=FAREWELL_LINGER_MS if self.said_farewell else 0)

    said_farewell = False

    def _farewell(self) -> None:
        """On :meth:`close`: tell the peers this is a stop, not a death (nothing here)."""

    def _send(self, parts: list[bytes]) -> None:
        try:
            self._sock.send_multipart(parts, zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:  # a full queue: this heartbeat is skipped, the next follows
            pass

    def _send_all(self) -> None:
        raise NotImplementedError

    def _take(self, parts: list[bytes], now_ns: int) -> None:
        raise NotImplementedError

    def _check(self, now_ns: int) -> bool:
        """Look for silent peers; True ends the thread."""
        raise NotImplementedError


class CoordinatorLiveness(_Beat):
    """The coordinator's heartbeat thread around a bound ROUTER ``sock`` (taken over:
    the thread uses and closes it).

    ``on_gone(rank, reason)`` is called once per rank that falls silent, from
    this thread.  A rank is watched from its first heartbeat, and after
    :meth:`watch_all` every rank 0..world_size-1 is (one that never sends a
    heartbeat is gone ``timeout_s`` later).  Start it before the handshake: a
    rank heartbeats from its own handshake on and must hear the coordinator
    while the slower ranks are still connecting.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        world_size: int,
        config: LivenessConfig,
        on_gone: Callable[[int, str], None],
    ) -> None:
        super().__init__(sock, config, "flare-liveness")
        self.world_size = world_size
        self.on_gone = on_gone
        self.gone: dict[int, str] = {}  # rank -> why
        self._last: list[int | None] = [None] * world_size  # monotonic ns of the last heartbeat
        self._identities: dict[int, bytes] = {}
        self._busy_until_ns = 0  # the head frame's expected end (one attribute store)
        self._sequence = 0

    def watch_all(self) -> None:
        """Watch every rank from now on, those not heard from yet included (call it
        once every rank has answered the handshake)."""
        now = time.monotonic_ns()
        self._last = [now if last is None else last for last in self._last]

    def expect_until(self, end_ns: int) -> None:
        """The frame in flight is expected to end at ``end_ns`` (monotonic ns; 0:
        nothing in flight): no rank counts as silent before then."""
        self._busy_until_ns = end_ns

    def last_heartbeat_ns(self, rank: int) -> int | None:
        """When rank ``rank``'s last heartbeat arrived (None: none yet)."""
        return self._last[rank]

    @property
    def heard(self) -> list[int]:
        """The ranks that have sent a heartbeat."""
        return sorted(self._identities)

    def silent(self, now_ns: int | None = None) -> list[tuple[int, float]]:
        """(rank, seconds since its last heartbeat) of every watched rank silent past
        the timeout, by the rule :meth:`_check` applies (any thread; it reports them
        to ``on_gone`` on its next look; this says so at once)."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        timeout_ns = self.config.timeout_s * 1e9
        busy_until = self._busy_until_ns
        return [
            (rank, (now_ns - last) / 1e9)
            for rank, last in enumerate(list(self._last))
            if last is not None and now_ns - max(last, busy_until) > timeout_ns
        ]

    def _send_all(self) -> None:
        self._sequence += 1
        data = encode(Control("heartbeat", COORDINATOR_RANK, self._sequence))
        for identity in list(self._identities.values()):
            self._send([identity, data])

    def _farewell(self) -> None:
        """A normal stop: every rank hears ``Control("shutdown")`` here, so one still
        busy in a long frame (it reads the frames socket's shutdown only after the
        frame) does not take the silence that follows for a dead coordinator."""
        data = encode(Control("shutdown", COORDINATOR_RANK))
        for identity in list(self._identities.values()):
            self._send([identity, data])
        self.said_farewell = bool(self._identities)

    def _take(self, parts: list[bytes], now_ns: int) -> None:
        if len(parts) != 2:
            self._reject(f"{len(parts) - 1}-part message")
            return
        identity, data = parts
        message = self._decode(data)
        if message is None:
            return
        rank = message.rank
        if not 0 <= rank < self.world_size:
            self._reject(f"heartbeat from rank {rank} of world size {self.world_size}")
            return
        known = self._identities.get(rank)
        if known is not None and known != identity:
            log.warning("%s: rank %d heartbeats from a new connection", self.name, rank)
        self._identities[rank] = identity
        self._last[rank] = now_ns

    def _check(self, now_ns: int) -> bool:
        timeout_ns = self.config.timeout_s * 1e9
        busy_until = self._busy_until_ns
        for rank, last in enumerate(self._last):
            if last is None or rank in self.gone:
                continue
            since = max(last, busy_until)
            if now_ns - since <= timeout_ns:
                continue
            silent = (now_ns - last) / 1e9
            reason = (
                f"rank {rank} is gone: no heartbeat for {silent:.1f} s "
                f"(heartbeat timeout {self.config.timeout_s:g} s)"
            )
            self.gone[rank] = reason
            log.error("%s", reason)
            try:
                self.on_gone(rank, reason)
            except Exception:  # the watcher keeps watching the others
                log.exception("%s: on_gone failed", self.name)
        return False


class RankHeartbeat(_Beat):
    """A rank's heartbeat thread around a connected DEALER ``sock`` (taken over).

    The coordinator counts as heard at :meth:`start` (call it once the
    handshake succeeded).  Silent for ``timeout_s``: the reason is logged and
    kept in ``fired``; with ``exit_process`` the process ends at once with
    :data:`COORDINATOR_GONE_EXIT_CODE`, else the thread ends.
    """

    accepted = ("heartbeat", "shutdown")  # shutdown: the coordinator stops normally

    def __init__(
        self,
        sock: zmq.Socket,
        rank: int,
        config: LivenessConfig,
        *,
        endpoint: str = "",
        exit_process: bool = True,
    ) -> None:
        super().__init__(sock, config, f"rank{rank}-heartbeat")
        self.rank = rank
        self.endpoint = endpoint
        self.exit_process = exit_process
        self.fired: str | None = None
        self.heard = 0  # coordinator heartbeats received
        self.stopping = False  # the coordinator said shutdown on this socket
        self._last = time.monotonic_ns()
        self._sequence = 0

    def start(self) -> None:
        self._last = time.monotonic_ns()
        super().start()

    def _send_all(self) -> None:
        self._sequence += 1
        self._send([encode(Control("heartbeat", self.rank, self._sequence))])

    def _take(self, parts: list[bytes], now_ns: int) -> None:
        if len(parts) != 1:
            self._reject(f"multipart message ({len(parts)} parts)")
            return
        message = self._decode(parts[0])
        if message is None:
            return
        if message.rank != COORDINATOR_RANK:
            self._reject(f"heartbeat from rank {message.rank}, not the coordinator")
            return
        if message.command == "shutdown":
            if not self.stopping:
                log.info("%s: the coordinator is stopping", self.name)
            self.stopping = True
        self.heard += 1
        self._last = now_ns

    def _check(self, now_ns: int) -> bool:
        silent = (now_ns - self._last) / 1e9
        # A stopping coordinator goes quiet on purpose: the rank leaves once its
        # frames in flight are done and it reads the shutdown; only a rank stuck
        # far longer than that exits on its own.
        limit = max(self.config.timeout_s, FAREWELL_GRACE_S) if self.stopping else None
        if silent <= (limit or self.config.timeout_s):
            return False
        where = f" at {self.endpoint}" if self.endpoint else ""
        reason = (
            f"rank {self.rank}: no heartbeat from the coordinator{where} for {silent:.1f} s "
            f"(heartbeat timeout {self.config.timeout_s:g} s): the coordinator is gone"
        )
        self.fired = reason
        if self.exit_process:
            log.error("%s; this rank exits", reason)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(COORDINATOR_GONE_EXIT_CODE)
        log.error("%s", reason)
        return True


__all__ = [
    "COORDINATOR_GONE_EXIT_CODE",
    "HEARTBEAT_INTERVAL_S",
    "HEARTBEAT_TIMEOUT_S",
    "CoordinatorLiveness",
    "LivenessConfig",
    "RankHeartbeat",
]
