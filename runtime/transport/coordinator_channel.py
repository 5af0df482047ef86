"""The coordinator's end of the rank transport: :class:`CoordinatorChannel`.

It binds the frames PUB, the completions PULL and (for the engine) the
heartbeat ROUTER, publishes frames and control messages, and runs the start-up
handshake that closes PUB/SUB's slow-joiner loss (see
:mod:`runtime.transport.channels`).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import time
import weakref
from collections.abc import Callable

import zmq

from runtime.transport.catalog_report import CatalogReport
from runtime.transport.channels import (
    Channel,
    ChannelEndpoints,
    EndpointError,
    HandshakeTimeout,
    TransportError,
    deadline_in,
    logger,
)
from runtime.transport.codec import encode
from runtime.transport.completion import Completion
from runtime.transport.control import COORDINATOR_RANK, Control
from runtime.transport.fields import MAX_WORLD_SIZE
from runtime.transport.frame import Frame
from runtime.transport.gatekeeper import Gatekeeper
from runtime.transport.inspection import RankStatus
from runtime.transport.recording import FrameRecorder
from runtime.transport.run_dirs import (
    PID_FILE,
    TRANSPORT_RUN_FILES,
    TRANSPORT_RUN_PREFIX,
    make_run_dir,
    remove_run_dir,
)
from runtime.transport.schema import Message
from runtime.transport.security import ServerKeys, secure_server

PING_INTERVAL_S = (0.005, 0.1)  # the handshake's first and longest ping interval
HANDSHAKE_PROGRESS_S = 30.0  # how often a long handshake logs who it still waits for
MAX_IPC_PATH = 100  # sockaddr_un holds 108 bytes on Linux, fewer elsewhere


def _loopback_host(host: str, allow_remote: bool) -> str:
    """``host`` as a ZeroMQ bind address; refuse non-loopback unless allowed."""
    text = "0.0.0.0" if host in ("*", "") else "127.0.0.1" if host == "localhost" else host
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        raise EndpointError(f"host must be an IP address or 'localhost', got {host!r}") from None
    if not ip.is_loopback and not allow_remote:
        raise EndpointError(
            f"refusing to bind {host!r}: not a loopback address; "
            "pass allow_remote=True to accept connections from other hosts"
        )
    return f"[{ip}]" if ip.version == 6 else str(ip)


class CoordinatorChannel(Channel):
    """The coordinator's end: binds PUB (frames, control) and PULL (from ranks).

    ``transport``: "ipc" (default: sockets in a fresh 0700 directory under
    ``run_dir`` or the system temp dir) or "tcp" on ``host`` (loopback unless
    ``allow_remote``) with ``frame_port``/``completion_port``/``heartbeat_port``
    (0: any free port).  Ranks connect to :attr:`endpoints`.  With
    ``heartbeat`` (the engine's channel), a heartbeat ROUTER socket is bound
    too (here, so every socket option applies) and handed to the liveness
    thread by :meth:`take_heartbeat_socket`; without it ``endpoints.heartbeat``
    is "" and the ranks run no heartbeat (tools and tests driving a bare
    channel, which sends none).

    ``keys``: make every socket a CURVE server behind a ZAP handler in this
    channel's context that admits only ``keys.clients``; refusals are counted
    in :attr:`auth_denied`.  None: no authentication (ipc in its 0700
    directory).
    """

    inbound = (Completion, CatalogReport, Control, RankStatus)

    def __init__(
        self,
        world_size: int,
        *,
        transport: str = "ipc",
        host: str = "127.0.0.1",
        frame_port: int = 0,
        completion_port: int = 0,
        heartbeat_port: int = 0,
        heartbeat: bool = False,
        allow_remote: bool = False,
        run_dir: str | None = None,
        context: zmq.Context | None = None,
        record_dir: str | None = None,
        keys: ServerKeys | None = None,
    ) -> None:
        if keys is not None and not isinstance(keys, ServerKeys):
            raise TypeError(f"keys must be ServerKeys or None, got {type(keys).__name__}")
        if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must lie in [1, {MAX_WORLD_SIZE}], got {world_size!r}")
        if transport not in ("ipc", "tcp"):
            raise EndpointError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        for name, port in (
            ("frame_port", frame_port),
            ("completion_port", completion_port),
            ("heartbeat_port", heartbeat_port),
        ):
            if type(port) is not int or not 0 <= port <= 65535:
                raise EndpointError(f"{name} must lie in [0, 65535], got {port!r}")
        # Refuse a non-loopback host before creating anything.
        address = _loopback_host(host, allow_remote) if transport == "tcp" else ""
        super().__init__("coordinator channel", context)
        self.world_size = world_size
        self.run_dir: str | None = None
        self._finalizer: weakref.finalize | None = None
        self.keys = keys
        self._gatekeeper: Gatekeeper | None = None
        try:
            if keys is not None:
                self._gatekeeper = Gatekeeper(self._context, keys, "coordinator transport")
            if transport == "ipc":
                wanted = self._ipc_endpoints(run_dir)
            else:
                ports = (frame_port or "*", completion_port or "*", heartbeat_port or "*")
                wanted = tuple(f"tcp://{address}:{p}" for p in ports)
            self._pub = self._open(zmq.PUB, wanted[0], bind=True)
            self._inbox = self._open(zmq.PULL, wanted[1], bind=True)
            self._heartbeat: zmq.Socket | None = (
                self._open(zmq.ROUTER, wanted[2], bind=True) if heartbeat else None
            )
            self.endpoints = ChannelEndpoints(
                frames=self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
                completions=self._inbox.getsockopt_string(zmq.LAST_ENDPOINT),
                heartbeat=""
                if self._heartbeat is None
                else self._heartbeat.getsockopt_string(zmq.LAST_ENDPOINT),
            )
        except BaseException:
            self.close()
            raise
        self.name = f"coordinator channel ({self.endpoints.completions})"
        # Frame recording (``flare run --record-frames``): published frames, rank
        # 0's catalog and completions, in channel order.
        self.recorder = FrameRecorder(record_dir) if record_dir else None

    def _ipc_endpoints(self, parent: str | None) -> tuple[str, ...]:
        """The ipc endpoints in a fresh run directory, removed when the channel goes."""
        self.run_dir = make_run_dir(TRANSPORT_RUN_PREFIX, TRANSPORT_RUN_FILES, parent)
        paths = tuple(os.path.join(self.run_dir, n) for n in TRANSPORT_RUN_FILES)
        owned = (*paths, os.path.join(self.run_dir, PID_FILE))
        self._finalizer = weakref.finalize(self, remove_run_dir, self.run_dir, owned)
        if len(paths[1]) > MAX_IPC_PATH:
            raise EndpointError(f"ipc path too long ({len(paths[1])} bytes): {paths[1]}")
        return tuple(f"ipc://{p}" for p in paths)

    def take_heartbeat_socket(self) -> zmq.Socket:
        """The bound heartbeat ROUTER socket, once: the caller's thread now owns it
        and must close it before this channel closes (the context waits for it)."""
        sock = self._heartbeat
        if sock is None or self._closed:
            raise TransportError(f"{self.name}: the heartbeat socket was taken or closed")
        self._heartbeat = None
        self._sockets.remove(sock)
        return sock

    def publish(self, message: Frame | Control) -> None:
        """Send a frame or a control message to every rank."""
        if not isinstance(message, (Frame, Control)):
            raise TypeError(f"the coordinator publishes Frame or Control, not {type(message)}")
        if isinstance(message, Control) and message.rank != COORDINATOR_RANK:
            raise ValueError(f"coordinator control messages carry rank {COORDINATOR_RANK}")
        if self._closed:
            raise TransportError(f"{self.name} is closed")
        data = encode(message)
        self._pub.send(data)
        if self.recorder is not None and isinstance(message, Frame):
            self.recorder.write("frame", data)

    def shutdown_ranks(self) -> None:
        self.publish(Control("shutdown"))

    def handshake(
        self, timeout_s: float = 30.0, abort: Callable[[], str | None] | None = None
    ) -> None:
        """Ping until every rank 0..world_size-1 has answered; HandshakeTimeout otherwise.

        Messages other than this handshake's replies that arrive meanwhile (a
        catalog report sent straight after answering) are kept for ``recv``.
        ``abort``: looked at between pings (at least every 0.1 s); a reason (a
        rank the heartbeats found gone) ends the wait with TransportError.
        """
        nonce = secrets.randbits(63)
        waiting = set(range(self.world_size))
        started = time.monotonic()
        deadline = started + timeout_s
        interval, next_ping = PING_INTERVAL_S[0], 0.0
        next_progress = started + HANDSHAKE_PROGRESS_S
        while waiting:
            now = time.monotonic()
            if now >= next_progress:  # ranks may take many minutes to load and prepare
                next_progress = now + HANDSHAKE_PROGRESS_S
                logger.info(
                    "waiting for rank(s) %s of %d at %s: %d answered, %.0f s waited, "
                    "%.0f s left",
                    sorted(waiting), self.world_size, self.endpoints.frames,
                    self.world_size - len(waiting), now - started, deadline - now,
                )  # fmt: skip
            why = abort() if abort is not None else None
            if why:
                raise TransportError(
                    f"{why} during the transport handshake (still waiting for rank(s) "
                    f"{sorted(waiting)})"
                )
            if now >= deadline:
                missing = tuple(sorted(waiting))
                raise HandshakeTimeout(
                    f"transport handshake timed out after {timeout_s:g} s: "
                    f"no ready from rank(s) {list(missing)} of {self.world_size} "
                    f"(ranks connect to {self.endpoints.frames})",
                    missing,
                )
            if now >= next_ping:
                self.publish(Control("ping", COORDINATOR_RANK, nonce))
                next_ping = now + interval
                interval = min(2 * interval, PING_INTERVAL_S[1])
            message = self._next(min(next_ping, deadline))
            if message is None:
                continue
            if isinstance(message, Control) and message.command == "ready":
                if message.nonce == nonce:
                    waiting.discard(message.rank)
                continue
            self._pending.append(message)

    def recv(
        self, timeout_ms: int | None = None, spin_us: int = 0
    ) -> Completion | CatalogReport | Control | None:
        """The next valid message from any rank, or None after ``timeout_ms``.

        ``spin_us``: busy-poll that long before blocking (see ``_ready``).
        """
        if self._pending:
            return self._pending.popleft()  # type: ignore[return-value]
        deadline = deadline_in(timeout_ms)
        while True:
            message = self._next(deadline, spin_us)
            if isinstance(message, Control) and message.command == "ready":
                logger.debug("%s: late ready from rank %d", self.name, message.rank)
                continue
            return message  # type: ignore[return-value]

    def _admit(self, message: Message) -> Message | None:
        if (
            self.recorder is not None
            and isinstance(message, (Completion, CatalogReport))
            and message.rank == 0
        ):
            self.recorder.write("report" if isinstance(message, CatalogReport) else "completion",
                                encode(message))  # fmt: skip
        if isinstance(message, Control) and not 0 <= message.rank < self.world_size:
            self._reject(f"Control from rank {message.rank} of world size {self.world_size}")
            return None
        if isinstance(message, (Completion, CatalogReport, RankStatus)) and (
            message.world_size != self.world_size
        ):
            self._reject(
                f"{type(message).__name__} from rank {message.rank} says world size "
                f"{message.world_size}, expected {self.world_size}"
            )
            return None
        return message

    def _secure(self, sock: zmq.Socket, endpoint: str) -> None:
        if self._gatekeeper is not None and self.keys is not None:
            secure_server(sock, self.keys)
            self._gatekeeper.watch(sock, endpoint)

    @property
    def auth_denied(self) -> int:
        """Peers refused by CURVE authentication (0 without keys)."""
        return 0 if self._gatekeeper is None else self._gatekeeper.denied

    def close(self) -> None:
        """Close the sockets and remove the ipc run directory."""
        recorder: FrameRecorder | None = getattr(self, "recorder", None)
        if recorder is not None:
            recorder.close()
        gatekeeper: Gatekeeper | None = getattr(self, "_gatekeeper", None)
        if gatekeeper is not None:
            gatekeeper.close()  # its sockets go before the context terminates
        super().close()
        if self._finalizer is not None:
            self._finalizer()
