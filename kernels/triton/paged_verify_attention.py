"""Paged attention of a few new tokens per lane (speculative verification, W > 1).

Same arguments as :func:`~kernels.triton.paged_prefill_attention.paged_prefill_attention`:
q (N, H, d) holds the new tokens of L lanes packed flat, lane i's tokens being rows
``query_start[i] .. query_start[i] + query_lens[i]``. K and V pages per layer are
(num_pages, page_size, kv_heads, head_dim), as in runtime/ranks/model/kv_cache.py,
and already hold this step's K/V. Lane i's context after the step is
``context_lens[i]`` keys in pages ``page_tables[i, :]`` (entries past the context
are never read and may be -1). Its j-th new query sits at position
``context_lens[i] - query_lens[i] + j`` and sees the keys at positions up to its
own. Grouped-query attention: query head h reads KV head ``h // (H / kv_heads)``.
Token rows of no lane come out as zeros; lanes with query_len 0 are inactive.
``max_query_len`` (W) is at most :data:`MAX_QUERY_LEN`: a verification step has
each lane's pending token plus up to W - 1 proposals.

Flash-decoding over the W queries at once: the grid (L, kv_heads, num_splits *
query_blocks) depends on the shapes only, so a call can be captured in a graph.
A program takes one split (a contiguous range of key positions, a multiple of
BLOCK_N) of one lane's context for BLOCK_W queries times the GROUP query heads of
one KV head: BLOCK_W * GROUP rows share each K/V tile, one ``tl.dot`` per tile,
with a causal mask per row. ``query_blocks`` is 1 unless W * GROUP exceeds the
rows a program holds (64; 32 for fp32 past head_dim 128). A program exits at once
when its split starts past the lane's context or its query block past the lane's
query_len, so the work follows the actual lengths. With one split the program
normalises and writes the output itself; with several, programs write partial
(max, sum, acc) in fp32 and a second kernel, one program per (lane, KV head,
query), merges the lane's non-empty splits by log-sum-exp.

The torch reference (``paged_verify_attention_reference`` in
kernels/reference/paged_verify_attention.py)
is the prefill reference, which computes exactly this.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton.checks import check_blocks, check_device, check_packed_lanes, interpreted
from kernels.triton.paged_softmax import attend_pages, load_query_block, store_normalised

MAX_QUERY_LEN = 16  # new tokens per lane: the pending token plus up to 15 proposals
# tl.dot needs every dimension of its operands to be at least 16 on the GPU (the
# interpreter does not check): rows (BLOCK_W * GROUP_P), keys and head_dim blocks.
_MIN_DOT = 16
_TARGET_ROWS = 64  # rows of queries x heads per program
_TARGET_PROGRAMS = 1024  # splits stop growing once lanes x kv_heads x splits reach this


@triton.jit
def _store_partials(
    m_ptr,
    l_ptr,
    acc_ptr,
    first,
    m_i,
    l_i,
    acc,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A block's partial (max, sum, acc) rows at flat rows ``first ..`` of (L, KV, S, ROWS)."""
    part = first + tl.arange(0, BLOCK_M)  # (BLOCK_M,) flat row of (L, KV, S, ROWS)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = d < HEAD_DIM
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)
    acc_off = part[:, None] * HEAD_DIM + d[None, :]
    tl.store(acc_ptr + acc_off, acc, mask=d_ok[None, :])


@triton.jit
def _paged_verify_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
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
    num_splits,
    keys_per_split,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_W: tl.constexpr,
    Q_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_W * GROUP_P
    ROWS: tl.constexpr = Q_BLOCKS * BLOCK_M  # partial rows per (lane, KV head, split)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_D >= 16)
    lane = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2) // Q_BLOCKS
    q_block = tl.program_id(2) % Q_BLOCKS
    kv_heads = tl.num_programs(1)

    q_len = tl.load(ql_ptr + lane).to(tl.int32)
    ctx = tl.load(ctx_ptr + lane).to(tl.int32)
    q_begin = q_block * BLOCK_W
    begin = split * keys_per_split  # first key position of the split
    # Past the lane's queries (or an inactive lane), or past its context: no work.
    # The merge reads only the splits that start inside the context.
    if q_begin >= q_len or begin >= ctx:
        return
    q_start = tl.load(qs_ptr + lane).to(tl.int64)
    prefix = ctx - q_len  # position of the lane's first new token

    q, q_pos, token, head, q_mask = load_query_block(
        q_ptr, stride_qn, stride_qh, q_start, q_begin, q_len, prefix, kv_head,
        GROUP, GROUP_P, BLOCK_M, HEAD_DIM, BLOCK_D,
    )  # fmt: skip

    # The split's keys up to the block's last valid query (a split that starts past
    # it runs no iteration and stores the empty partial: m = -inf, l = 0, acc = 0).
    end = tl.minimum(begin + keys_per_split, prefix + tl.minimum(q_len, q_begin + BLOCK_W))
    m_i, l_i, acc = attend_pages(
        q, q_pos, begin, end, lane, kv_head, k_ptr, v_ptr, pt_ptr, scale_log2,
        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptl, stride_ptp,
        BLOCK_M, BLOCK_N, PAGE_SIZE, HEAD_DIM, BLOCK_D, DOT_PRECISION, WIDEN,
    )  # fmt: skip
    if SINGLE:  # the split is the whole context: normalise and write the output
        store_normalised(out_ptr, stride_on, stride_oh, token, head, acc, l_i, q_mask, BLOCK_D)
    else:  # partials of every row of the block (pad rows too: the merge skips them)
        part = ((lane * kv_heads + kv_head) * num_splits + split).to(tl.int64) * ROWS
        part = part + q_block * BLOCK_M  # the block's first row of (L, KV, S, ROWS)
        _store_partials(m_ptr, l_ptr, acc_ptr, part, m_i, l_i, acc, BLOCK_M, HEAD_DIM, BLOCK_D)


@triton.jit
def _paged_verify_merge_kernel(
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    qs_ptr,
    ql_ptr,
    ctx_ptr,
    stride_on,
    stride_oh,
    num_splits,
    keys_per_split,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (lane, KV head, query): log-sum-exp merge of the splits that start inside
    the lane's context, for the GROUP query heads of the KV head."""
    lane = tl.program_id(0)
    kv_head = tl.program_id(1)
    qi = tl.program_id(2)
    kv_heads = tl.num_programs(1)
    q_len = tl.load(ql_ptr + lane).to(tl.int32)
    if qi >= q_len:  # past the lane's queries (or an inactive lane): no work
        return
    ctx = tl.load(ctx_ptr + lane).to(tl.int32)
    used = tl.minimum((ctx + keys_per_split - 1) // keys_per_split, num_splits)
    token = tl.load(qs_ptr + lane).to(tl.int64) + qi

    hi = tl.arange(0, GROUP_P)  # (GROUP_P,)
    h_ok = hi < GROUP
    head = kv_head * GROUP + hi  # (GROUP_P,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = d < HEAD_DIM
    base = (lane * kv_heads + kv_head).to(tl.int64) * num_splits  # split 0 of (L, KV, S)
    row = qi * GROUP_P + hi  # (GROUP_P,) row within a split's ROWS
    sp = tl.arange(0, BLOCK_S)  # (BLOCK_S,)
    s_ok = sp < used
    flat = (base + sp[:, None]) * ROWS + row[None, :]  # (BLOCK_S, GROUP_P)
    m = tl.load(m_ptr + flat, mask=s_ok[:, None], other=-float("inf"))
    top = tl.max(m, axis=0)  # (GROUP_P,) finite for a valid row: split 0 holds key 0
    top = tl.where(top == -float("inf"), 0.0, top)
    w = tl.exp2(m - top[None, :])  # (BLOCK_S, GROUP_P) zero on empty splits
    l_sum = tl.load(l_ptr + flat, mask=s_ok[:, None], other=0.0)
    den = tl.sum(w * l_sum, axis=0)  # (GROUP_P,)
    num = tl.zeros([GROUP_P, BLOCK_D], dtype=tl.float32)
    for s in range(0, used):
        part = (base + s) * ROWS + row  # (GROUP_P,)
        w_s = tl.exp2(tl.load(m_ptr + part) - top)  # (GROUP_P,)
        a = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=d_ok[None, :], other=0.0)
        num += w_s[:, None] * a
    out = tl.where(den[:, None] > 0, num / tl.where(den > 0, den, 1.0)[:, None], 0.0)
    o_off = token * stride_on + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


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
    if (
        not isinstance(max_query_len, int)
        or isinstance(max_query_len, bool)
        or not 0 <= max_query_len <= MAX_QUERY_LEN
    ):
        raise ValueError(
            f"max_query_len: expected an int in 0..{MAX_QUERY_LEN}, got {max_query_len!r} "
            "(longer chunks go to paged_prefill_attention)"
        )
    check_device("q", q, _paged_verify_split_kernel)


def default_verify_blocks(
    group: int, max_query_len: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int]:
    """(BLOCK_W, BLOCK_N) for a GQA group size, W, head_dim and dtype.

    A program holds BLOCK_W * next_pow2(group) rows: every query of the lane when
    that is at most 64 rows (32 for fp32 past head_dim 128), else as many queries
    as fit; at least 16 rows (the smallest tl.dot). Keys per tile: 64 for half
    dtypes (32 past head_dim 128 or past 64 rows); fp32, whose ieee dot runs on FMA
    units, 32 (16 past head_dim 128). The prefill kernel's sizes, which compile
    without spills on sm_90 (not yet measured for this kernel).
    """
    group_p = triton.next_power_of_2(max(1, group))
    wide = head_dim > 128
    fp32 = dtype == torch.float32
    target_rows = _TARGET_ROWS // 2 if fp32 and wide else _TARGET_ROWS
    block_w = min(triton.next_power_of_2(max(1, max_query_len)), max(1, target_rows // group_p))
    block_w = max(block_w, -(-_MIN_DOT // group_p))
    block_n = (16 if wide else 32) if fp32 else (32 if wide or block_w * group_p > 64 else 64)
    return block_w, block_n


def default_verify_splits(lanes: int, kv_heads: int, max_pages: int, page_size: int) -> int:
    """Splits for a batch's shape: about 256 keys each, at most 16, at most P (as
    the decode kernel), and no more than it takes lanes x kv_heads x splits to reach
    about 1,024 programs (a wide batch already fills the device)."""
    if max_pages <= 0:
        return 1
    splits = max(1, min(16, max_pages, math.ceil(max_pages * page_size / 256)))
    return max(1, min(splits, math.ceil(_TARGET_PROGRAMS / max(1, lanes * kv_heads))))


def _blocks(
    block_w: int | None,
    block_n: int | None,
    group: int,
    max_query_len: int,
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[int, int]:
    """``block_w`` and ``block_n``, or :func:`default_verify_blocks` where None; checked."""
    default_w, default_n = default_verify_blocks(group, max_query_len, head_dim, dtype)
    block_w = default_w if block_w is None else block_w
    block_n = default_n if block_n is None else block_n
    check_blocks("block_w", block_w, block_n, triton.next_power_of_2(group), _MIN_DOT)
    return block_w, block_n


def _splits(
    num_splits: int | None, lanes: int, kv_heads: int, max_pages: int, page_size: int
) -> int:
    """``num_splits``, or :func:`default_verify_splits` when None; checked."""
    if num_splits is None:
        num_splits = default_verify_splits(lanes, kv_heads, max_pages, page_size)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits: expected a positive int, got {num_splits!r}")
    return num_splits


def _merge(
    grid: tuple[int, int, int],
    out: Tensor,
    partials: tuple[Tensor, Tensor, Tensor],
    lengths: tuple[Tensor, Tensor, Tensor],
    num_splits: int,
    keys_per_split: int,
    rows: int,
    shared: dict,
) -> None:
    """The merge kernel over the split partials (m, l, acc) into ``out``, one
    program per (lane, KV head, query); ``lengths`` are (query_start, query_lens,
    context_lens), ``rows`` the partial rows per (lane, KV head, split)."""
    _paged_verify_merge_kernel[grid](
        out,
        *partials,
        *lengths,
        *out.stride()[:2],
        num_splits,
        keys_per_split,
        ROWS=rows,
        BLOCK_S=triton.next_power_of_2(num_splits),
        **shared,
    )


def _partials(out: Tensor, shape: tuple[int, ...], single: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The split kernel's fp32 partials (m, l (L, KV, S, R), acc (L, KV, S, R, d)); with
    one split the kernel writes ``out`` directly and never touches them (out stands in)."""
    if single:
        return out, out, out
    m = torch.empty(shape, dtype=torch.float32, device=out.device)  # (L, KV, S, R)
    l_sum = torch.empty(shape, dtype=torch.float32, device=out.device)  # (L, KV, S, R)
    acc = torch.empty((*shape, out.shape[-1]), dtype=torch.float32, device=out.device)
    return m, l_sum, acc


def paged_verify_attention(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    max_query_len: int,
    num_splits: int | None = None,
    *,
    block_w: int | None = None,
    block_n: int | None = None,
) -> Tensor:
    """Causal attention of up to W = max_query_len (<= 16) packed new tokens per lane.

    q (N, H, d); k_pages, v_pages (num_pages, page_size, kv_heads, d); page_tables
    (L, P); query_start, query_lens, context_lens (L,) on the device; max_query_len
    a static bound on query_lens (queries past it are not computed). Returns
    (N, H, d) in q's dtype, zeros on rows of no lane. The grid (L, kv_heads,
    num_splits * cdiv(W, BLOCK_W)) depends on the shapes only; num_splits defaults
    to :func:`default_verify_splits`, block_w and block_n to
    :func:`default_verify_blocks` (powers of two, block_n >= 16 and
    block_w * next_pow2(H / kv_heads) >= 16).
    """
    _check(q, k_pages, v_pages, page_tables, query_start, query_lens, context_lens, max_query_len)
    _, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    lanes, max_pages = page_tables.shape
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    block_w, block_n = _blocks(block_w, block_n, group, max_query_len, head_dim, q.dtype)
    num_splits = _splits(num_splits, lanes, kv_heads, max_pages, page_size)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # (N, H, d) rows of no lane stay 0
    if out.numel() == 0 or lanes == 0 or max_pages == 0 or max_query_len == 0:
        return out
    q_blocks = triton.cdiv(max_query_len, block_w)
    rows = block_w * group_p
    # Key positions per split: a multiple of BLOCK_N covering the table's capacity.
    keys_per_split = triton.cdiv(triton.cdiv(max_pages * page_size, num_splits), block_n) * block_n
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    single = num_splits == 1
    m, l_sum, acc = _partials(out, (lanes, kv_heads, num_splits, q_blocks * rows), single)
    shared = dict(GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, BLOCK_D=block_d)
    _paged_verify_split_kernel[(lanes, kv_heads, num_splits * q_blocks)](
        q,
        k_pages,
        v_pages,
        out,
        m,
        l_sum,
        acc,
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
        num_splits,
        keys_per_split,
        BLOCK_W=block_w,
        Q_BLOCKS=q_blocks,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        SINGLE=single,
        **shared,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN=q.dtype == torch.bfloat16 and interpreted(_paged_verify_split_kernel),
        num_warps=8 if q.dtype == torch.float32 or rows * block_d > 64 * 128 else 4,
    )
    if not single:
        grid, lengths = (lanes, kv_heads, max_query_len), (query_start, query_lens, context_lens)
        partials = (m, l_sum, acc)
        _merge(grid, out, partials, lengths, num_splits, keys_per_split, q_blocks * rows, shared)
    return out


__all__ = [
    "MAX_QUERY_LEN",
    "default_verify_blocks",
    "default_verify_splits",
    "paged_verify_attention",
]
