"""CUDA-event timing for the GPU scripts (gpu_check.py, gpu_realistic.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def event_us(fn: Callable[..., object], args: tuple, repeat: int = 20) -> float:
    """Mean CUDA-event time of ``fn(*args)`` in microseconds, after one warm call."""
    fn(*args)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeat):
        fn(*args)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / repeat
