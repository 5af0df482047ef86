"""Batch-invariant sampling: greedy, temperature, top-k, top-p, per-request seed.

Every rank computes the same tokens from the same logits without communicating,
and a seeded request samples the same tokens whatever batch it shares: each row
is processed alone (no cross-row reduction), and randomness comes from a
counter-based hash of (seed, step, token id) rather than a stateful generator.
Sampling is Gumbel-max over the filtered, temperature-scaled logits:
``argmax(logits / T + g)`` with ``g = -log(-log(u))`` draws exactly from
``softmax(logits / T)`` restricted to the kept tokens.

Two per-request extras, both fixed-shape too:

* ``min_tokens``: while a row's step (tokens sampled so far) is below its
  ``min_tokens``, the EOS ids' logits are -inf (:func:`suppress_eos`), before
  temperature, top-k and top-p (so the filters see the masked logits, as in
  vLLM).  Rows at or past their ``min_tokens`` are bitwise what they would be
  without the mask.
* log probabilities (:func:`token_logprobs`): ``log_softmax`` of the raw float32
  logits (before temperature, top-k, top-p and the EOS mask, vLLM's "raw"
  mode): the sampled token's and the top ``k``, for every row.

Everything is fixed-shape tensor work with no host synchronization, so it can be
captured in a CUDA graph.  Integer hashing uses 32-bit lanes inside int64 so no
intermediate product overflows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from runtime.transport.schema import MAX_LOGPROBS

_MASK32 = 0xFFFFFFFF


MAX_TEMPERATURE = 1e6  # logits / 1e6 is already uniform in float32


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
    min_tokens: torch.Tensor | None = None  # (R,) int64: no EOS while step < min_tokens

    @classmethod
    def from_rows(
        cls,
        rows: list[tuple],
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """From (temperature, top_p, top_k, seed, step[, min_tokens]) tuples."""
        t, p, k, s, n = (tuple(r[i] for r in rows) for i in range(5))
        m = tuple(r[5] if len(r) > 5 else 0 for r in rows)
        return cls(
            torch.tensor(t, dtype=torch.float32, device=device),
            torch.tensor(p, dtype=torch.float32, device=device),
            torch.tensor(k, dtype=torch.int64, device=device),
            torch.tensor(s, dtype=torch.int64, device=device),
            torch.tensor(n, dtype=torch.int64, device=device),
            torch.tensor(m, dtype=torch.int64, device=device),
        )


def eos_index(eos_ids: Iterable[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The distinct EOS ids as an (E,) int64 tensor: build once per model, outside a graph."""
    return torch.tensor(sorted(set(eos_ids)), dtype=torch.int64, device=device)


def suppress_eos(
    logits: torch.Tensor, step: torch.Tensor, min_tokens: torch.Tensor, eos: torch.Tensor
) -> torch.Tensor:
    """``logits`` (R, V) with the ``eos`` columns ((E,) int64, distinct) at -inf in
    rows whose ``step`` is below ``min_tokens`` (both (R,) int64).  Out of place;
    touches only the E columns, so other values are bitwise unchanged."""
    barred = (step < min_tokens)[:, None]  # (R, 1)
    columns = logits.index_select(1, eos).masked_fill(barred, float("-inf"))  # (R, E)
    return logits.index_copy(1, eos, columns)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int = MAX_LOGPROBS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw log probabilities: ``log_softmax(logits.float())`` per row.

    Returns (the log probability of ``tokens`` (R,) float32, the top ``k`` log
    probabilities (R, k) float32 in descending order, their token ids (R, k)
    int64).  ``k`` must not exceed the vocabulary.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)  # (R,)
    top_values, top_ids = logp.topk(k, dim=-1, largest=True, sorted=True)  # (R, k)
    return chosen, top_values, top_ids


def sample(
    logits: torch.Tensor, params: SamplingBatch, eos: torch.Tensor | None = None
) -> torch.Tensor:
    """Next tokens (R,) int64 from logits (R, V).

    ``eos`` (E,) int64: the EOS ids that ``params.min_tokens`` bars (see
    :func:`eos_index`); without it (or without ``params.min_tokens``) nothing is
    barred.
    """
    logits = logits.float()  # (R, V)
    if eos is not None and params.min_tokens is not None:
        logits = suppress_eos(logits, params.step, params.min_tokens, eos)
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)  # (R,)
    # Bounded above too: a temperature beyond float32 range would be inf here, and
    # -inf / inf (a barred EOS logit) is NaN, which argmax would pick.
    temperature = params.temperature.clamp(1e-6, MAX_TEMPERATURE)[:, None]  # (R, 1)
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
