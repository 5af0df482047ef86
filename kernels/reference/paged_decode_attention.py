"""Torch reference of kernels/triton/paged_decode_attention.py, with no Triton import.

It is the kernel's test oracle and the CPU path of the rank programs
(runtime/ranks/model/attention.py), so its work follows the actual lengths:
each lane gathers only the pages its context uses, whatever the page-table
width.  It reads the length vector to the host once (a reference, not a graph
body); a caller running several layers over the same lanes builds that
:func:`decode_plan` once and passes it to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BUCKET_SPREAD = 1.5  # lanes batched together differ in context by at most this factor


@dataclass(frozen=True)
class DecodeBucket:
    """Lanes attended together: ``rows`` (B,) their lane indices (None: every lane,
    in order), ``pages`` (B * P,) their first P pages flattened (the longest lane's
    count), ``longest`` their longest context and ``bias`` (B, 1, 1, longest)
    float32: 0 for a visible key, -inf past the lane's context."""

    rows: Tensor | None
    pages: Tensor
    longest: int
    bias: Tensor


def decode_plan(page_tables: Tensor, context_lens: Tensor, page_size: int) -> list[DecodeBucket]:
    """The buckets of :func:`paged_decode_attention_reference` for these lanes:
    lanes sorted by context and batched while their longest context is at most
    :data:`BUCKET_SPREAD` times their shortest; lanes with context 0 in none.
    Depends only on the page tables and lengths, so every layer of a step
    shares it.  One host read of ``context_lens``."""
    device = page_tables.device
    lanes = page_tables.shape[0]
    contexts = context_lens.tolist()
    order = sorted((n, lane) for lane, n in enumerate(contexts) if n > 0)
    buckets = []
    while order:
        shortest = order[0][0]
        size = next((i for i, (n, _) in enumerate(order) if n > BUCKET_SPREAD * shortest), None)
        bucket, order = order[:size], order[size:] if size is not None else []
        longest = bucket[-1][0]
        members = sorted(lane for _, lane in bucket)
        width = -(-longest // page_size)
        if len(members) == lanes:  # every lane, in order: no gather, no scatter
            rows = None
            tables, ctx = page_tables[:, :width], context_lens
        else:
            rows = torch.tensor(members, device=device)  # (B,)
            tables, ctx = page_tables[rows, :width], context_lens[rows]
        pages = tables.long().clamp(min=0).flatten()  # (B * P,)
        hidden = torch.arange(longest, device=device) >= ctx.unsqueeze(1)  # (B, C)
        bias = torch.zeros(hidden.shape, dtype=torch.float32, device=device)
        bias.masked_fill_(hidden, float("-inf"))
        buckets.append(DecodeBucket(rows, pages, longest, bias[:, None, None, :]))
    return buckets


def paged_decode_attention_reference(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    plan: list[DecodeBucket] | None = None,
) -> Tensor:
    """Torch reference of :func:`paged_decode_attention`; fp32 math, q's dtype out.

    Its work follows the actual lengths: lanes are sorted by context and
    batched in buckets whose longest context is at most :data:`BUCKET_SPREAD`
    times their shortest (:func:`decode_plan`; ``plan``: one built for these
    page tables and lengths); each bucket gathers only the pages its longest
    lane uses and runs one batched softmax attention (the GQA group's query
    heads as rows against their KV head, matmuls rather than SDPA, whose
    per-call cost dominates at one query row per head).  So a long lane never
    widens a short one's work by more than that factor.  Lanes with context 0
    give zeros.
    """
    page_size, head_dim = k_pages.shape[1], k_pages.shape[3]
    lanes, heads, _ = q.shape
    if plan is None:
        plan = decode_plan(page_tables, context_lens, page_size)
    if len(plan) == 1 and plan[0].rows is None:
        return _bucket_attention(q, k_pages, v_pages, plan[0], scale).to(q.dtype)
    out = torch.zeros(lanes, heads, head_dim, dtype=torch.float32, device=q.device)
    for bucket in plan:
        out[bucket.rows] = _bucket_attention(q[bucket.rows], k_pages, v_pages, bucket, scale)
    return out.to(q.dtype)


def _bucket_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, bucket: DecodeBucket, scale: float
) -> Tensor:
    """One bucket's attention: q (B, H, d) -> (B, H, d) float32."""
    kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    b, heads, _ = q.shape
    group, longest = heads // kv_heads, bucket.longest
    shape = (b, -1, kv_heads, head_dim)
    # index_select: much cheaper on CPU than advanced indexing.
    k = k_pages.index_select(0, bucket.pages).view(shape)[:, :longest]  # (B, C, KV, d)
    v = v_pages.index_select(0, bucket.pages).view(shape)[:, :longest]  # (B, C, KV, d)
    k = k.transpose(1, 2).float().contiguous().view(b * kv_heads, longest, head_dim)
    v = v.transpose(1, 2).float().contiguous().view(b * kv_heads, longest, head_dim)
    lane_q = q.float().reshape(b * kv_heads, group, head_dim)  # (B KV, G, d)
    scores = torch.bmm(lane_q, k.transpose(1, 2)).view(b, kv_heads, group, longest)
    scores = scores.mul_(scale).add_(bucket.bias)  # (B, KV, G, C)
    weights = torch.softmax(scores, dim=-1).view(b * kv_heads, group, longest)
    return torch.bmm(weights, v).view(b, heads, head_dim)  # (B, H, d)
