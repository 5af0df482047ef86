"""Files that may hold prompts (traces, frame recordings, rank logs): directories
created 0700, files 0600, whatever the umask, existing files narrowed too."""

from __future__ import annotations

import os

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_private_dirs(directory: str | os.PathLike) -> None:
    """Create ``directory`` and any missing parents, each mode 0700 (existing ones
    untouched); safe when several processes (the ranks) create it at once."""
    missing = []
    path = os.path.abspath(directory)
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:  # another process (a sibling rank) made it meanwhile
            if not os.path.isdir(path):
                raise
            continue  # theirs: made by the same rule, so already 0700
        os.chmod(path, DIR_MODE)  # the umask may have narrowed it; never widen beyond 0700


def open_private(path: str | os.PathLike, *, truncate: bool = True) -> int:
    """``path`` opened (created if needed) for appending, mode 0600: a file descriptor;
    ``truncate``: empty it first."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
    fd = os.open(path, flags, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # an existing file keeps its mode on open: narrow it
    return fd
