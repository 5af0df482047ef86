"""Authenticated, encrypted transport: ZeroMQ CURVE keys, files and the ZAP gate.

Every socket that connects to the coordinator (a rank's SUB and PUSH, its
watchdog's PUSH, its heartbeat DEALER) is a CURVE *client*; the coordinator's
PUB, PULL and heartbeat ROUTER are CURVE *servers*.  CURVE encrypts and
authenticates every message with keys negotiated per connection, so a peer
without a client secret can neither read a frame nor write a completion.  Which
clients may connect is the ZAP handler's decision (:class:`Gatekeeper`): it
admits only the deployment's client public keys, logs every refusal with its
reason and counts it (``denied``, exported as ``transport_auth_denied_total``).
Peers that fail earlier, in the CURVE handshake itself (no keys at all, the
wrong server key), never reach the ZAP handler; a socket monitor on every server
socket counts them too.

Keys are z85 strings (40 characters, 32 bytes).  ``flare keys DIR`` writes one
directory per host (:func:`generate_keys`, docs/security.md)::

    DIR/coordinator/server.key            the server public key
    DIR/coordinator/server.key_secret     the server secret key (coordinator only)
    DIR/coordinator/authorized_clients/ranks-K.key   each rank host's public key
    DIR/ranks-K/server.key                the server public key
    DIR/ranks-K/client.key                rank host K's public key
    DIR/ranks-K/client.key_secret         rank host K's secret key (that host only)

Directories are 0700, files 0600, and a secret file that the group or others
may read is refused naming the file.  Local deployments over TCP create keys
per run (:func:`per_run_keys`) and hand the client keys to their ranks through
the environment (:data:`ENV_SERVER_KEY`, :data:`ENV_CLIENT_PUBLIC`,
:data:`ENV_CLIENT_SECRET`), never on a command line (which every user of the
machine can read in ``ps``).
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from collections import deque
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger("runtime.transport")

SERVER_PUBLIC = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_PUBLIC = "client.key"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED_DIR = "authorized_clients"
COORDINATOR_DIR = "coordinator"
RANKS_DIR_PREFIX = "ranks-"
MAX_CLIENTS = 1024

ENV_SERVER_KEY = "FLARE_TRANSPORT_SERVER_KEY"
ENV_CLIENT_PUBLIC = "FLARE_TRANSPORT_CLIENT_PUBLIC"
ENV_CLIENT_SECRET = "FLARE_TRANSPORT_CLIENT_SECRET"

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "flare"
KEY_CHARS = 40  # z85 of 32 bytes
DENIAL_LOG_INTERVAL_S = 1.0  # repeats of one reason within this are counted, logged once


class TransportKeyError(ValueError):
    """A key, key file or key directory is missing, malformed or not private."""


def check_key(name: str, value: object) -> str:
    """``value`` as a z85 CURVE key; TransportKeyError naming ``name`` otherwise."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise TransportKeyError(f"{name}: not a z85 key (non-ASCII bytes)") from None
    if not isinstance(value, str):
        raise TransportKeyError(f"{name}: a key is a z85 string, got {type(value).__name__}")
    if len(value) != KEY_CHARS:
        raise TransportKeyError(f"{name}: a z85 key has {KEY_CHARS} characters, got {len(value)}")
    try:
        raw = z85.decode(value)
    except (ValueError, KeyError, TypeError):
        raise TransportKeyError(f"{name}: not a z85 key") from None
    if len(raw) != 32:
        raise TransportKeyError(f"{name}: not a 32-byte key")
    return value


def public_of(secret: str) -> str:
    """The public key of a secret key."""
    return zmq.curve_public(secret.encode("ascii")).decode("ascii")


def new_keypair() -> tuple[str, str]:
    """A fresh (public, secret) pair of z85 strings."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


@dataclass(frozen=True)
class ServerKeys:
    """The coordinator's keys: its own pair and the client public keys it admits."""

    public: str
    secret: str = field(repr=False)
    clients: tuple[str, ...]

    def __post_init__(self) -> None:
        check_key("server public key", self.public)
        check_key("server secret key", self.secret)
        if public_of(self.secret) != self.public:
            raise TransportKeyError("the server public key does not belong to its secret key")
        if not isinstance(self.clients, tuple) or not self.clients:
            raise TransportKeyError("the server admits no client key: give at least one")
        if len(self.clients) > MAX_CLIENTS:
            raise TransportKeyError(f"at most {MAX_CLIENTS} client keys, got {len(self.clients)}")
        for i, key in enumerate(self.clients):
            check_key(f"client public key {i}", key)
        if len(set(self.clients)) != len(self.clients):
            raise TransportKeyError("a client public key is listed twice")


@dataclass(frozen=True)
class ClientKeys:
    """A rank's keys: the server public key and the rank host's own pair."""

    server: str
    public: str
    secret: str = field(repr=False)

    def __post_init__(self) -> None:
        check_key("server public key", self.server)
        check_key("client public key", self.public)
        check_key("client secret key", self.secret)
        if public_of(self.secret) != self.public:
            raise TransportKeyError("the client public key does not belong to its secret key")

    def environment(self) -> dict[str, str]:
        """The environment variables that hand these keys to a local rank."""
        return {
            ENV_SERVER_KEY: self.server,
            ENV_CLIENT_PUBLIC: self.public,
            ENV_CLIENT_SECRET: self.secret,
        }

    @classmethod
    def from_environment(
        cls, env: Mapping[str, str] | None = None, *, remove: bool = True
    ) -> ClientKeys | None:
        """The keys in ``env`` (default: ``os.environ``), or None when none is set.

        ``remove``: delete the variables afterwards (from a mutable ``env``), so
        no child process of the rank inherits the secret.  Some but not all of
        the three set, or a malformed one: TransportKeyError naming it.
        """
        env = os.environ if env is None else env
        names = (ENV_SERVER_KEY, ENV_CLIENT_PUBLIC, ENV_CLIENT_SECRET)
        values = [env.get(name) for name in names]
        if remove and isinstance(env, MutableMapping):
            for name in names:
                env.pop(name, None)
        if all(v is None for v in values):
            return None
        missing = [name for name, v in zip(names, values) if not v]
        if missing:
            raise TransportKeyError(f"transport keys in the environment: {missing[0]} is not set")
        try:
            return cls(*values)  # type: ignore[arg-type]
        except TransportKeyError as exc:
            raise TransportKeyError(f"transport keys in the environment: {exc}") from None


@dataclass(frozen=True)
class DeploymentKeys:
    """Every key of one deployment: the server's and one client pair per rank host."""

    server: ServerKeys
    clients: tuple[ClientKeys, ...]


def per_run_keys(clients: int = 1) -> DeploymentKeys:
    """Fresh keys held only in memory, for a deployment that starts its own ranks."""
    if type(clients) is not int or not 1 <= clients <= MAX_CLIENTS:
        raise TransportKeyError(f"clients must lie in 1..{MAX_CLIENTS}, got {clients!r}")
    public, secret = new_keypair()
    pairs = [new_keypair() for _ in range(clients)]
    return DeploymentKeys(
        server=ServerKeys(public, secret, tuple(p for p, _ in pairs)),
        clients=tuple(ClientKeys(public, p, s) for p, s in pairs),
    )


# ------------------------------------------------------------------ key files


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode on open
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text + "\n")


def _make_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # the umask may have narrowed it, an old one may be wider


def generate_keys(directory: str | os.PathLike, clients: int = 1, force: bool = False) -> Path:
    """Write a deployment's keys under ``directory`` (layout in the module docstring).

    ``clients``: rank hosts, one client pair each (``ranks-0`` .. ``ranks-{N-1}``).
    Refuses to overwrite existing keys unless ``force``.  Returns the directory.
    """
    if type(clients) is not int or not 1 <= clients <= MAX_CLIENTS:
        raise TransportKeyError(f"--clients must lie in 1..{MAX_CLIENTS}, got {clients!r}")
    root = Path(directory)
    existing = [p for p in (root / COORDINATOR_DIR, root / f"{RANKS_DIR_PREFIX}0") if p.exists()]
    if existing and not force:
        raise TransportKeyError(
            f"{existing[0]} exists: refusing to overwrite keys (pass --force to replace them; "
            "every host then needs its new directory)"
        )
    keys = per_run_keys(clients)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    coordinator = root / COORDINATOR_DIR
    _make_private_dir(coordinator)
    authorized = coordinator / AUTHORIZED_DIR
    _make_private_dir(authorized)
    for old in authorized.glob("*.key"):  # --force: drop clients no longer wanted
        old.unlink()
    _write_private(coordinator / SERVER_PUBLIC, keys.server.public)
    _write_private(coordinator / SERVER_SECRET, keys.server.secret)
    for k, client in enumerate(keys.clients):
        _write_private(authorized / f"{RANKS_DIR_PREFIX}{k}.key", client.public)
        host = root / f"{RANKS_DIR_PREFIX}{k}"
        _make_private_dir(host)
        _write_private(host / SERVER_PUBLIC, client.server)
        _write_private(host / CLIENT_PUBLIC, client.public)
        _write_private(host / CLIENT_SECRET, client.secret)
    return root


def _read_key(path: Path, secret: bool) -> str:
    """One key file; a secret one must be private (not group or world readable)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise TransportKeyError(f"{path}: no such key file") from None
    except OSError as exc:
        raise TransportKeyError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise TransportKeyError(f"{path}: not a regular file")
    if secret and info.st_mode & 0o077:
        raise TransportKeyError(
            f"{path}: secret key file is readable by others "
            f"(mode {stat.S_IMODE(info.st_mode):04o}); run chmod 600 {path}"
        )
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TransportKeyError(f"{path}: cannot be read ({exc})") from None
    try:
        return check_key(str(path), text)
    except TransportKeyError as exc:
        raise TransportKeyError(f"{exc} (a key file holds one z85 key)") from None


def _bundle(directory: str | os.PathLike, marker: str, sub: str) -> Path:
    """``directory`` itself when it holds ``marker``, else its one ``sub*`` directory."""
    root = Path(directory)
    if not root.is_dir():
        raise TransportKeyError(f"{root}: no such key directory (write one with `flare keys`)")
    if (root / marker).exists():
        return root
    candidates = sorted(p for p in root.glob(f"{sub}*") if (p / marker).exists())
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise TransportKeyError(f"{root}: no {marker} here nor in a {sub}* directory")
    names = ", ".join(p.name for p in candidates)
    raise TransportKeyError(
        f"{root} holds several key directories ({names}): give the one for this host"
    )


def load_server_keys(directory: str | os.PathLike) -> ServerKeys:
    """The coordinator's keys from a ``flare keys`` directory (or its ``coordinator``)."""
    root = _bundle(directory, SERVER_SECRET, COORDINATOR_DIR)
    public = _read_key(root / SERVER_PUBLIC, secret=False)
    secret = _read_key(root / SERVER_SECRET, secret=True)
    files = sorted((root / AUTHORIZED_DIR).glob("*.key"))
    if not files:
        raise TransportKeyError(f"{root / AUTHORIZED_DIR}: no client public key (*.key) to admit")
    clients = tuple(_read_key(path, secret=False) for path in files)
    try:
        return ServerKeys(public, secret, clients)
    except TransportKeyError as exc:
        raise TransportKeyError(f"{root}: {exc}") from None


def load_client_keys(directory: str | os.PathLike) -> ClientKeys:
    """A rank host's keys from its ``ranks-K`` directory (or a directory holding one)."""
    root = _bundle(directory, CLIENT_SECRET, RANKS_DIR_PREFIX)
    server = _read_key(root / SERVER_PUBLIC, secret=False)
    public = _read_key(root / CLIENT_PUBLIC, secret=False)
    secret = _read_key(root / CLIENT_SECRET, secret=True)
    try:
        return ClientKeys(server, public, secret)
    except TransportKeyError as exc:
        raise TransportKeyError(f"{root}: {exc}") from None


# ------------------------------------------------------------------ sockets


def secure_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Make ``sock`` a CURVE server whose clients the ZAP handler must admit.

    ``ZAP_ENFORCE_DOMAIN``: without a ZAP handler in the context a client is
    refused, not admitted (libzmq admits every CURVE client then).
    """
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode("ascii"))
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode("ascii"))
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def secure_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` a CURVE client of the deployment's server."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode("ascii"))
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode("ascii"))


_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "a peer without CURVE keys (mechanism mismatch)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: (
        "a CURVE handshake that failed to decrypt (the wrong server key, or a forged handshake)"
    ),
}


class Gatekeeper:
    """The ZAP handler of one coordinator context, and the monitor of its server sockets.

    One thread answers ZAP requests (admitting only ``keys.clients``) and reads
    the monitor events of the sockets passed to :meth:`watch`.  Every refusal
    is counted in :attr:`denied` and logged with its reason (repeats of one
    reason within a second are counted and summarized in the next line, so a
    peer that reconnects ten times a second cannot flood the log).
    """

    def __init__(self, context: zmq.Context, keys: ServerKeys, name: str = "coordinator") -> None:
        self.name = name
        self._keys = keys
        self._allowed = {key.encode("ascii"): i for i, key in enumerate(keys.clients)}
        self._context = context
        self._lock = threading.Lock()
        self._denied = 0
        self.recent: deque[str] = deque(maxlen=32)  # the last reasons, for diagnosis
        self._last_logged: dict[str, tuple[float, int]] = {}
        self._new: queue.SimpleQueue[tuple[zmq.Socket, str]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._zap = context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        try:
            self._zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._zap.close(linger=0)
            raise zmq.ZMQError(
                exc.errno, f"a ZAP handler already serves this ZeroMQ context ({exc})"
            ) from exc
        self._monitors = 0
        self._thread = threading.Thread(target=self._run, name="flare-zap", daemon=True)
        self._thread.start()

    @property
    def denied(self) -> int:
        """Peers refused so far (ZAP denials and failed CURVE handshakes)."""
        with self._lock:
            return self._denied

    def watch(self, sock: zmq.Socket, endpoint: str) -> None:
        """Count the failed handshakes on ``sock`` (call before it binds)."""
        self._monitors += 1
        address = f"inproc://flare-zap-monitor-{id(self)}-{self._monitors}"
        sock.monitor(address, _HANDSHAKE_EVENTS)
        pair = self._context.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(address)
        self._new.put((pair, endpoint))  # the thread owns it from now on

    def deny(self, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._denied += 1
            self.recent.append(reason)
            last, suppressed = self._last_logged.get(reason, (-1e9, 0))
            if now - last < DENIAL_LOG_INTERVAL_S:
                self._last_logged[reason] = (last, suppressed + 1)
                return
            self._last_logged[reason] = (now, 0)
        more = f" ({suppressed} more like it since the last report)" if suppressed else ""
        logger.warning("%s: refused a peer: %s%s", self.name, reason, more)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: dict[zmq.Socket, str] = {}
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        pair, endpoint = self._new.get_nowait()
                    except queue.Empty:
                        break
                    monitors[pair] = endpoint
                    poller.register(pair, zmq.POLLIN)
                for sock, _ in poller.poll(100):
                    if sock is self._zap:
                        self._answer(self._zap.recv_multipart())
                    else:
                        self._event(sock.recv_multipart(), monitors[sock])
        except zmq.ZMQError as exc:  # the context went away under us
            if exc.errno != zmq.ETERM:
                logger.exception("%s: the ZAP handler failed", self.name)
        finally:
            for sock in (*monitors, self._zap):
                sock.close(linger=0)
            while True:
                try:
                    self._new.get_nowait()[0].close(linger=0)
                except queue.Empty:
                    break

    def _answer(self, request: list[bytes]) -> None:
        """Answer one ZAP request (RFC 27)."""
        if len(request) < 6:  # libzmq never sends one; a REP socket must answer anyway
            self.deny(f"malformed ZAP request of {len(request)} frames")
            request_id = request[1] if len(request) > 1 else b""
            self._zap.send_multipart([b"1.0", request_id, b"500", b"malformed", b"", b""])
            return
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        status, text, user = b"400", b"", b""
        peer = address.decode("ascii", "replace") or "?"
        if version != b"1.0":
            reason = f"ZAP version {version!r}"
        elif mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            reason = f"mechanism {mechanism.decode('ascii', 'replace')} from {peer}, CURVE required"
        else:
            key = z85.encode(credentials[0])
            index = self._allowed.get(key)
            if index is not None:
                status, text, user = b"200", b"OK", f"client-{index}".encode()
                reason = ""
            else:
                reason = (
                    f"client key {key[:8].decode()}... from {peer} is not one of the "
                    f"{len(self._allowed)} this deployment admits"
                )
        if status != b"200":
            text = reason.encode("utf-8")[:255]
            self.deny(reason)
        self._zap.send_multipart([b"1.0", request_id, status, text, user, b""])

    def _event(self, message: list[bytes], endpoint: str) -> None:
        try:
            event = parse_monitor_message(message)
        except (ValueError, TypeError, IndexError):
            return
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            what = _PROTOCOL_REASONS.get(value, f"ZMTP protocol error {value:#x}")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # A keyless peer that notices the mismatch first closes: this, not
            # the mismatch, is then what the server sees.
            what = (
                "a handshake that did not complete (a peer without CURVE keys, or one that "
                "closed or spoke no ZMTP)"
            )
        else:
            return
        where = event.get("endpoint", b"")
        where = where.decode("ascii", "replace") if isinstance(where, bytes) else endpoint
        self.deny(f"{what} on {where or endpoint}")

    def close(self) -> None:
        """Stop the thread and close its sockets (before the context terminates)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            logger.warning("%s: the ZAP handler did not stop within 5 s", self.name)
