"""Memory a large body leaves behind, handed back: glibc's ``malloc_trim``, once a
moment after the last large body (:data:`TRIMMER`), and a process's RSS."""

from __future__ import annotations

import asyncio
import ctypes
import os

TRIM_BODY_BYTES = 1 << 20  # after a body this large, free heap pages go back to the system


def _libc_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc keeps what a large
    body freed); a no-op without glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def rss_bytes(pid: int | None = None) -> int:
    """A process's resident set size (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Trimmer:
    """malloc_trim once, a moment after the last large body (not once per body)."""

    def __init__(self) -> None:
        self.handle: asyncio.TimerHandle | None = None

    def soon(self, delay_s: float = 0.5) -> None:
        loop = asyncio.get_running_loop()
        if self.handle is not None:
            self.handle.cancel()
        self.handle = loop.call_later(delay_s, self._run)

    def _run(self) -> None:
        self.handle = None
        release_memory()


TRIMMER = _Trimmer()
