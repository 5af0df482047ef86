"""Torch references of the paged attention kernels, with no Triton import.

They are the kernels' test oracles and the CPU path of the rank programs
(runtime/ranks/model/attention.py), so their work follows the actual lengths:
each lane gathers only the pages its context uses, whatever the page-table
width.  Each reads the length vectors to the host once (references, not graph
bodies).  The kernels live beside them in kernels/triton/.
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


def paged_prefill_attention_reference(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    max_query_len: int,
) -> Tensor:
    """Torch reference of :func:`paged_prefill_attention`; fp32 math, q's dtype out.

    Its work follows the actual lengths: each active lane gathers only the pages its
    context uses and runs one SDPA of its chunk over them, the GQA group's query heads
    stacked as rows against their one KV head (no repeated K/V). Lanes' query_len
    must not exceed their context_len. max_query_len is unused (the signature is the
    kernel's). One host read of the three length vectors (a reference, not a graph
    body).
    """
    del max_query_len
    num_tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    out = torch.zeros(num_tokens, heads, head_dim, dtype=torch.float32, device=q.device)
    starts, q_lens, contexts = query_start.tolist(), query_lens.tolist(), context_lens.tolist()
    # One-token lanes (decode rows of a mixed step) see their whole context:
    # decode attention, all of them at once.
    single = [i for i, n in enumerate(q_lens) if n == 1]
    if single:
        rows = torch.tensor([starts[i] for i in single], device=q.device)
        lanes = torch.tensor(single, device=q.device)
        out[rows] = paged_decode_attention_reference(
            q[rows], k_pages, v_pages, page_tables[lanes], context_lens[lanes], scale
        ).float()
    for lane, (start, q_len, ctx) in enumerate(zip(starts, q_lens, contexts)):
        if q_len <= 1:
            continue
        pages = page_tables[lane, : -(-ctx // page_size)].long()  # (n_pages,)
        k = k_pages.index_select(0, pages).reshape(-1, kv_heads, head_dim)[:ctx]  # (ctx, KV, d)
        v = v_pages.index_select(0, pages).reshape(-1, kv_heads, head_dim)[:ctx]  # (ctx, KV, d)
        lane_q = q[start : start + q_len].float().view(q_len, kv_heads, group, head_dim)
        lane_q = lane_q.permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, head_dim)
        key_pos = torch.arange(ctx, device=q.device)  # (ctx,)
        query_pos = torch.arange(ctx - q_len, ctx, device=q.device)  # (q_len,)
        visible = (key_pos <= query_pos.unsqueeze(1)).repeat(group, 1)  # (G*q_len, ctx)
        lane_out = F.scaled_dot_product_attention(
            lane_q,  # (KV, G*q_len, d)
            k.transpose(0, 1).float(),  # (KV, ctx, d)
            v.transpose(0, 1).float(),  # (KV, ctx, d)
            attn_mask=visible,
            scale=scale,
        )  # (KV, G*q_len, d)
        lane_out = lane_out.view(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[start : start + q_len] = lane_out.reshape(q_len, heads, head_dim)
    return out.to(q.dtype)


def paged_verify_attention_reference(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    max_query_len: int,
) -> Tensor:
    """Torch reference of :func:`paged_verify_attention`; fp32 math, q's dtype out.

    The kernel takes the prefill kernel's arguments with their meaning (lane i's
    j-th new query at position ``context_lens[i] - query_lens[i] + j``, causal over
    the lane's whole paged context; zeros on rows of no lane), for a small bound W
    = max_query_len. :func:`paged_prefill_attention_reference` computes exactly
    that, so this delegates to it (its one-token lanes run as decode attention, its
    longer ones one SDPA each).
    """
    return paged_prefill_attention_reference(
        q,
        k_pages,
        v_pages,
        page_tables,
        query_start,
        query_lens,
        context_lens,
        scale,
        max_query_len,
    )
