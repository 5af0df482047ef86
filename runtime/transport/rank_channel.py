"""A rank's end of the rank transport: :class:`RankChannel`.

It connects a SUB to the coordinator's frames and a PUSH to its completions
(see :mod:`runtime.transport.channels`), answers the handshake's pings as they
arrive and reports every message it cannot decode to the coordinator.
"""

from __future__ import annotations

import zmq

from runtime.transport.catalog_report import CatalogReport
from runtime.transport.channels import (
    Channel,
    ChannelEndpoints,
    HandshakeTimeout,
    TransportError,
    deadline_in,
    logger,
)
from runtime.transport.codec import encode
from runtime.transport.completion import Completion
from runtime.transport.control import COORDINATOR_RANK, Control
from runtime.transport.fields import MAX_ERROR_CHARS, MAX_WORLD_SIZE
from runtime.transport.frame import Frame
from runtime.transport.inspection import RankStatus
from runtime.transport.schema import Message
from runtime.transport.security import ClientKeys, secure_client


class RankChannel(Channel):
    """A rank's end: SUB to the coordinator's frames, PUSH to its completions.

    Pings are answered as they arrive (in ``handshake`` and in ``recv``), so a
    rank only ever sees frames and shutdown/other control from ``recv``.

    ``keys``: connect as a CURVE client (every socket opened through
    ``_open``; other sockets of the rank that connect to the coordinator apply
    :func:`~runtime.transport.security.secure_client` with :attr:`keys`).
    """

    inbound = (Frame, Control)

    def __init__(
        self,
        endpoints: ChannelEndpoints,
        rank: int,
        *,
        context: zmq.Context | None = None,
        keys: ClientKeys | None = None,
    ) -> None:
        if not isinstance(endpoints, ChannelEndpoints):
            raise TypeError("endpoints must be a ChannelEndpoints")
        if keys is not None and not isinstance(keys, ClientKeys):
            raise TypeError(f"keys must be ClientKeys or None, got {type(keys).__name__}")
        self.keys = keys
        if type(rank) is not int or not 0 <= rank < MAX_WORLD_SIZE:
            raise ValueError(f"rank must lie in [0, {MAX_WORLD_SIZE}), got {rank!r}")
        super().__init__(f"rank {rank} channel", context)
        self.rank = rank
        self.endpoints = endpoints
        try:
            self._push = self._open(zmq.PUSH, endpoints.completions, bind=False)
            self._inbox = self._open(zmq.SUB, endpoints.frames, bind=False)
            self._inbox.setsockopt(zmq.SUBSCRIBE, b"")
        except BaseException:
            self.close()
            raise

    def open_heartbeat_socket(self) -> zmq.Socket | None:
        """A DEALER socket connected to the heartbeat endpoint (None: the endpoints
        name none), for the rank's heartbeat thread, which owns and closes it
        (before this channel closes: the context waits for it)."""
        if not self.endpoints.heartbeat:
            return None
        sock = self._open(zmq.DEALER, self.endpoints.heartbeat, bind=False)
        self._sockets.remove(sock)
        return sock

    def _reject(self, reason: str) -> None:
        """Never silence: a message from the coordinator this rank cannot decode
        may have been a frame, so the coordinator hears of it at once
        (``Control("error")``) and fails the frames in flight instead of
        waiting for their completions."""
        super()._reject(reason)
        if self._closed:
            return
        try:
            self.send(Control("error", self.rank, reason=reason[:MAX_ERROR_CHARS]))
        except (TransportError, zmq.ZMQError) as exc:
            logger.warning("%s: could not report the rejection: %s", self.name, exc)

    def send(self, message: Completion | CatalogReport | Control | RankStatus) -> None:
        """Queue a message for the coordinator (blocks only behind HIGH_WATER_MARK unsent)."""
        if not isinstance(message, (Completion, CatalogReport, Control, RankStatus)):
            raise TypeError(
                f"a rank sends Completion, CatalogReport, Control or RankStatus, not {message!r}"
            )
        if message.rank != self.rank:
            raise ValueError(f"{self.name} cannot send a message for rank {message.rank}")
        if self._closed:
            raise TransportError(f"{self.name} is closed")
        self._push.send(encode(message))

    def handshake(self, timeout_ms: int = 30_000) -> None:
        """Wait for the coordinator's first ping and answer it; HandshakeTimeout otherwise."""
        deadline = deadline_in(timeout_ms)
        while True:
            message = self._next(deadline)
            if message is None:
                hint = (
                    " (with CURVE keys: a coordinator that refuses them logs why, naming "
                    "the reason; see docs/security.md)"
                    if self.keys is not None
                    else ""
                )
                raise HandshakeTimeout(
                    f"{self.name}: no ping from the coordinator at {self.endpoints.frames} "
                    f"within {timeout_ms} ms{hint}"
                )
            if isinstance(message, Control) and message.command == "ping":
                return
            self._pending.append(message)

    def recv(self, timeout_ms: int | None = None, spin_us: int = 0) -> Frame | Control | None:
        """The next frame or coordinator control message, or None after ``timeout_ms``.

        ``spin_us``: busy-poll that long before blocking (see ``_ready``).
        """
        if self._pending:
            return self._pending.popleft()  # type: ignore[return-value]
        deadline = deadline_in(timeout_ms)
        while True:
            message = self._next(deadline, spin_us)
            if isinstance(message, Control) and message.command == "ping":
                continue
            return message  # type: ignore[return-value]

    def _admit(self, message: Message) -> Message | None:
        if isinstance(message, Control):
            if message.rank != COORDINATOR_RANK or message.command == "ready":
                self._reject(f"Control {message.command!r} from rank {message.rank}")
                return None
            if message.command == "ping":
                self.send(Control("ready", self.rank, message.nonce))
        return message

    def _secure(self, sock: zmq.Socket, endpoint: str) -> None:
        if self.keys is not None:
            secure_client(sock, self.keys)

    def close(self, linger_ms: int = 0) -> None:
        """Close at once; ``linger_ms`` > 0 first gives queued sends that long to leave."""
        if not self._closed and linger_ms > 0:
            self._push.setsockopt(zmq.LINGER, linger_ms)
            self._push.close()
        super().close()
