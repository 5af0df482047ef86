"""Torch reference of kernels/triton/paged_decode_attention.py, with no Triton import.

It is the kernel's test oracle and the CPU path of the rank programs
(runtime/ranks/model/attention.py), so its work follows the actual lengths:
each lane gathers only the pages its context uses, whatever the page-table
width.  It reads the length vector to the host once (a reference, not a graph
body).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

BUCKET_SPREAD = 1.5  # lanes batched together differ in context by at most this factor


def paged_decode_attention_reference(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """Torch reference of :func:`paged_decode_attention`; fp32 math, q's dtype out.

    Its work follows the actual lengths: lanes are sorted by context and
    batched in buckets whose longest context is at most :data:`BUCKET_SPREAD`
    times their shortest; each bucket gathers only the pages its longest lane
    uses and runs one SDPA (the GQA group's query heads as rows against their
    KV head).  So a long lane never widens a short one's work by more than
    that factor.  Lanes with context 0 give zeros.  One host read of
    context_lens.
    """
    _, page_size, kv_heads, head_dim = k_pages.shape
    lanes, heads, _ = q.shape
    group = heads // kv_heads
    out = torch.zeros(lanes, heads, head_dim, dtype=torch.float32, device=q.device)
    contexts = context_lens.tolist()
    order = sorted((n, lane) for lane, n in enumerate(contexts) if n > 0)
    while order:
        shortest = order[0][0]
        size = next((i for i, (n, _) in enumerate(order) if n > BUCKET_SPREAD * shortest), None)
        bucket, order = order[:size], order[size:] if size is not None else []
        longest = bucket[-1][0]
        rows = torch.tensor([lane for _, lane in bucket], device=q.device)  # (B,)
        pages = page_tables[rows, : -(-longest // page_size)].long().clamp(min=0)  # (B, P)
        shape = (len(bucket), -1, kv_heads, head_dim)
        flat = pages.flatten()  # index_select: much cheaper on CPU than advanced indexing
        k = k_pages.index_select(0, flat).view(shape)[:, :longest].float()  # (B, C, KV, d)
        v = v_pages.index_select(0, flat).view(shape)[:, :longest].float()  # (B, C, KV, d)
        ctx = torch.tensor([n for n, _ in bucket], device=q.device)  # (B,)
        visible = torch.arange(longest, device=q.device) < ctx.unsqueeze(1)  # (B, C)
        lane_q = q[rows].float().view(len(bucket), kv_heads, group, head_dim)  # (B, KV, G, d)
        lane_out = F.scaled_dot_product_attention(
            lane_q,
            k.transpose(1, 2),  # (B, KV, C, d)
            v.transpose(1, 2),
            attn_mask=visible[:, None, None, :],  # (B, 1, 1, C)
            scale=scale,
        )  # (B, KV, G, d)
        out[rows] = lane_out.reshape(len(bucket), heads, head_dim)
    return out.to(q.dtype)
