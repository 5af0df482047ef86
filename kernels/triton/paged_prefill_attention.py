"""Paged varlen causal attention for prefill and mixed steps over a packed batch.

q (N, H, d) holds the new tokens of L lanes packed flat: lane i's tokens are rows
``query_start[i] .. query_start[i] + query_lens[i]``. K and V pages per layer are
(num_pages, page_size, kv_heads, head_dim), as in runtime/ranks/model/kv_cache.py,
and already hold this step's K/V. Lane i's context after the step is
``context_lens[i]`` keys in pages ``page_tables[i, :]`` (entries past the context
are never read and may be -1). Its j-th new query sits at position
``context_lens[i] - query_lens[i] + j`` and sees the keys at positions up to its
own: the cached prefix plus the chunk, causally. Grouped-query attention: query
head h reads KV head ``h // (H / kv_heads)``. Token rows of no lane (padding) come
out as zeros; lanes with query_len 0 are inactive.

The grid (L, kv_heads, cdiv(max_query_len, BLOCK_Q)) depends on the shapes only, so
a call can be captured in a graph. One program takes BLOCK_Q queries of a lane
times the GROUP query heads of one KV head (BLOCK_Q * GROUP rows sharing each K/V
tile); it exits at once when its block starts past the lane's query_len, and its
key loop stops at the block's last visible position, so the work follows the
actual lengths. A mixed step (one prompt row of up to C tokens plus 1-token decode
rows) is one call with max_query_len = C: the decode rows' later blocks exit.

The torch reference (``paged_prefill_attention_reference`` in
kernels/reference/paged_prefill_attention.py)
is the CPU path of the rank programs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton.checks import check_blocks, check_device, check_packed_lanes, interpreted
from kernels.triton.paged_softmax import attend_pages, load_query_block, store_normalised

# tl.dot needs every dimension of its operands to be at least 16 on the GPU (the
# interpreter does not check): rows (BLOCK_Q * GROUP_P), keys and head_dim blocks.
_MIN_DOT = 16
_TARGET_ROWS = 64  # rows of queries x heads per program


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    pt_ptr,
    qs_ptr,
    ql_ptr,
    ctx_ptr,
    scale_log2,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptl,
    stride_ptp,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_D >= 16)
    lane = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)

    q_len = tl.load(ql_ptr + lane).to(tl.int32)
    q_begin = q_block * BLOCK_Q
    if q_begin >= q_len:  # past the lane's chunk (or an inactive lane): no work
        return
    q_start = tl.load(qs_ptr + lane).to(tl.int64)
    ctx = tl.load(ctx_ptr + lane).to(tl.int32)
    prefix = ctx - q_len  # position of the lane's first new token

    q, q_pos, token, head, q_mask = load_query_block(
        q_ptr, stride_qn, stride_qh, q_start, q_begin, q_len, prefix, kv_head,
        GROUP, GROUP_P, BLOCK_M, HEAD_DIM, BLOCK_D,
    )  # fmt: skip

    # Keys up to the block's last valid query; pad rows (row_ok false) are computed
    # over the same keys and dropped at the store.
    kv_end = prefix + tl.minimum(q_len, q_begin + BLOCK_Q)
    _, l_i, acc = attend_pages(
        q, q_pos, 0, kv_end, lane, kv_head, k_ptr, v_ptr, pt_ptr, scale_log2,
        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptl, stride_ptp,
        BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, BLOCK_D, DOT_PRECISION, WIDEN,
    )  # fmt: skip
    store_normalised(out_ptr, stride_on, stride_oh, token, head, acc, l_i, q_mask, BLOCK_D)


def _check(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    context_lens: Tensor,
    max_query_len: int,
) -> None:
    """Raise ValueError naming the first bad argument."""
    check_packed_lanes(q, k_pages, v_pages, page_tables, query_start, query_lens, context_lens)
    if not isinstance(max_query_len, int) or isinstance(max_query_len, bool) or max_query_len < 0:
        raise ValueError(f"max_query_len: expected an int >= 0, got {max_query_len!r}")
    check_device("q", q, _paged_prefill_kernel)


def default_prefill_blocks(
    group: int, max_query_len: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N) for a GQA group size, Q, head_dim and dtype.

    A program holds BLOCK_Q * next_pow2(group) rows: about 64 (32 for fp32 past
    head_dim 128), at least 16 (the smallest tl.dot), no more queries than Q needs.
    Keys per tile: 64 for half dtypes (32 past head_dim 128); fp32, whose ieee dot
    runs on FMA units, 32 (16 past head_dim 128). Chosen so that sm_90 builds of
    these shapes compile without register spills.
    """
    group_p = triton.next_power_of_2(max(1, group))
    wide = head_dim > 128
    fp32 = dtype == torch.float32
    target_rows = _TARGET_ROWS // 2 if fp32 and wide else _TARGET_ROWS
    block_q = min(triton.next_power_of_2(max(1, max_query_len)), max(1, target_rows // group_p))
    block_q = max(block_q, -(-_MIN_DOT // group_p))
    block_n = (16 if wide else 32) if fp32 else (32 if wide else 64)
    return block_q, block_n


def paged_prefill_attention(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    max_query_len: int,
    *,
    block_q: int | None = None,
    block_n: int | None = None,
) -> Tensor:
    """Causal attention of the packed new tokens q (N, H, d) over each lane's pages.

    k_pages, v_pages (num_pages, page_size, kv_heads, d); page_tables (L, P);
    query_start, query_lens, context_lens (L,) on the device; max_query_len (Q) a
    static bound on query_lens (queries past it are not computed). Returns (N, H, d)
    in q's dtype, zeros on rows of no lane. The grid (L, kv_heads, cdiv(Q, BLOCK_Q))
    depends on the shapes only; block_q and block_n default to
    :func:`default_prefill_blocks` (powers of two, block_n >= 16 and
    block_q * next_pow2(H / kv_heads) >= 16).
    """
    _check(q, k_pages, v_pages, page_tables, query_start, query_lens, context_lens, max_query_len)
    _, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    lanes = page_tables.shape[0]
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    default_q, default_n = default_prefill_blocks(group, max_query_len, head_dim, q.dtype)
    block_q = default_q if block_q is None else block_q
    block_n = default_n if block_n is None else block_n
    check_blocks("block_q", block_q, block_n, group_p, _MIN_DOT)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # (N, H, d) rows of no lane stay 0
    if out.numel() == 0 or lanes == 0 or page_tables.shape[1] == 0 or max_query_len == 0:
        return out
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    rows = block_q * group_p
    grid = (lanes, kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_prefill_kernel[grid](
        q,
        k_pages,
        v_pages,
        out,
        page_tables,
        query_start,
        query_lens,
        context_lens,
        float(scale) * math.log2(math.e),
        *q.stride()[:2],
        *out.stride()[:2],
        *k_pages.stride()[:3],
        *v_pages.stride()[:3],
        *page_tables.stride()[:2],
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN=q.dtype == torch.bfloat16 and interpreted(_paged_prefill_kernel),
        num_warps=8 if q.dtype == torch.float32 or rows * block_d > 64 * 128 else 4,
    )
    return out


__all__ = ["default_prefill_blocks", "paged_prefill_attention"]
