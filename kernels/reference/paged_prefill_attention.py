"""Torch reference of kernels/triton/paged_prefill_attention.py, with no Triton import.

It is the kernel's test oracle and the CPU path of the rank programs
(runtime/ranks/model/attention.py), so its work follows the actual lengths:
each lane gathers only the pages its context uses, whatever the page-table
width.  It reads the length vectors to the host once (a reference, not a graph
body); a caller running several layers over the same lanes builds that
:func:`prefill_plan` once and passes it to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.reference.paged_decode_attention import (
    DecodeBucket,
    decode_plan,
    paged_decode_attention_reference,
)


@dataclass(frozen=True)
class PrefillLane:
    """A lane of more than one new token: its ``start`` and ``q_len`` in the packed
    tokens, its context ``ctx``, ``pages`` (n_pages,) its pages and ``bias``
    (G * q_len, ctx) float32: 0 where the query (row ``g * q_len + i``) sees the
    key, -inf where the key lies after it."""

    start: int
    q_len: int
    ctx: int
    pages: Tensor
    bias: Tensor


@dataclass(frozen=True)
class PrefillPlan:
    """What :func:`paged_prefill_attention_reference` reads from the lengths:
    the one-token lanes (``single_rows`` (S,) their token rows, ``single_lanes``
    (S,) their lanes, ``single_plan`` their decode buckets; None when there are
    none) and the lanes of more tokens.  Every layer of a step shares it."""

    single_rows: Tensor | None
    single_lanes: Tensor | None
    single_plan: list[DecodeBucket]
    lanes: list[PrefillLane]


def prefill_plan(
    page_tables: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    context_lens: Tensor,
    page_size: int,
    group: int,
) -> PrefillPlan:
    """The plan of these lanes (one host read of the three length vectors).
    ``group``: query heads per KV head."""
    device = page_tables.device
    starts, q_lens, contexts = query_start.tolist(), query_lens.tolist(), context_lens.tolist()
    single = [i for i, n in enumerate(q_lens) if n == 1]
    rows = lanes = None
    single_plan: list[DecodeBucket] = []
    if single:
        rows = torch.tensor([starts[i] for i in single], device=device)
        lanes = torch.tensor(single, device=device)
        single_plan = decode_plan(page_tables[lanes], context_lens[lanes], page_size)
    longer = []
    for lane, (start, q_len, ctx) in enumerate(zip(starts, q_lens, contexts)):
        if q_len <= 1:
            continue
        pages = page_tables[lane, : -(-ctx // page_size)].long()  # (n_pages,)
        key_pos = torch.arange(ctx, device=device)  # (ctx,)
        query_pos = torch.arange(ctx - q_len, ctx, device=device)  # (q_len,)
        hidden = key_pos > query_pos.unsqueeze(1)  # (q_len, ctx)
        bias = torch.zeros(hidden.shape, dtype=torch.float32, device=device)
        bias = bias.masked_fill_(hidden, float("-inf")).repeat(group, 1)  # (G*q_len, ctx)
        longer.append(PrefillLane(start, q_len, ctx, pages, bias))
    return PrefillPlan(rows, lanes, single_plan, longer)


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
    plan: PrefillPlan | None = None,
) -> Tensor:
    """Torch reference of :func:`paged_prefill_attention`; fp32 math, q's dtype out.

    Its work follows the actual lengths: each active lane gathers only the pages its
    context uses and runs one softmax attention of its chunk over them, the GQA
    group's query heads stacked as rows against their one KV head (no repeated
    K/V). Lanes' query_len must not exceed their context_len. max_query_len is
    unused (the signature is the kernel's). ``plan``: :func:`prefill_plan` of
    these lengths, built once for every layer of a step (None: built here, one
    host read of the three length vectors).
    """
    del max_query_len
    num_tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    if plan is None:
        plan = prefill_plan(page_tables, query_start, query_lens, context_lens, page_size, group)
    out = torch.zeros(num_tokens, heads, head_dim, dtype=torch.float32, device=q.device)
    # One-token lanes (decode rows of a mixed step) see their whole context:
    # decode attention, all of them at once.
    if plan.single_rows is not None:
        lanes = plan.single_lanes
        out[plan.single_rows] = paged_decode_attention_reference(
            q[plan.single_rows], k_pages, v_pages, page_tables[lanes], context_lens[lanes], scale,
            plan.single_plan,
        ).float()  # fmt: skip
    for lane in plan.lanes:
        start, q_len, ctx = lane.start, lane.q_len, lane.ctx
        k = k_pages.index_select(0, lane.pages).reshape(-1, kv_heads, head_dim)[:ctx]
        v = v_pages.index_select(0, lane.pages).reshape(-1, kv_heads, head_dim)[:ctx]
        lane_q = q[start : start + q_len].float().view(q_len, kv_heads, group, head_dim)
        lane_q = lane_q.permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, head_dim)
        k = k.transpose(0, 1).float()  # (KV, ctx, d)
        v = v.transpose(0, 1).float()  # (KV, ctx, d)
        scores = torch.bmm(lane_q, k.transpose(1, 2)).mul_(scale).add_(lane.bias)
        weights = torch.softmax(scores, dim=-1)  # (KV, G*q_len, ctx)
        lane_out = torch.bmm(weights, v)  # (KV, G*q_len, d)
        lane_out = lane_out.view(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[start : start + q_len] = lane_out.reshape(q_len, heads, head_dim)
    return out.to(q.dtype)
