"""Key files: ``flare keys DIR`` writes one directory per host
(:func:`generate_keys`, docs/security.md), which the coordinator and the rank
hosts load (:func:`load_server_keys`, :func:`load_client_keys`)::

    DIR/coordinator/server.key            the server public key
    DIR/coordinator/server.key_secret     the server secret key (coordinator only)
    DIR/coordinator/authorized_clients/ranks-K.key   each rank host's public key
    DIR/ranks-K/server.key                the server public key
    DIR/ranks-K/client.key                rank host K's public key
    DIR/ranks-K/client.key_secret         rank host K's secret key (that host only)

Directories are 0700, files 0600, and a secret file that the group or others
may read is refused naming the file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from runtime.transport.security import (
    MAX_CLIENTS,
    ClientKeys,
    ServerKeys,
    TransportKeyError,
    check_key,
    per_run_keys,
)

SERVER_PUBLIC = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_PUBLIC = "client.key"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED_DIR = "authorized_clients"
COORDINATOR_DIR = "coordinator"
RANKS_DIR_PREFIX = "ranks-"


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
