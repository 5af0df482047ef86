"""ZeroMQ channels between the coordinator and the ranks.

Socket pattern
--------------
* frames: the coordinator binds a PUB socket, every rank connects a SUB socket
  subscribed to everything.  All ranks run the same program on the same frame,
  so one serialization and one send reach every rank, and ZeroMQ keeps each
  subscriber's stream in publication order.
* completions: the coordinator binds a PULL socket, every rank connects a PUSH
  socket (completions, catalog reports, handshake replies).

Why PUB/SUB and not one PUSH per rank: per-rank sockets would cost N encodes or
N sends per frame, N endpoints, and a way to keep N streams in the same order;
PUB/SUB gives a single ordered broadcast.  Its two ways of losing messages are
closed here: (1) a PUB drops a message only for a subscriber whose queue holds
:data:`HIGH_WATER_MARK` messages (on each end, so about twice that), and the
coordinator never lets a healthy rank fall that far behind: it keeps at most
two frames in flight (it publishes the next frame only after the completions of
an earlier one), and the control messages beside them (pings until the
handshake ends, a handful of inspection or profiling asks) are few and
answered.  Only a rank that has stopped reading for thousands of messages
could lose one, and such a rank is already dead or hung: its missing
completion and its heartbeats report it.  The bound (rather than 0, unlimited)
keeps a stuck peer from making the other end buffer without limit;
(2) the slow-joiner loss (a PUB
drops what it sends before a SUB's subscription arrives) is closed by
:meth:`~runtime.transport.coordinator_channel.CoordinatorChannel.handshake`:
the coordinator publishes
``Control("ping", nonce)`` again and again until every rank has answered
``Control("ready", rank, nonce)`` on the PULL socket, so every SUB has provably
received a publication before the first frame.  What remains is a rank that
dies: it misses frames, which the coordinator sees as missing completions.

Receiving
---------
``recv(timeout_ms)`` returns the next valid message or None when the timeout
(None: forever, 0: do not wait) runs out.  Every received message is decoded
and validated; a malformed, wrong-version or misdirected message is logged on
the ``runtime.transport`` logger with its reason, counted in ``rejected``, and
skipped, and the channel keeps serving.  Handshake traffic is handled inside
the channels: a rank answers pings as they arrive, the coordinator drops late
``ready`` replies.

Bounds and security
-------------------
Every socket refuses an inbound message over :data:`MAX_SOCKET_MESSAGE_BYTES`
(``ZMQ_MAXMSGSIZE``: the codec's limit plus the CURVE envelope) while it
arrives, before it is buffered: ZeroMQ drops that connection and the channel
keeps serving the others.  With ``keys`` (:mod:`runtime.transport.security`)
the coordinator's sockets are CURVE servers behind a ZAP handler that admits
only the deployment's client keys, and a rank's are CURVE clients: frames and
completions are encrypted and authenticated, and a peer without the keys gets
nothing through (counted in ``CoordinatorChannel.auth_denied``).

Endpoints default to ``ipc://`` sockets in a private run directory (mode 0700,
removed on close, holding a ``pid`` file;
:func:`~runtime.transport.run_dirs.make_run_dir` first removes
the directories a killed process left behind); TCP binds only loopback
addresses unless ``allow_remote``.
A channel is not thread-safe: use it from one thread.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import TypeVar, cast

import zmq

from runtime.transport.codec import MAX_MESSAGE_BYTES, decode
from runtime.transport.fields import ProtocolError
from runtime.transport.schema import Message

logger = logging.getLogger("runtime.transport")

# Messages queued per peer and direction; the protocol queues a handful (two
# frames in flight, their completions, a few controls), so only a peer that has
# stopped reading ever reaches it (see the module docstring).
HIGH_WATER_MARK = 1000
# The codec's limit plus the CURVE envelope around a message (command name,
# nonce, MAC: under 64 bytes) and a margin.
MAX_SOCKET_MESSAGE_BYTES = MAX_MESSAGE_BYTES + 4096


class TransportError(RuntimeError):
    """The transport cannot do what was asked."""


class EndpointError(TransportError, ValueError):
    """An endpoint is malformed or not allowed."""


class HandshakeTimeout(TransportError, TimeoutError):
    """The handshake did not finish in time; ``missing_ranks`` never answered."""

    def __init__(self, message: str, missing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


@dataclass(frozen=True)
class ChannelEndpoints:
    """Where ranks connect: ``frames`` (coordinator PUB), ``completions`` (PULL)
    and ``heartbeat`` (ROUTER, :mod:`runtime.transport.liveness`; "" = none)."""

    frames: str
    completions: str
    heartbeat: str = ""

    def __post_init__(self) -> None:
        for name in ("frames", "completions", "heartbeat"):
            value = getattr(self, name)
            if name == "heartbeat" and value == "":
                continue
            if not isinstance(value, str) or not value.startswith(("ipc://", "tcp://")):
                raise EndpointError(f"{name} endpoint must be ipc:// or tcp://, got {value!r}")


def deadline_in(timeout_ms: int | None) -> float | None:
    """The monotonic time ``timeout_ms`` from now (None: no deadline)."""
    if timeout_ms is None:
        return None
    if timeout_ms < 0:
        raise ValueError(f"timeout_ms must be >= 0 or None, got {timeout_ms}")
    return time.monotonic() + timeout_ms / 1000


def _remaining_ms(deadline: float | None) -> int | None:
    if deadline is None:
        return None
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


def make_socket(context: zmq.Context, kind: int, endpoint: str = "") -> zmq.Socket:
    """A socket with bounded queues and message size that closes at once."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_SOCKET_MESSAGE_BYTES)
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


_C = TypeVar("_C", bound="Channel")


class Channel:
    """Either end's base: receive loop, pending messages, rejection logging and teardown
    (:class:`~runtime.transport.coordinator_channel.CoordinatorChannel`,
    :class:`~runtime.transport.rank_channel.RankChannel`)."""

    inbound: tuple[type[Message], ...] = ()

    def __init__(self, name: str, context: zmq.Context | None) -> None:
        self.name = name
        self.rejected = 0  # messages dropped with a logged reason
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self._sockets: list[zmq.Socket] = []
        self._inbox: zmq.Socket | None = None
        self._pending: deque[Message] = deque()
        self._closed = False

    def _secure(self, sock: zmq.Socket, endpoint: str) -> None:
        """Apply the channel's security options to ``sock`` before it binds or connects."""

    def _open(self, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
        sock = make_socket(self._context, kind, endpoint)
        self._sockets.append(sock)
        self._secure(sock, endpoint)
        try:
            sock.bind(endpoint) if bind else sock.connect(endpoint)
        except zmq.ZMQError as exc:
            verb = "bind" if bind else "connect"
            raise TransportError(f"{self.name}: cannot {verb} {endpoint}: {exc}") from exc
        return sock

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        logger.warning("%s: rejected message: %s", self.name, reason)

    def _admit(self, message: Message) -> Message | None:
        """The message for the caller, or None after ``_reject``."""
        raise NotImplementedError

    def _ready(self, deadline: float | None, spin_us: int) -> bool:
        """Whether a message waits in the inbox before ``deadline``.

        Busy-polls for up to ``spin_us`` first, then blocks in ``zmq_poll``.
        Waking a blocked process costs tens of microseconds per hop on Linux;
        a caller that expects a message within a few hundred microseconds (a
        frame about to complete, the frame after a completion) spins instead.
        The spin yields the CPU between polls, so a process that shares its
        core (a rank, a ZeroMQ I/O thread) still runs at once.
        """
        inbox = self._inbox
        assert inbox is not None
        if spin_us > 0:
            now = time.monotonic()
            end = now + spin_us / 1e6
            if deadline is not None:
                end = min(end, deadline)
            while True:
                if cast(int, inbox.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return True
                if time.monotonic() >= end:
                    break
                os.sched_yield()
        return bool(inbox.poll(_remaining_ms(deadline), zmq.POLLIN))

    def _next(self, deadline: float | None, spin_us: int = 0) -> Message | None:
        """The next admitted message from the socket, or None at the deadline."""
        if self._closed or self._inbox is None:
            raise TransportError(f"{self.name} is closed")
        while True:
            if not self._ready(deadline, spin_us):
                return None
            parts = self._inbox.recv_multipart(zmq.NOBLOCK)
            if len(parts) != 1:
                self._reject(f"multipart message ({len(parts)} parts)")
                continue
            try:
                message = decode(parts[0])
            except ProtocolError as exc:
                self._reject(str(exc))
                continue
            if not isinstance(message, self.inbound):
                self._reject(f"unexpected {type(message).__name__} on this channel")
                continue
            admitted = self._admit(message)
            if admitted is not None:
                return admitted

    def close(self) -> None:
        """Close the sockets at once (linger 0) and the context if the channel made it."""
        if self._closed:
            return
        self._closed = True
        for sock in self._sockets:
            sock.close(linger=0)
        if self._own_context:
            self._context.term()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
