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
:meth:`CoordinatorChannel.handshake`: the coordinator publishes
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
removed on close, holding a ``pid`` file; :func:`make_run_dir` first removes
the directories a killed process left behind); TCP binds only loopback
addresses unless ``allow_remote``.
A channel is not thread-safe: use it from one thread.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import secrets
import socket
import stat
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import zmq

from runtime.transport.codec import MAX_MESSAGE_BYTES, decode, encode
from runtime.transport.recording import FrameRecorder
from runtime.transport.schema import (
    COORDINATOR_RANK,
    MAX_ERROR_CHARS,
    MAX_WORLD_SIZE,
    CatalogReport,
    Completion,
    Control,
    Frame,
    Message,
    ProtocolError,
    RankStatus,
)
from runtime.transport.security import (
    ClientKeys,
    Gatekeeper,
    ServerKeys,
    secure_client,
    secure_server,
)

logger = logging.getLogger("runtime.transport")

PING_INTERVAL_S = (0.005, 0.1)  # the handshake's first and longest ping interval
HANDSHAKE_PROGRESS_S = 30.0  # how often a long handshake logs who it still waits for
MAX_IPC_PATH = 100  # sockaddr_un holds 108 bytes on Linux, fewer elsewhere
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


def _deadline(timeout_ms: int | None) -> float | None:
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


_C = TypeVar("_C", bound="_Channel")


class _Channel:
    """Receive loop, pending messages, rejection logging and teardown."""

    inbound: tuple[type, ...] = ()

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
                if inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
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


# ------------------------------------------------------------------ coordinator


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


PID_FILE = "pid"
TRANSPORT_RUN_PREFIX = "flare-transport-"
TRANSPORT_RUN_FILES = ("frames", "completions", "heartbeat")


def make_run_dir(prefix: str, files: tuple[str, ...], parent: str | None = None) -> str:
    """A fresh 0700 directory ``parent/prefix*`` (the system temp dir by default)
    holding a ``pid`` file with this process's id, for sockets named ``files``.

    Directories with the same prefix that a dead process left behind (SIGKILL skips
    every clean-up) are removed first, see :func:`remove_stale_run_dirs`.
    """
    remove_stale_run_dirs(prefix, files, parent)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    fd = os.open(os.path.join(path, PID_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    return path


def remove_stale_run_dirs(
    prefix: str, files: tuple[str, ...], parent: str | None = None
) -> list[str]:
    """Remove the run directories ``parent/prefix*`` provably left by a dead process;
    the paths removed.

    A directory goes only when all of this holds: it is a real directory (not a
    link) owned by this user; its ``pid`` file names a process that no longer
    exists (a process of another user counts as alive); no socket in it accepts a
    connection (a live owner in another pid namespace would); and it holds
    nothing but that file and the sockets ``files``.  Anything else is left as it
    is: a directory without a ``pid`` file, say, cannot be proved stale.
    """
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(prefix)]
    except OSError:
        return removed
    allowed = {PID_FILE, *files}
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            names = set(os.listdir(entry.path))
            if PID_FILE not in names or not names <= allowed:
                continue
            pid = _read_pid(os.path.join(entry.path, PID_FILE))
            if pid is None or _alive(pid):
                continue
            if any(_listening(os.path.join(entry.path, name)) for name in names - {PID_FILE}):
                continue
            for name in names:
                os.unlink(os.path.join(entry.path, name))
            os.rmdir(entry.path)
        except OSError:  # raced with its owner or another clean-up: leave it
            continue
        removed.append(entry.path)
        logger.info("removed %s, left behind by process %d", entry.path, pid)
    return removed


def _read_pid(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd) as f:
            text = f.read(32)
    except OSError:
        return None
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and 0 < int(text) < 2**31 else None


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listening(path: str) -> bool:
    """Whether the Unix socket at ``path`` accepts a connection (a live owner)."""
    try:
        if not stat.S_ISSOCK(os.stat(path, follow_symlinks=False).st_mode):
            return False
    except OSError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def _remove_run_dir(path: str, files: tuple[str, ...]) -> None:
    for file in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove transport run directory %s: %s", path, exc)


class CoordinatorChannel(_Channel):
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
                self.run_dir = make_run_dir(TRANSPORT_RUN_PREFIX, TRANSPORT_RUN_FILES, run_dir)
                paths = tuple(os.path.join(self.run_dir, n) for n in TRANSPORT_RUN_FILES)
                owned = (*paths, os.path.join(self.run_dir, PID_FILE))
                self._finalizer = weakref.finalize(self, _remove_run_dir, self.run_dir, owned)
                if len(paths[1]) > MAX_IPC_PATH:
                    raise EndpointError(f"ipc path too long ({len(paths[1])} bytes): {paths[1]}")
                wanted = tuple(f"ipc://{p}" for p in paths)
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
        deadline = _deadline(timeout_ms)
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
        if getattr(self, "recorder", None) is not None:
            self.recorder.close()
        if getattr(self, "_gatekeeper", None) is not None:
            self._gatekeeper.close()  # its sockets go before the context terminates
        super().close()
        if self._finalizer is not None:
            self._finalizer()


# ------------------------------------------------------------------ ranks


class RankChannel(_Channel):
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
        deadline = _deadline(timeout_ms)
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
        deadline = _deadline(timeout_ms)
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
