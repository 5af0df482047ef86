"""The host C heap of a rank process."""

from __future__ import annotations

import ctypes


def _libc_malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library, not Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc keeps what tensors of
    varying shapes freed in its arenas, and a rank's RSS creeps up with the mix of
    prompt lengths it has seen).  Called when the rank has been idle a second, so
    it costs no frame any time; a no-op without glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
