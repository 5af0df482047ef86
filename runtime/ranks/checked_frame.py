"""A frame checked against a rank's slot table (:class:`CheckedFrame`), or refused
(:class:`FrameError`, nothing changed): its lanes as int64 numpy columns."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.catalog import GraphKind
from runtime.transport.frame import Frame
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams


class FrameError(ValueError):
    """A frame does not fit the rank's slot state; nothing changed."""


def column(values) -> np.ndarray:
    """A frame column (``array('q')``, bytes-like or sequence) as int64 numpy, no copy
    when it already is a buffer."""
    if isinstance(values, np.ndarray):
        return values.astype(np.int64, copy=False)
    try:
        return np.frombuffer(values, dtype=np.int64)
    except TypeError:
        return np.asarray(values, dtype=np.int64)


@dataclass(frozen=True)
class CheckedFrame:
    """A frame's lanes as int64 columns, checked against the table (R lanes)."""

    frame: Frame
    slot: np.ndarray  # (R,)
    generation: np.ndarray  # (R,)
    prefill: np.ndarray  # (R,) bool
    position: np.ndarray  # (R,) KV position of the lane's first new token
    query_len: np.ndarray  # (R,)
    commits: np.ndarray  # (R,) 0 or 1
    starts: np.ndarray  # (R,) bool: a new generation (its state starts empty)
    step: np.ndarray  # (R,) the sampling step of the lane's token
    page_base: np.ndarray  # (R,) pages the slot held before this lane's appends
    page_count: np.ndarray  # (R,) pages this lane appends
    pages: np.ndarray  # (sum page_count,) flat
    prompt_tokens: np.ndarray  # flat, the prefill lanes' chunks in lane order
    sampling: dict[int, SamplingParams]  # lane -> params (prefill lanes)
    full: bool  # some lane needs the full sampler (non-greedy, bias, penalties, min_tokens)
    logprobs: int  # the most log probabilities a lane asks for; -1: none
    steady: bool = False  # the previous frame's decode lanes, one token on (see check)
    restores: dict[int, Restore] = field(default_factory=dict)  # lane -> record (new generations)

    @property
    def lanes(self) -> int:
        return int(self.slot.shape[0])

    @property
    def speculative(self) -> bool:
        """A speculative round (or a wide mixed program): its decode lanes may emit
        fewer than ``query_len`` tokens."""
        program = self.frame.program
        return program.kind is GraphKind.SPECULATIVE or (
            program.kind is GraphKind.MIXED and program.token_capacity > 1
        )

    @property
    def context(self) -> np.ndarray:
        """(R,) each lane's context after the frame."""
        return self.position + self.query_len
