"""Torch reference of kernels/triton/paged_prefill_attention.py, with no Triton import.

It is the kernel's test oracle and the CPU path of the rank programs
(runtime/ranks/model/attention.py), so its work follows the actual lengths:
each lane gathers only the pages its context uses, whatever the page-table
width.  It reads the length vectors to the host once (a reference, not a graph
body).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.reference.paged_decode_attention import paged_decode_attention_reference


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
