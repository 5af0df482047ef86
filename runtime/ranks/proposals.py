"""Where a speculative round's proposals come from (:class:`ProposerConfig`):
n-gram lookup in the request's own tokens (:func:`copy_proposals`) or a draft
model (:func:`draft_proposals`), each drawn from the draft's final sampling
distribution (:func:`round_distribution`, which verification uses too)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference.speculative_verify import sample_inverse_cdf
from runtime.ranks.draft import DraftContext
from runtime.ranks.model.attention import AttentionMetadata
from runtime.ranks.sampling import (
    LogitAdjustments,
    SamplingBatch,
    sampling_distribution,
    uniform_noise,
)
from runtime.speculation import PROPOSERS


@dataclass(frozen=True)
class ProposerConfig:
    """Where proposals come from: ``draft`` (a draft model) or ``copy`` (n-gram
    lookup in the request's own tokens, ``prompt_lookup_min`` through
    ``prompt_lookup_max`` tokens)."""

    kind: str = "draft"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.kind not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.kind!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"{name} must be an integer in [1, 64], got {value!r}")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")


def copy_proposals(
    history: torch.Tensor, end: torch.Tensor, depth: int, n_min: int, n_max: int
) -> torch.Tensor:
    """Copy proposals (L, depth) int64, -1 where there is none.

    ``history`` (L, T): each lane's tokens by position; ``end`` (L,): the
    position of its last token (the pending one).  For n from ``n_max`` down to
    ``n_min``, the lane's last n tokens are looked up among earlier positions;
    an occurrence followed by ``depth`` known tokens wins, then the longest n,
    then the latest occurrence, and the tokens that followed it (up to ``end``)
    are proposed.  Tensor ops only.
    """
    lanes, width = history.shape
    device = history.device
    j = torch.arange(width, device=device)  # (T,) candidate match ends
    # shifted[m][:, j] = history[:, j - m]: slices of a left-padded copy, no gather.
    padded = torch.nn.functional.pad(history, (n_max, 0))
    shifted = [padded[:, n_max - m : n_max - m + width] for m in range(n_max)]
    full = j[None, :] + depth <= end[:, None]  # (L, T) followed by depth known tokens
    # Score: a full continuation, then the longer n, then the later occurrence.
    score = torch.full((lanes,), -1, dtype=torch.int64, device=device)
    span = n_max + 1
    for n in range(n_max, n_min - 1, -1):
        match = (j[None, :] < end[:, None]) & (j[None, :] >= n - 1)  # (L, T)
        for m in range(n):
            tail = history.gather(1, (end - m).clamp(min=0)[:, None])  # (L, 1)
            match &= shifted[m] == tail
        match &= (end >= n - 1)[:, None]
        value = (full.long() * span + n) * width + j[None, :]  # (L, T)
        score = torch.maximum(score, torch.where(match, value, -1).amax(dim=1))
    found = score >= 0
    best = torch.where(found, score % width, -1)
    offsets = torch.arange(1, depth + 1, device=device)  # (D,)
    at = best[:, None] + offsets[None, :]  # (L, D)
    ok = found[:, None] & (at <= end[:, None])
    tokens = history.gather(1, at.clamp(0, width - 1))
    return torch.where(ok, tokens, -1)


def lane_params(s: dict, step: torch.Tensor, counts, prompt_mask, repeat: int) -> SamplingBatch:
    """The lanes' settings, each repeated ``repeat`` times (rows of positions)."""

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(repeat, dim=0)

    adjustments = LogitAdjustments(
        r(s["bias_ids"]),
        r(s["bias_values"]),
        r(s["presence_penalty"]),
        r(s["frequency_penalty"]),
        r(s["repetition_penalty"]),
        counts,
        r(prompt_mask),
    )
    return SamplingBatch(
        r(s["temperature"]),
        r(s["top_p"]),
        r(s["top_k"]),
        r(s["seed"]),
        step,
        r(s["min_tokens"]),
        adjustments,
    )


def round_distribution(
    logits, s, step, counts, prompt_mask, repeat: int, greedy_only: bool, eos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final distribution, soft distribution) of ``logits`` (R*repeat, V); ``eos``
    the model's EOS ids (barred by ``min_tokens``)."""
    if greedy_only:  # every lane greedy with no adjustment: a point mass on the argmax
        point = torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        return point, torch.softmax(logits, dim=-1)
    params = lane_params(s, step, counts, prompt_mask, repeat)
    return sampling_distribution(logits, params, eos)


def draft_proposals(
    draft: DraftContext, depth: int, eos: torch.Tensor, arena, rows, start, step, pending,
    active, held, s, counts, prompt_mask, width, page_size, greedy_only,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Learned proposals (L, depth), their distributions q (L, depth, V) and
    conditional confidences (L, depth): the draft feeds the pending token, then
    each proposal."""
    lanes = rows.shape[0]
    device = rows.device
    vocab = counts.shape[1]
    proposals = torch.full((lanes, depth), -1, dtype=torch.int64, device=device)
    q = torch.zeros(lanes, depth, vocab, device=device)
    conditional = torch.zeros(lanes, depth, device=device)
    token = pending
    seen = counts.clone()
    seed = s["seed"]
    tables = arena.page_tables[:, :width].index_select(0, rows)  # (L, width)
    lane_index = torch.arange(lanes, device=device)
    for d in range(depth + 1):
        # One token per lane at start + d: a decode step's metadata.
        positions = torch.where(active, start + d, 0)  # (L,)
        column = (positions // page_size).clamp(max=width - 1)
        page = tables.gather(1, column[:, None]).squeeze(1)
        writes = active & (page >= 0) & (positions < held)
        meta = AttentionMetadata(
            query_start=lane_index,
            query_lens=writes.long(),
            context_lens=torch.where(writes, positions + 1, 0),
            page_tables=tables,
            slot_mapping=torch.where(writes, page * page_size + positions % page_size, -1),
            max_query_len=1,
        )
        if d == depth:  # the last proposal's KV only
            draft.feed(token, positions, meta)
            break
        logits = draft.step(token, positions, meta)  # (L, V)
        dist, soft = round_distribution(logits, s, step + d, seen, prompt_mask, 1, greedy_only, eos)
        if greedy_only:  # a point mass: its argmax
            token = logits.argmax(dim=-1)
        else:
            u = uniform_noise(seed, step + d, 4)[:, 3]
            token = sample_inverse_cdf(dist, u)  # (L,)
            seen = seen + torch.zeros_like(seen).scatter_(1, token[:, None], 1)
        proposals[:, d] = token
        q[:, d] = dist
        conditional[:, d] = soft.gather(1, token[:, None]).squeeze(1)
    return proposals, q, conditional
