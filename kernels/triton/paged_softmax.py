"""The paged online-softmax pieces the prefill and verify attention kernels share.

Both kernels give one program BLOCK_Q queries of a lane times the GROUP query
heads of one KV head (BLOCK_M = BLOCK_Q * GROUP_P rows sharing each K/V tile):
:func:`load_query_block` maps the rows to queries and heads and loads them,
:func:`attend_pages` runs the online softmax (base 2, fp32 running max, sum and
accumulator) over a range of the lane's paged key positions, one ``tl.dot``
per BLOCK_N keys, causal per row, and :func:`store_normalised` writes the
normalised rows.  The decode kernel (one query row per program, natural-base
exp on a pre-scaled query, reductions by ``tl.sum``) keeps its own loop: its
arithmetic differs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b (+ acc), accumulated in fp32. WIDEN multiplies fp32 copies of the
    operands: the interpreter's bf16 dot multiplies the raw bits (set for bf16 under
    TRITON_INTERPRET only; the GPU multiplies bf16 directly)."""
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc=acc, input_precision=PRECISION)


@triton.jit
def load_query_block(
    q_ptr,
    stride_qn,
    stride_qh,
    q_start,
    q_begin,
    q_len,
    prefix,
    kv_head,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The block's query rows: (q (BLOCK_M, BLOCK_D), q_pos, token, head (BLOCK_M,),
    q_mask (BLOCK_M, BLOCK_D)); rows past the lane's queries or the group load 0."""
    # Row r of the block: query q_begin + r // GROUP_P, head kv_head * GROUP + r % GROUP_P.
    r = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    qi = q_begin + r // GROUP_P  # (BLOCK_M,) index of the query in the lane's tokens
    hi = r % GROUP_P  # (BLOCK_M,) head within the group
    row_ok = (qi < q_len) & (hi < GROUP)  # (BLOCK_M,)
    head = kv_head * GROUP + hi  # (BLOCK_M,)
    q_pos = prefix + qi  # (BLOCK_M,)
    token = q_start + qi  # (BLOCK_M,) int64
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = d < HEAD_DIM
    q_off = token[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :]
    q_mask = row_ok[:, None] & d_ok[None, :]  # (BLOCK_M, BLOCK_D)
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    return q, q_pos, token, head, q_mask


@triton.jit
def attend_pages(
    q,
    q_pos,
    begin,
    end,
    lane,
    kv_head,
    k_ptr,
    v_ptr,
    pt_ptr,
    scale_log2,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptl,
    stride_ptp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Online softmax of the rows over key positions [begin, end) of the lane's
    pages: (m (BLOCK_M,), l (BLOCK_M,), acc (BLOCK_M, BLOCK_D)), fp32, base 2.  A
    row that sees no key keeps m = -inf, l = 0, acc = 0 (an empty range runs no
    iteration)."""
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(begin, end, BLOCK_N):
        key_pos = start + n  # (BLOCK_N,)
        key_ok = key_pos < end
        col = key_pos // PAGE_SIZE
        page = tl.load(pt_ptr + lane * stride_ptl + col * stride_ptp, mask=key_ok, other=0)
        page = page.to(tl.int64)  # (BLOCK_N,)
        slot = key_pos % PAGE_SIZE  # (BLOCK_N,)
        kv_mask = key_ok[:, None] & d_ok[None, :]  # (BLOCK_N, BLOCK_D)
        k_off = page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + k_off + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        s = dot(q, tl.trans(k), None, DOT_PRECISION, WIDEN) * scale_log2  # (BLOCK_M, BLOCK_N)
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (BLOCK_M,)
        # A row may see no key of a tile (or of the whole range): keep it at -inf.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # (BLOCK_M,)
        p = tl.exp2(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N) zero on hidden keys
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh
        v = tl.load(v_ptr + v_off + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None]
        acc = dot(p.to(v.dtype), v, acc, DOT_PRECISION, WIDEN)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def store_normalised(
    out_ptr, stride_on, stride_oh, token, head, acc, l_i, q_mask, BLOCK_D: tl.constexpr
):
    """acc / l into the rows' output (a row with no key: zeros), in out's dtype."""
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # (BLOCK_M, BLOCK_D)
    o_off = token[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)
