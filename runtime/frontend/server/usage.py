"""A response's accounting: its token counts (:class:`Usage`) and the latencies the
client saw (:class:`Timing`, for the metrics)."""

from __future__ import annotations

import time
from typing import Any

from runtime.frontend.server.generation import Piece
from runtime.frontend.server.state import Frontend


class Usage:
    """A response's token counts.  ``prompt_tokens`` counts each prompt once, however
    many choices (n) it has; so does ``prompt_tokens_details.cached_tokens``: per
    prompt, the most prompt tokens any of its choices found in the prefix cache
    (each choice is its own coordinator request, and a later one may find pages an
    earlier one cached), summed over the prompts.  Always present (0: none found)."""

    def __init__(self, prompt_tokens: int, n: int = 1) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.n = n  # choices per prompt: choice i is prompt i // n's
        self._cached: dict[int, int] = {}

    def add(self, piece: Piece) -> None:
        """Count a piece's tokens and its request's cached prompt tokens."""
        self.completion_tokens += len(piece.token_ids)
        prompt = piece.index // self.n
        self._cached[prompt] = max(self._cached.get(prompt, 0), piece.cached_tokens)

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    def json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Timing:
    """Client-visible latency of one choice, for the metrics."""

    def __init__(self, fe: Frontend, arrived: float) -> None:
        self.fe, self.arrived = fe, arrived
        self.last: dict[int, float] = {}

    def tokens(self, piece: Piece) -> None:
        if not piece.token_ids:
            return
        now = time.perf_counter()
        m = self.fe.metrics
        if piece.index not in self.last:
            m.ttft.observe(now - self.arrived)
        else:
            m.itl.observe((now - self.last[piece.index]) / len(piece.token_ids))
        self.last[piece.index] = now
        m.generation_tokens.inc(len(piece.token_ids))

    def finished(self, piece: Piece) -> None:
        self.fe.metrics.e2e.observe(time.perf_counter() - self.arrived)
        self.fe.metrics.finished(piece.finish_reason or "abort")
