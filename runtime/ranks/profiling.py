"""A rank's on-demand profiler: ``torch.profiler`` over its next N frames.

``Control("profile", nonce, count=N)`` (``POST /debug/profile?frames=N``)
starts :class:`RankProfiler`; it records the rank's host stages as named
ranges (``frame``, ``check+pack``, ``launch``, ``wait``, ``publish``) plus every
operator, and on CUDA the kernels and an NVTX range per stage.  After the Nth
frame is published it stops, writes ``DIR/profile-<nonce>/rank<r>.json``
(Chrome trace format: ``chrome://tracing`` or https://ui.perfetto.dev), mode
0600 in 0700 directories, and answers ``Control("profiled", rank, nonce,
count=N)`` (``count=0``: no directory was given, or the trace could not be
written; the rank log says why).

``FLARE_NVTX=1`` keeps the NVTX stage ranges on for every frame (for an
``nsys profile`` of the whole run) without ``torch.profiler``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from runtime.private_files import FILE_MODE, make_private_dirs
from runtime.transport.control import Control, profile_path

log = logging.getLogger("runtime.ranks.profiling")

NO_RANGE = contextlib.nullcontext()


class RankProfiler:
    """At most one profile at a time; :meth:`range` costs nothing while idle."""

    def __init__(self, rank: int, device: torch.device, directory: str | None) -> None:
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.directory = directory
        self.nvtx = self.cuda and os.environ.get("FLARE_NVTX") == "1"
        self._profile: torch.profiler.profile | None = None
        self._nonce = 0
        self._wanted = 0
        self._done = 0

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, nonce: int, frames: int) -> Control | None:
        """Profile the next ``frames`` frames; a refusal is answered at once."""
        if self.directory is None:
            log.error("rank %d: profile %d refused: no --profile-dir", self.rank, nonce)
            return Control("profiled", self.rank, nonce, 0)
        if self._profile is not None:
            log.error("rank %d: profile %d refused: profile %d runs", self.rank, nonce, self._nonce)
            return Control("profiled", self.rank, nonce, 0)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True)
        profile.__enter__()
        self._profile, self._nonce, self._wanted, self._done = profile, nonce, frames, 0
        log.info("rank %d: profiling the next %d frames (profile %d)", self.rank, frames, nonce)
        return None

    def range(self, name: str) -> contextlib.AbstractContextManager:
        """A named range of the rank's timeline while profiling (and NVTX on CUDA)."""
        if self._profile is None and not self.nvtx:
            return NO_RANGE
        return self._range(name)

    @contextlib.contextmanager
    def _range(self, name: str) -> Iterator[None]:
        nvtx = self.cuda and (self.nvtx or self._profile is not None)
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            if self._profile is not None:
                with torch.profiler.record_function(name):
                    yield
            else:
                yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()

    def frame_done(self) -> Control | None:
        """Count a published frame; after the last one, the trace and the answer."""
        if self._profile is None:
            return None
        self._done += 1
        if self._done < self._wanted:
            return None
        return self.finish()

    def finish(self) -> Control:
        """Stop now (also at shutdown) and write the trace of the frames so far."""
        profile, nonce, frames = self._profile, self._nonce, self._done
        assert profile is not None and self.directory is not None
        self._profile = None
        path = profile_path(self.directory, nonce, self.rank)
        try:
            profile.__exit__(None, None, None)
            make_private_dirs(os.path.dirname(path))
            profile.export_chrome_trace(path)
            os.chmod(path, FILE_MODE)
        except (OSError, RuntimeError) as exc:
            log.error("rank %d: profile %d: cannot write %s: %s", self.rank, nonce, path, exc)
            return Control("profiled", self.rank, nonce, 0)
        log.info("rank %d: profile %d: %d frames written to %s", self.rank, nonce, frames, path)
        return Control("profiled", self.rank, nonce, frames)
