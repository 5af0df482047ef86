"""A launched frame: its checked lanes, its variant, and how to learn it finished.

:meth:`PreparedProgram.launch <runtime.ranks.programs.PreparedProgram.launch>`
returns one; the frame loop polls it and the completion publisher reads its
host outputs (tokens, log probabilities, a scored prefill's prompt scores).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from runtime.ranks.checked_frame import CheckedFrame
from runtime.ranks.outputs import HostOutputs
from runtime.ranks.shapes import ProgramError, ProgramShape
from runtime.ranks.speculative import RoundOutputs


class LaunchedProgram(Protocol):
    """What a launch keeps of its program (a :class:`~runtime.ranks.programs.PreparedProgram`)."""

    shape: ProgramShape


@dataclass
class Launch:
    """One launched frame: its checked lanes, the variant, and how to learn it finished.

    CUDA: ``done`` is an event recorded after the host copies; ``start``/``end``
    bracket the replay.  CPU: the frame already ran (``device_ns`` is set).
    """

    checked: CheckedFrame
    program: LaunchedProgram | None  # None: a state frame (no forward)
    variant: str
    host: HostOutputs
    launched_ns: int
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    device_ns: int = 0
    launch_wait_ns: int = 0  # waiting for the other ranks at the first collective (CPU)
    stages: dict[str, int] = field(default_factory=dict)  # host ns per stage
    round: RoundOutputs | None = None  # a speculative round's host outputs
    times: list[int] = field(default_factory=list)  # received, launched, ended (monotonic ns)
    state: bool = False  # a state frame (RESTORE/SNAPSHOT): no tokens, one timed interval

    def finished(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def elapsed_ns(self) -> int:
        """The device interval (after :meth:`finished`)."""
        if self.start is not None and self.end is not None:
            return max(1, round(self.start.elapsed_time(self.end) * 1e6))
        return max(1, self.device_ns)

    def tokens(self) -> np.ndarray:
        """(R,) the sampled tokens (after :meth:`finished`)."""
        return self.host.token_array[: self.checked.lanes]

    def logprobs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 (R, 1 + k): the sampled token's log probability, then the top
        ``k``; int32 (R, k): their ids), after :meth:`finished`."""
        r = self.checked.lanes
        if not 0 <= k <= self.host.top_ids.shape[1]:
            raise ProgramError(f"{k} log probabilities, at most {self.host.top_ids.shape[1]}")
        values = torch.cat([self.host.logprob[:r, None], self.host.top_logprobs[:r, :k]], dim=1)
        return values, self.host.top_ids[:r, :k].to(torch.int32)

    def prompt_scores(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A scored prefill's (float32 (T, 1 + k): per packed token the next prompt
        token's log probability, then the top ``k``; int32 (T, k): their ids),
        T = the frame's packed tokens in lane order, after :meth:`finished`.
        The row of a chunk's last token with no next prompt token (score_next
        -1) holds 0 there, to be ignored."""
        t = int(self.checked.query_len.sum())
        host = self.host
        if not 0 <= k <= host.score_ids.shape[1]:
            raise ProgramError(f"{k} log probabilities, at most {host.score_ids.shape[1]}")
        values = torch.cat([host.score_logprob[:t, None], host.score_top[:t, :k]], dim=1)
        return values.contiguous(), host.score_ids[:t, :k].to(torch.int32).contiguous()
