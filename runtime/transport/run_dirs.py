"""Private run directories for ``ipc://`` sockets: made 0700 with a ``pid`` file,
removed on close, and the ones a killed process left behind removed at the next
start (only when provably stale)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import tempfile

logger = logging.getLogger("runtime.transport")

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
    removed: list[str] = []
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


def remove_run_dir(path: str, files: tuple[str, ...]) -> None:
    """Remove the ``files`` of the run directory ``path``, then the directory."""
    for file in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove transport run directory %s: %s", path, exc)
