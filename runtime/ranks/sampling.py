"""Batch-invariant sampling: greedy, temperature, top-k, top-p, per-request seed,
logit bias and penalties.

Every rank computes the same tokens from the same logits without communicating,
and a seeded request samples the same tokens whatever batch it shares: each row
is processed alone (no cross-row reduction), and randomness comes from a
counter-based hash of (seed, step, token id) rather than a stateful generator.
Sampling is Gumbel-max over the filtered, temperature-scaled logits:
``argmax(logits / T + g)`` with ``g = -log(-log(u))`` draws exactly from
``softmax(logits / T)`` restricted to the kept tokens.

Per-request extras, all fixed-shape too:

* logit bias and penalties (:class:`LogitAdjustments`, :func:`adjust_logits`),
  with vLLM's semantics and in vLLM's order, first, on the float32 logits:
  ``logit_bias`` is added; then for every token seen in the prompt or the
  output, ``repetition_penalty`` divides a positive logit and multiplies any
  other (as transformers' ``RepetitionPenaltyLogitsProcessor``); then
  ``frequency_penalty * count`` and ``presence_penalty * (count > 0)`` are
  subtracted, counts over the tokens the request has generated.  The state they
  read (each slot's output-token counts and prompt-token mask) lives on the
  device in :class:`PenaltyState`, updated by the program that samples.  Rows
  without adjustments are bitwise their raw logits.  A greedy row takes the
  argmax of the adjusted logits.
* ``min_tokens``: while a row's step (tokens sampled so far) is below its
  ``min_tokens``, the EOS ids' logits are -inf (:func:`suppress_eos`), before
  temperature, top-k and top-p (so the filters see the masked logits, as in
  vLLM).  Rows at or past their ``min_tokens`` are bitwise what they would be
  without the mask.  (vLLM bars EOS before the penalties; penalties keep -inf
  at -inf, so the order gives the same logits.)
* log probabilities (:func:`token_logprobs`): ``log_softmax`` of the raw float32
  logits (before logit bias, penalties, temperature, top-k, top-p and the EOS
  mask, vLLM's default "raw_logprobs" mode): the sampled token's and the top
  ``k``, for every row.

Everything is fixed-shape tensor work with no host synchronization, so it can be
captured in a CUDA graph.  Integer hashing uses 32-bit lanes inside int64 so no
intermediate product overflows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from runtime.transport.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

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
class LogitAdjustments:
    """Per-row logit bias and penalties (R rows), with the penalty state they read.

    The bias is a fixed-capacity table: row ``r``'s entries are
    ``bias_ids[r, j]`` (-1: unused) with ``bias_values[r, j]``; ids of a row are
    distinct and inside the vocabulary.
    """

    bias_ids: torch.Tensor  # (R, B) int64, -1 = unused entry
    bias_values: torch.Tensor  # (R, B) float32
    presence: torch.Tensor  # (R,) float32, 0 = off
    frequency: torch.Tensor  # (R,) float32, 0 = off
    repetition: torch.Tensor  # (R,) float32, 1 = off
    counts: torch.Tensor  # (R, V) int32: the row's output-token counts
    prompt_mask: torch.Tensor  # (R, V) bool: tokens of the row's prompt

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab: int,
        device: torch.device | str = "cpu",
        width: int = MAX_LOGIT_BIAS,
    ) -> LogitAdjustments:
        """From each row's settings, prompt and generated tokens (host-side; tests, tools)."""
        ids, values = bias_table(params, len(params), width)
        counts = torch.zeros(len(params), vocab, dtype=torch.int32)
        mask = torch.zeros(len(params), vocab, dtype=torch.bool)
        for r, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            mask[r, list(prompt)] = True
            for token in output:
                counts[r, token] += 1
        return cls(
            ids.to(device),
            values.to(device),
            torch.tensor([p.presence_penalty for p in params], device=device),
            torch.tensor([p.frequency_penalty for p in params], device=device),
            torch.tensor([p.repetition_penalty for p in params], device=device),
            counts.to(device),
            mask.to(device),
        )


@lru_cache(maxsize=256)
def _bias_row(pairs: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([token for token, _ in pairs], dtype=torch.int64)
    values = torch.tensor([bias for _, bias in pairs], dtype=torch.float32)
    return ids, values


def bias_table(
    params: Sequence[SamplingParams], rows: int, width: int = MAX_LOGIT_BIAS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rows, width) logit-bias table of ``params`` (row ``r`` for ``params[r]``,
    later rows padding): ids int64 (-1 unused) and values float32, on the CPU."""
    ids = torch.full((rows, width), -1, dtype=torch.int64)
    values = torch.zeros(rows, width, dtype=torch.float32)
    for r, p in enumerate(params):
        if p.logit_bias:
            if len(p.logit_bias) > width:
                raise ValueError(f"{len(p.logit_bias)} logit_bias entries, at most {width}")
            row_ids, row_values = _bias_row(p.logit_bias)
            ids[r, : len(row_ids)] = row_ids
            values[r, : len(row_values)] = row_values
    return ids, values


def adjust_logits(logits: torch.Tensor, adj: LogitAdjustments) -> torch.Tensor:
    """``logits`` (R, V) float32 with each row's logit bias and penalties applied.

    vLLM's order: bias, then repetition (tokens in the prompt or the output:
    ``logit / p`` if positive, else ``logit * p``), frequency (``- f * count``)
    and presence (``- p * (count > 0)``).  Rows with nothing to adjust are
    returned bitwise unchanged.  Out of place; fixed shapes, no host sync.
    """
    vocab = logits.shape[1]
    has_bias = (adj.bias_ids >= 0).any(dim=1)  # (R,)
    active = has_bias | (adj.repetition != 1) | (adj.frequency != 0) | (adj.presence != 0)
    # Bias: scatter into a dense row with one spare column for unused entries.
    columns = torch.where(adj.bias_ids >= 0, adj.bias_ids, vocab)  # (R, B)
    dense = logits.new_zeros(logits.shape[0], vocab + 1).scatter_(1, columns, adj.bias_values)
    x = logits + dense[:, :vocab]
    output = adj.counts > 0  # (R, V)
    seen = adj.prompt_mask | output
    rep = adj.repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - adj.frequency[:, None] * adj.counts.to(torch.float32)
    x = x - adj.presence[:, None] * output.to(torch.float32)
    return torch.where(active[:, None], x, logits)


class PenaltyState:
    """Each slot's penalty state on the device, in buffers allocated once.

    ``counts`` (slots + 1, V) int32: how often each token was committed (sampled)
    for the slot's current generation; ``prompt_mask`` (slots + 1, V) bool: the
    tokens of the prompt it has consumed.  Row ``slots`` is scratch: padded
    lanes, lanes that commit no token and frames without a new generation
    write there, so every update has a fixed shape.  The program that samples
    updates it (:meth:`reset`, :meth:`mark_prompt`, :meth:`count`) with tensor
    ops only, so a captured graph keeps it current.
    """

    def __init__(self, slots: int, vocab: int, device: torch.device | str = "cpu") -> None:
        self.slots = slots
        self.scratch = slots  # the row padding writes
        self.vocab = vocab
        self.counts = torch.zeros(slots + 1, vocab, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(slots + 1, vocab, dtype=torch.bool, device=device)

    def reset(self, rows: torch.Tensor) -> None:
        """Zero the rows ``rows`` (int64, any shape; a new generation starts there)."""
        self.counts.index_fill_(0, rows.reshape(-1), 0)
        self.prompt_mask.index_fill_(0, rows.reshape(-1), False)

    def mark_prompt(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Mark ``token_ids[n]`` in the prompt mask of row ``rows[n]`` (both (N,) int64)."""
        flat = rows * self.vocab + token_ids
        self.prompt_mask.view(-1).scatter_(0, flat, True)

    def count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one to ``tokens[l]`` in the counts of row ``rows[l]`` (both (L,) int64)."""
        flat = rows * self.vocab + tokens
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def restore(self, row: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Row ``row`` as a generation that consumed ``prompt`` and committed
        ``output`` (a restored request: prompt mask and output counts, nothing
        else).  Host-built rows, copied in on the current stream (not captured)."""
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        if prompt:
            mask[torch.tensor(prompt, dtype=torch.int64)] = True
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=self.vocab)
        self.prompt_mask[row].copy_(mask)
        self.counts[row].copy_(counts.to(torch.int32))

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (counts (L, V), prompt mask (L, V)) of rows ``rows`` ((L,) int64)."""
        return self.counts.index_select(0, rows), self.prompt_mask.index_select(0, rows)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as tensors (R rows)."""

    temperature: torch.Tensor  # (R,) float32; 0 = greedy
    top_p: torch.Tensor  # (R,) float32 in (0, 1]
    top_k: torch.Tensor  # (R,) int64; -1 = off
    seed: torch.Tensor  # (R,) int64
    step: torch.Tensor  # (R,) int64: the row's output index, so each token gets fresh noise
    min_tokens: torch.Tensor | None = None  # (R,) int64: no EOS while step < min_tokens
    adjustments: LogitAdjustments | None = None  # logit bias and penalties; None: none

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
    barred.  ``params.adjustments`` (logit bias, penalties) apply first, and
    greedy rows take the argmax of the adjusted, EOS-masked logits.
    """
    greedy, _, scaled, keep = _filtered(logits, params, eos)
    vocab = scaled.shape[-1]
    gumbel = -torch.log(-torch.log(uniform_noise(params.seed, params.step, vocab)))  # (R, V)
    sampled = (scaled + gumbel).masked_fill(~keep, float("-inf")).argmax(dim=-1)  # (R,)
    return torch.where(params.temperature > 0, sampled, greedy)


def _filtered(
    logits: torch.Tensor, params: SamplingBatch, eos: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the greedy tokens (R,), the adjusted, EOS-masked logits (R, V), the same
    over the temperature (R, V), the tokens top-k and top-p keep (R, V) bool)."""
    logits = logits.float()  # (R, V)
    if params.adjustments is not None:
        logits = adjust_logits(logits, params.adjustments)
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
    return greedy, logits, scaled, keep


def sampling_distribution(
    logits: torch.Tensor, params: SamplingBatch, eos: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution :func:`sample` draws from, per row of ``logits`` (R, V).

    Returns (``probs`` (R, V) float32: the final sampling distribution, after
    logit bias, penalties, the ``min_tokens`` EOS mask, temperature, top-k and
    top-p, a point mass on the greedy token for greedy rows; ``soft`` (R, V):
    the same before the greedy collapse, at temperature 1 for greedy rows,
    unfiltered for them).  Speculative verification compares these (p for the
    target, q for the draft); ``soft`` is what a draft's confidence reads.
    """
    greedy, adjusted, scaled, keep = _filtered(logits, params, eos)
    filtered = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)  # (R, V)
    point = torch.zeros_like(filtered).scatter_(1, greedy[:, None], 1.0)  # (R, V)
    is_greedy = (params.temperature <= 0)[:, None]  # (R, 1)
    probs = torch.where(is_greedy, point, filtered)
    soft = torch.where(is_greedy, torch.softmax(adjusted, dim=-1), filtered)
    return probs, soft
