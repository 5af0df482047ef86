"""A rank's debug drills, read from the environment at start (docs/debugging.md).

``FLARE_DEBUG_DELAY_NS_RANK<r>``: this rank sleeps that long in every frame and
reports it as device time (a slow-rank drill).  ``FLARE_DEBUG_HANG_FENCE_RANK<r>``:
its program hangs in the first frame it runs whose fence is at least that (a
hang drill: CPU sleeps in the call, CUDA spins on the device).
``FLARE_DEBUG_LAUNCH_DELAY_NS_RANK<r>``: it sleeps that long before each launch,
outside its timed region (a slow host: the other ranks wait at the first
collective, which their launch wait reports).  ``FLARE_DEBUG_PERTURB_FENCE_RANK<r>``:
with ``--check-ranks``, it reports one token off in the first frame from that
fence (a divergence drill).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("runtime.ranks")


@dataclass
class DebugDrills:
    """One rank's drills; the hang and the perturbation fire once (their fence
    goes back to -1)."""

    delay_ns: int = 0
    hang_fence: int = -1
    launch_delay_ns: int = 0
    perturb_fence: int = -1

    @classmethod
    def from_env(cls, rank: int) -> DebugDrills:
        return cls(
            delay_ns=int(os.environ.get(f"FLARE_DEBUG_DELAY_NS_RANK{rank}", "0")),
            hang_fence=int(os.environ.get(f"FLARE_DEBUG_HANG_FENCE_RANK{rank}", "-1")),
            launch_delay_ns=int(os.environ.get(f"FLARE_DEBUG_LAUNCH_DELAY_NS_RANK{rank}", "0")),
            perturb_fence=int(os.environ.get(f"FLARE_DEBUG_PERTURB_FENCE_RANK{rank}", "-1")),
        )

    def before_launch(self, fence: int, rank: int, device: torch.device) -> None:
        """The hang drill (once, from its fence), then the slow-host delay."""
        if 0 <= self.hang_fence <= fence:
            self.hang_fence = -1
            hang(rank, device)
        if self.launch_delay_ns:  # a slow host: late to launch, not a slow device
            time.sleep(self.launch_delay_ns / 1e9)

    def perturb(self, sampled: np.ndarray, fence: int) -> np.ndarray:
        """The divergence drill: from its fence, once, the first token one off."""
        if 0 <= self.perturb_fence <= fence and sampled.size:
            self.perturb_fence = -1  # the drill: one token off, once
            sampled = sampled.copy()
            sampled[0] += 1
        return sampled


def hang(rank: int, device: torch.device) -> None:
    """The hung call: on CUDA a device spin (the frame's event never completes),
    on CPU a sleep that never returns (the watchdog ends the process)."""
    log.warning("rank %d: FLARE_DEBUG_HANG_FENCE: hanging", rank)
    if device.type == "cuda":
        torch.cuda._sleep(1 << 62)  # a device spin: the frame's event never completes
        return
    while True:  # the hung call does not return; the watchdog ends the process
        time.sleep(3600)
