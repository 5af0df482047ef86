"""Batch-invariant sampling: greedy, temperature, top-k, top-p, per-request seed.

Every rank computes the same tokens from the same logits without communicating,
and a seeded request samples the same tokens whatever batch it shares: each row
is processed alone (no cross-row reduction), and randomness comes from a
counter-based hash of (seed, step, token id) rather than a stateful generator.
Sampling is Gumbel-max over the filtered, temperature-scaled logits:
``argmax(logits / T + g)`` with ``g = -log(-log(u))`` draws exactly from
``softmax(logits / T)`` restricted to the kept tokens.

Everything is fixed-shape tensor work with no host synchronization, so it can be
captured in a CUDA graph.  Integer hashing uses 32-bit lanes inside int64 so no
intermediate product overflows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 ``x`` in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), shape (R, vocab), a pure function of (seed, step, index).

    ``seed`` and ``step`` are int64 of shape (R,).
    """
    seed32 = (seed ^ (seed >> 32)) & _MASK32  # (R,)
    key = hash32(hash32(seed32) ^ (step & _MASK32))  # (R,)
    index = torch.arange(vocab, device=seed.device, dtype=torch.int64)  # (V,)
    bits = hash32(key[:, None] ^ hash32(index)[None, :])  # (R, V)
    # 24 random bits, centred in their bucket: strictly inside (0, 1).
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as tensors (R rows)."""

    temperature: torch.Tensor  # (R,) float32; 0 = greedy
    top_p: torch.Tensor  # (R,) float32 in (0, 1]
    top_k: torch.Tensor  # (R,) int64; -1 = off
    seed: torch.Tensor  # (R,) int64
    step: torch.Tensor  # (R,) int64: the row's output index, so each token gets fresh noise

    @classmethod
    def from_rows(
        cls,
        rows: list[tuple[float, float, int, int, int]],
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """From (temperature, top_p, top_k, seed, step) tuples."""
        t, p, k, s, n = zip(*rows) if rows else ((), (), (), (), ())
        return cls(
            torch.tensor(t, dtype=torch.float32, device=device),
            torch.tensor(p, dtype=torch.float32, device=device),
            torch.tensor(k, dtype=torch.int64, device=device),
            torch.tensor(s, dtype=torch.int64, device=device),
            torch.tensor(n, dtype=torch.int64, device=device),
        )


def sample(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """Next tokens (R,) int64 from logits (R, V)."""
    logits = logits.float()  # (R, V)
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)  # (R,)
    temperature = params.temperature.clamp_min(1e-6)[:, None]  # (R, 1)
    scaled = logits / temperature  # (R, V)

    sorted_vals, order = scaled.sort(dim=-1, descending=True)  # (R, V)
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # (1, V)
    # top-k: keep the k best (k <= 0 or >= V keeps all).
    k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, vocab))
    keep_sorted = ranks < k.clamp(max=vocab)[:, None]  # (R, V)
    # top-p: keep the smallest prefix whose mass reaches p (always the best token).
    probs = torch.softmax(sorted_vals.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (R, V)
    keep_sorted &= mass_before < params.top_p[:, None]
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)  # (R, V)

    gumbel = -torch.log(-torch.log(uniform_noise(params.seed, params.step, vocab)))  # (R, V)
    sampled = (scaled + gumbel).masked_fill(~keep, float("-inf")).argmax(dim=-1)  # (R,)
    return torch.where(params.temperature > 0, sampled, greedy)
