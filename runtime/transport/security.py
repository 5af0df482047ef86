"""Authenticated, encrypted transport: ZeroMQ CURVE keys and socket options.

Every socket that connects to the coordinator (a rank's SUB and PUSH, its
watchdog's PUSH, its heartbeat DEALER) is a CURVE *client*; the coordinator's
PUB, PULL and heartbeat ROUTER are CURVE *servers*.  CURVE encrypts and
authenticates every message with keys negotiated per connection, so a peer
without a client secret can neither read a frame nor write a completion.  Which
clients may connect is the ZAP handler's decision
(:class:`~runtime.transport.gatekeeper.Gatekeeper`).

Keys are z85 strings (40 characters, 32 bytes).  ``flare keys DIR`` writes them
to files, one directory per host (:mod:`runtime.transport.key_files`).  Local
deployments over TCP create keys per run (:func:`per_run_keys`) and hand the
client keys to their ranks through the environment (:data:`ENV_SERVER_KEY`,
:data:`ENV_CLIENT_PUBLIC`, :data:`ENV_CLIENT_SECRET`), never on a command line
(which every user of the machine can read in ``ps``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

MAX_CLIENTS = 1024

ENV_SERVER_KEY = "FLARE_TRANSPORT_SERVER_KEY"
ENV_CLIENT_PUBLIC = "FLARE_TRANSPORT_CLIENT_PUBLIC"
ENV_CLIENT_SECRET = "FLARE_TRANSPORT_CLIENT_SECRET"

ZAP_DOMAIN = "flare"
KEY_CHARS = 40  # z85 of 32 bytes


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
