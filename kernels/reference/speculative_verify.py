"""Speculative verification (rejection sampling): the torch reference.

Shapes: R lanes, K drafts at most per lane, V vocabulary.  ``target_probs``
(R, K + 1, V) float32 is p, the target's final sampling distribution at each of
the K draft positions and at the bonus position after them; ``draft_probs``
(R, K, V) float32 is q, the distribution each draft token was drawn from (a
copy proposal is a one-hot row: a point mass).  Lane i offers its first
``num_draft[i]`` (clamped to 0..K) of ``draft_tokens`` (R, K).

Sampling rule (the output distribution is the target's): for j < num_draft,
draft t_j is accepted iff ``q_j(t_j) > 0 and u_j * q_j(t_j) < p_j(t_j)``, which
is ``u_j < min(1, p_j(t_j) / q_j(t_j))`` for u_j in [0, 1), written without a
division so that the kernel decides exactly as this reference does.  A draft
token outside [0, V) or with q = 0 is rejected.  At the first rejection a
token is drawn from normalize(max(0, p_j - q_j)) (from p_j when that residual
has no mass) and the lane stops; when all num_draft drafts are accepted, a
bonus token is drawn from p_{num_draft}.

Greedy rule (``greedy=True``): t_j is accepted iff it is argmax p_j, and the
token emitted at the first mismatch or at the bonus position is argmax p there
(ties to the lowest token id).  q and the uniforms are not read (they may be
None).

Sampling from a weight row w (V,) with a uniform u in [0, 1) is an inverse
CDF: the first token whose float64 running sum of w exceeds ``u * sum(w)``;
should rounding leave none, the last token with w > 0 (token 0 for an
all-zero row).  The kernel (kernels/triton/speculative_verify.py) sums in
float64 too, in blocks, so the two agree token for token unless a threshold
falls within float64 rounding of a CDF step.

Outputs: ``accepted`` (R,) int64, the accepted drafts; ``output_tokens``
(R, K + 1) int64, the accepted drafts then the correction or bonus token, -1
after; ``survival`` (R, K) float32, the cumulative products of
min(1, p_j(t_j) / q_j(t_j)) over j < num_draft (a rejected token's factor is
0; in greedy mode the factor is 1 for a match, 0 otherwise), 0 from num_draft
on.  Survival covers every offered position, past the first rejection too:
it is each prefix's acceptance probability, not a record of this draw.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sample_inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row of ``weights`` (N, V), nonnegative, unnormalized, by the
    inverse CDF at ``uniforms`` (N,) in [0, 1), in float64 (see the module
    docstring for the rounding fallback).  Returns (N,) int64."""
    cum = torch.cumsum(weights.double(), dim=-1)  # (N, V)
    threshold = uniforms.double() * cum[:, -1]  # (N,)
    index = (cum <= threshold.unsqueeze(1)).sum(dim=-1)  # first cum > threshold, V if none
    positions = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, positions, 0).amax(dim=-1)  # (N,)
    return torch.where(index < weights.shape[-1], index, last_positive)


def verify_reference(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_tokens: Tensor,
    num_draft: Tensor,
    uniforms: Tensor | None = None,
    residual_uniforms: Tensor | None = None,
    bonus_uniforms: Tensor | None = None,
    greedy: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Verify each lane's drafts against the target (module docstring).

    target_probs (R, K + 1, V) and draft_probs (R, K, V) float32; draft_tokens
    (R, K) and num_draft (R,) integer; uniforms (R, K), the accept tests;
    residual_uniforms (R, K), the draw at a rejection at position j;
    bonus_uniforms (R,), the bonus draw; all in [0, 1).  Returns accepted (R,)
    int64, output_tokens (R, K + 1) int64 and survival (R, K) float32.
    Vectorized over lanes; no host reads.
    """
    lanes, k1, vocab = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    rows = torch.arange(lanes, device=device)
    n = num_draft.long().clamp(0, k)  # (R,)
    tokens = draft_tokens.long()  # (R, K)
    valid = (tokens >= 0) & (tokens < vocab)
    safe = tokens.clamp(0, max(vocab - 1, 0)).unsqueeze(-1)  # (R, K, 1)
    offered = torch.arange(k, device=device) < n.unsqueeze(1)  # (R, K)
    p_draft = target_probs[:, :k]  # (R, K, V)
    if greedy:
        ok = valid & (safe.squeeze(-1) == p_draft.argmax(dim=-1))
        factor = ok.float()
    else:
        p_t = torch.where(valid, p_draft.gather(2, safe).squeeze(-1), 0.0)  # (R, K)
        q_t = torch.where(valid, draft_probs.gather(2, safe).squeeze(-1), 0.0)  # (R, K)
        ok = (q_t > 0) & (uniforms * q_t < p_t)
        factor = torch.where(q_t > 0, torch.clamp(p_t / q_t, max=1.0), 0.0)
    survival = torch.cumprod(torch.where(offered, factor, 1.0), dim=1) * offered
    accepted = torch.cumprod((ok & offered).long(), dim=1).sum(dim=1)  # (R,)
    p_row = target_probs[rows, accepted]  # (R, V): where the next token is drawn
    if greedy:
        token = p_row.argmax(dim=-1)
    else:
        rejected = accepted < n
        at = accepted.clamp(max=max(k - 1, 0))
        if k > 0:
            residual = torch.clamp(p_row - draft_probs[rows, at], min=0.0)
            residual = torch.where((residual > 0).any(-1, keepdim=True), residual, p_row)
            weights = torch.where(rejected.unsqueeze(1), residual, p_row)
            u = torch.where(rejected, residual_uniforms[rows, at], bonus_uniforms)
        else:
            weights, u = p_row, bonus_uniforms
        token = sample_inverse_cdf(weights, u)
    positions = torch.arange(k1, device=device)  # (K + 1,)
    drafted = torch.cat([tokens, tokens.new_full((lanes, 1), -1)], dim=1)  # (R, K + 1)
    out = torch.where(positions < accepted.unsqueeze(1), drafted, -1)
    out = torch.where(positions == accepted.unsqueeze(1), token.unsqueeze(1), out)
    return accepted, out, survival.float()
