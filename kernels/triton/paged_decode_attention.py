"""Paged decode attention (flash-decoding): one query token per lane over its pages.

q (L, H, d): one new query per lane (decode, W = 1). K and V pages per layer are
(num_pages, page_size, kv_heads, head_dim), as in runtime/ranks/model/kv_cache.py.
Grouped-query attention: query head h reads KV head ``h // (H / kv_heads)``.
page_tables (L, P) int32/int64 hold each lane's pages in order (padding such as -1
past the lane's context is never read); context_lens (L,) on the device say how
many keys each lane sees, the new token's included. Lanes with context 0 are
inactive and give zeros.

The grid is fixed by the shapes alone (L, H, num_splits), so it can be captured in
a graph: each program takes a contiguous chunk of page-table columns and exits at
once when its chunk starts past the lane's last page, so the work follows the actual
lengths. Programs write partial (max, sum, acc) in fp32; a few torch ops then merge
the splits by log-sum-exp.

The torch reference (``paged_decode_attention_reference`` in
kernels/reference/paged_decode_attention.py)
is the CPU path of the rank programs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton.checks import check_device, check_index, check_query_and_pages


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pt_ptr,
    ctx_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    scale,
    stride_ql,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptl,
    stride_ptp,
    num_splits,
    pages_per_split,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    lane = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1)
    kv_head = head // GROUP

    ctx = tl.load(ctx_ptr + lane).to(tl.int32)
    lane_pages = (ctx + PAGE_SIZE - 1) // PAGE_SIZE
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, lane_pages)

    # Partial results of this (lane, head, split): flat index into (L, H, S).
    part = (lane * num_heads + head) * num_splits + split
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = d < HEAD_DIM
    s = tl.arange(0, PAGE_SIZE)  # (PAGE_SIZE,)

    # A split past the lane's last page runs no iteration: it loads nothing and
    # stores the empty partial (m = -inf, l = 0, acc = 0).
    m_i = tl.full([], -float("inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    q = tl.load(q_ptr + lane * stride_ql + head * stride_qh + d, mask=d_ok, other=0.0)
    q = q.to(tl.float32) * scale  # (BLOCK_D,)
    for p in range(first, last):
        page = tl.load(pt_ptr + lane * stride_ptl + p * stride_ptp).to(tl.int64)
        key_ok = (p * PAGE_SIZE + s) < ctx  # (PAGE_SIZE,)
        ok = key_ok[:, None] & d_ok[None, :]  # (PAGE_SIZE, BLOCK_D)
        k_off = page * stride_kp + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + k_off, mask=ok, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1)  # (PAGE_SIZE,)
        scores = tl.where(key_ok, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))  # finite: key 0 of the page is valid
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(scores - m_new)  # (PAGE_SIZE,) zero on masked keys
        v_off = page * stride_vp + s[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        v = tl.load(v_ptr + v_off, mask=ok, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * v, axis=0)
        m_i = m_new
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)
    tl.store(acc_ptr + part * HEAD_DIM + d, acc, mask=d_ok)


def _check(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    context_lens: Tensor,
) -> None:
    """Raise ValueError naming the first bad argument."""
    page_size = check_query_and_pages(q, k_pages, v_pages, "L")
    lanes = q.shape[0]
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"k_pages: page_size {page_size} must be a power of two")
    if page_tables.dim() != 2 or page_tables.shape[0] != lanes:
        raise ValueError(
            f"page_tables: expected ({lanes}, P), got shape {tuple(page_tables.shape)}"
        )
    check_index("page_tables", page_tables, q.device)
    if context_lens.shape != (lanes,):
        raise ValueError(
            f"context_lens: expected ({lanes},), got shape {tuple(context_lens.shape)}"
        )
    check_index("context_lens", context_lens, q.device)
    check_device("q", q, _paged_decode_split_kernel)


def default_num_splits(max_pages: int, page_size: int) -> int:
    """Splits for a page-table width: about 256 keys each, at most 16, at most P."""
    if max_pages <= 0:
        return 1
    return max(1, min(16, max_pages, math.ceil(max_pages * page_size / 256)))


def paged_decode_attention(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> Tensor:
    """Decode attention of q (L, H, d) over each lane's pages; returns (L, H, d).

    k_pages, v_pages (num_pages, page_size, kv_heads, d); page_tables (L, P);
    context_lens (L,) on the device. The grid (L, H, num_splits) depends on the
    shapes only; num_splits defaults to :func:`default_num_splits` of P.
    """
    _check(q, k_pages, v_pages, page_tables, context_lens)
    lanes, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    max_pages = page_tables.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(max_pages, page_size)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected a positive int, got {num_splits!r}")
    out = torch.zeros_like(q)
    if lanes == 0 or heads == 0 or max_pages == 0:
        return out
    pages_per_split = math.ceil(max_pages / num_splits)

    shape = (lanes, heads, num_splits)
    m = torch.empty(shape, dtype=torch.float32, device=q.device)  # (L, H, S)
    l_sum = torch.empty(shape, dtype=torch.float32, device=q.device)  # (L, H, S)
    acc = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)  # (L, H, S, d)
    _paged_decode_split_kernel[shape](
        q,
        k_pages,
        v_pages,
        page_tables,
        context_lens,
        m,
        l_sum,
        acc,
        float(scale),
        *q.stride()[:2],
        *k_pages.stride()[:3],
        *v_pages.stride()[:3],
        *page_tables.stride()[:2],
        num_splits,
        pages_per_split,
        GROUP=heads // kv_heads,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return merge_splits(m, l_sum, acc).to(q.dtype)


def merge_splits(m: Tensor, l_sum: Tensor, acc: Tensor) -> Tensor:
    """Log-sum-exp merge of split partials: m, l (L, H, S), acc (L, H, S, d) → (L, H, d).

    Empty splits hold m = -inf, l = 0, acc = 0; a lane with no keys gives zeros.
    Fixed-shape tensor ops only (no host sync).
    """
    top = m.amax(dim=-1, keepdim=True)  # (L, H, 1)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(m - top)  # (L, H, S): 0 for empty splits
    num = (w.unsqueeze(-1) * acc).sum(dim=2)  # (L, H, d)
    den = (w * l_sum).sum(dim=-1, keepdim=True)  # (L, H, 1)
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))


__all__ = [
    "default_num_splits",
    "merge_splits",
    "paged_decode_attention",
]
