"""Paged verify attention (W > 1 queries per lane) kernel against its torch reference.

The kernel runs under the Triton interpreter on CPU: conftest.py imports it with
TRITON_INTERPRET=1 before this module does. Shapes stay small (the interpreter
runs every program in Python).
"""

import pytest
import torch
import triton

from kernels.reference.paged_prefill_attention import paged_prefill_attention_reference
from kernels.reference.paged_verify_attention import paged_verify_attention_reference
from kernels.triton import checks
from kernels.triton.paged_verify_attention import (
    MAX_QUERY_LEN,
    default_verify_blocks,
    default_verify_splits,
    paged_verify_attention,
)
from runtime.ranks.model.attention import (
    VERIFY_MAX_QUERY_LEN,
    AttentionMetadata,
    attention_kernel,
    paged_attention_reference,
)


def _inputs(seed, heads, kv_heads, head_dim, lanes, *, page_size=4, dtype=torch.float32, pad=2):
    """Random packed q, shuffled pages and -1-padded tables for lanes [(query_len, context)].

    Active lanes' tokens are packed in order with one padding row after each, and
    ``pad`` padding rows at the end; inactive lanes (query_len 0) start where the
    next lane would. Returns q, k, v, tables, query_start, query_lens, context_lens.
    """
    gen = torch.Generator().manual_seed(seed)
    used = [-(-ctx // page_size) for _, ctx in lanes]
    num_pages = sum(used) + 2
    max_pages = max(used, default=0) + 1
    starts, start = [], 0
    for q_len, _ in lanes:
        starts.append(start)
        start += q_len + (1 if q_len else 0)
    num_tokens = start + pad
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen)
    tables = torch.full((len(lanes), max_pages), -1, dtype=torch.int32)
    first = 0
    for lane, n in enumerate(used):
        tables[lane, :n] = perm[first : first + n].int()
        first += n
    query_start = torch.tensor(starts, dtype=torch.int64)
    query_lens = torch.tensor([q_len for q_len, _ in lanes], dtype=torch.int64)
    context_lens = torch.tensor([ctx for _, ctx in lanes], dtype=torch.int64)
    return q, k, v, tables, query_start, query_lens, context_lens


def _padding_rows(query_start, query_lens, num_tokens):
    """(N,) bool: rows that belong to no lane."""
    owned = torch.zeros(num_tokens, dtype=torch.bool)
    for start, n in zip(query_start.tolist(), query_lens.tolist()):
        owned[start : start + n] = True
    return ~owned


def _ragged(w):
    """Lanes (query_len, context) for a bound W: a full lane whose context crosses
    several page boundaries, an inactive lane with pages, a short lane, a lane whose
    queries are its whole context, a 1-token lane and an inactive empty lane."""
    return [(w, 4 * w + 7), (0, 6), (max(1, w // 2), 9), (w, w), (1, 5), (0, 0)]


@pytest.mark.parametrize(
    ("seed", "w", "heads", "kv_heads", "head_dim", "page_size", "num_splits"),
    [
        (0, 1, 4, 2, 16, 4, 1),  # W = 1: every lane decode-like, one split
        (1, 2, 2, 2, 16, 4, 1),  # GQA ratio 1 (rows padded to 16), one split
        (2, 2, 4, 1, 32, 4, 3),  # ratio 4, several splits
        (3, 4, 8, 2, 16, 8, 2),  # ratio 4, page 8
        (4, 4, 6, 2, 24, 5, None),  # ratio 3, d 24, page 5, default splits
        (5, 8, 8, 1, 16, 4, 1),  # ratio 8: 64 rows
        (6, 8, 2, 1, 16, 4, 4),  # ratio 2, 4 splits (some start past short contexts)
        (7, 16, 2, 2, 16, 4, 2),  # W = 16, the most
    ],
)
def test_kernel_matches_reference(seed, w, heads, kv_heads, head_dim, page_size, num_splits):
    lanes = _ragged(w)
    q, k, v, tables, qs, ql, ctx = _inputs(
        seed, heads, kv_heads, head_dim, lanes, page_size=page_size
    )
    scale = head_dim**-0.5
    out = paged_verify_attention(q, k, v, tables, qs, ql, ctx, scale, w, num_splits)
    ref = paged_verify_attention_reference(q, k, v, tables, qs, ql, ctx, scale, w)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[_padding_rows(qs, ql, q.shape[0])] == 0)


@pytest.mark.parametrize(("block_w", "num_splits"), [(2, 1), (4, 3)])
def test_query_blocks_split_a_lane(block_w, num_splits):
    """W = 8 queries x group 8 in blocks of block_w queries (several programs per
    split along the query axis), merged or written directly."""
    lanes = [(8, 21), (3, 3), (0, 2), (7, 30)]
    q, k, v, tables, qs, ql, ctx = _inputs(14, 8, 1, 16, lanes)
    out = paged_verify_attention(
        q, k, v, tables, qs, ql, ctx, 0.25, 8, num_splits, block_w=block_w, block_n=16
    )
    ref = paged_verify_attention_reference(q, k, v, tables, qs, ql, ctx, 0.25, 8)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[_padding_rows(qs, ql, q.shape[0])] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_half_inputs_accumulate_in_fp32(dtype, num_splits):
    lanes = [(4, 14), (1, 3), (0, 0), (3, 25)]
    q, k, v, tables, qs, ql, ctx = _inputs(15, 8, 2, 32, lanes, dtype=dtype)
    out = paged_verify_attention(q, k, v, tables, qs, ql, ctx, 0.125, 4, num_splits)
    ref = paged_verify_attention_reference(q, k, v, tables, qs, ql, ctx, 0.125, 4)
    assert out.dtype == dtype and ref.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_large_scores_stay_finite(num_splits):
    """Scores in the hundreds (exp overflows fp32 unshifted): each split and the
    merge shift by their running maxima."""
    lanes = [(4, 23), (2, 9), (0, 0)]
    q, k, v, tables, qs, ql, ctx = _inputs(21, 4, 2, 16, lanes)
    q = q * 30.0
    out = paged_verify_attention(q, k, v, tables, qs, ql, ctx, 1.0, 4, num_splits)
    ref = paged_verify_attention_reference(q, k, v, tables, qs, ql, ctx, 1.0, 4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_nothing_past_the_context_or_outside_the_lanes_is_read(num_splits):
    """Padding table columns point at a NaN page, slots past each context hold NaN,
    and padding query rows hold NaN: outputs stay finite, padding rows zero."""
    lanes = [(3, 6), (1, 1), (4, 13), (0, 0), (2, 2)]
    q, k, v, tables, qs, ql, ctx = _inputs(16, 4, 2, 16, lanes, page_size=4)
    padding = _padding_rows(qs, ql, q.shape[0])
    q[padding] = float("nan")
    poison = next(p for p in range(k.shape[0]) if not (tables == p).any())  # an unused page
    k[poison] = float("nan")
    v[poison] = float("nan")
    for lane, n in enumerate(ctx.tolist()):
        if n % 4:
            k[tables[lane, n // 4], n % 4 :] = float("nan")
            v[tables[lane, n // 4], n % 4 :] = float("nan")
    tables[tables < 0] = poison
    out = paged_verify_attention(q, k, v, tables, qs, ql, ctx, 0.25, 4, num_splits)
    ref = paged_verify_attention_reference(q, k, v, tables, qs, ql, ctx, 0.25, 4)
    assert torch.isfinite(out).all() and torch.all(out[padding] == 0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_strided_query_int32_lengths_int64_tables_and_empty_steps():
    lanes = [(2, 7), (3, 4), (0, 1)]
    q, k, v, tables, qs, ql, ctx = _inputs(17, 4, 2, 16, lanes)
    qkv = torch.cat([q, torch.randn(q.shape[0], 4, 16)], dim=1)  # (N, H + 2 KV, d)
    q = qkv[:, :4]  # a strided view, as split from a fused projection
    args = (q, k, v, tables.long(), qs.int(), ql.int(), ctx.int(), 0.3, 3)
    ref = paged_verify_attention_reference(q, k, v, tables, qs, ql, ctx, 0.3, 3)
    for splits in (1, 2):
        torch.testing.assert_close(paged_verify_attention(*args, splits), ref, atol=1e-5, rtol=1e-5)
    # All lanes inactive, or W = 0: zeros.
    zero = torch.zeros_like(ql)
    assert torch.all(paged_verify_attention(q, k, v, tables, qs, zero, ctx, 0.3, 3, 2) == 0)
    assert torch.all(paged_verify_attention(q, k, v, tables, qs, ql, ctx, 0.3, 0) == 0)


def test_reference_is_the_prefill_reference_and_the_runtime_one():
    """Verification-shaped metadata (AttentionMetadata.build: padding tokens and
    lanes, ragged W): the verify reference equals the prefill reference and the
    fixed-width runtime reference, and the kernel equals them."""
    gen = torch.Generator().manual_seed(18)
    page_size, head_dim, heads, kv_heads = 4, 16, 8, 2
    query_lens = [5, 1, 3, 5]
    context_lens = [9, 6, 15, 5]
    used = [-(-c // page_size) for c in context_lens]
    perm = torch.randperm(sum(used) + 2, generator=gen).tolist()
    page_tables, first = [], 0
    for n in used:
        page_tables.append(perm[first : first + n])
        first += n
    metadata, positions = AttentionMetadata.build(
        query_lens=query_lens,
        context_lens=context_lens,
        page_tables=page_tables,
        page_size=page_size,
        num_tokens=sum(query_lens) + 3,
        num_lanes=6,
        max_pages=max(used) + 2,
        max_query_len=5,
    )
    num_pages = len(perm)
    q = torch.randn(metadata.num_tokens, heads, head_dim, generator=gen)
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    expected = paged_attention_reference(q, k, v, positions, metadata, 0.2)
    args = (
        q,
        k,
        v,
        metadata.page_tables,
        metadata.query_start,
        metadata.query_lens,
        metadata.context_lens,
        0.2,
        metadata.max_query_len,
    )
    ref = paged_verify_attention_reference(*args)
    assert torch.equal(ref, paged_prefill_attention_reference(*args))
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_verify_attention(*args, 2), expected, atol=1e-5, rtol=1e-5)


def test_runtime_picks_verify_for_unmixed_small_w():
    def meta(max_q, lanes=4, mixed=False):
        return AttentionMetadata(
            query_start=torch.zeros(lanes, dtype=torch.int64),
            query_lens=torch.zeros(lanes, dtype=torch.int64),
            context_lens=torch.zeros(lanes, dtype=torch.int64),
            page_tables=torch.zeros(lanes, 2, dtype=torch.int64),
            slot_mapping=torch.zeros(lanes * max_q, dtype=torch.int64),
            max_query_len=max_q,
            prefill_row=torch.tensor([0]) if mixed else None,
            row_query_len=2 if mixed else 0,
        )

    assert VERIFY_MAX_QUERY_LEN == MAX_QUERY_LEN
    assert attention_kernel(meta(1), 4) == "decode"
    assert attention_kernel(meta(1), 8) == "prefill"  # tokens are not one per lane
    for w in (2, 4, 8, 16):
        assert attention_kernel(meta(w), 4 * w) == "verify"
    assert attention_kernel(meta(17), 4 * 17) == "prefill"
    assert attention_kernel(meta(256), 256) == "prefill"
    assert attention_kernel(meta(8, mixed=True), 16) == "prefill"


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 16, 32, 64])
def test_default_blocks_fit_a_gpu_dot(group):
    """The interpreter runs any tl.dot; the GPU needs every dimension >= 16."""
    for max_q in range(1, MAX_QUERY_LEN + 1):
        for head_dim in (64, 128, 256):
            for dtype in (torch.float32, torch.bfloat16):
                block_w, block_n = default_verify_blocks(group, max_q, head_dim, dtype)
                group_p = triton.next_power_of_2(group)
                assert block_w * group_p >= 16 and block_n >= 16
                assert block_w & (block_w - 1) == 0 and block_n & (block_n - 1) == 0
                assert block_w * group_p <= max(64, group_p)


def test_default_splits():
    assert default_verify_splits(4, 2, 0, 16) == 1
    assert default_verify_splits(1, 8, 2048, 16) == 16  # one long lane: the decode rule
    assert default_verify_splits(1, 8, 4, 16) == 1  # 64 keys: one split
    assert default_verify_splits(256, 8, 2048, 16) == 1  # a wide batch fills the device
    assert default_verify_splits(16, 8, 2048, 16) == 8


def _good():
    return _inputs(19, 4, 2, 16, [(3, 5), (1, 2)])


def _args(q, k, v, tables, qs, ql, ctx):
    return {
        "q": q,
        "k_pages": k,
        "v_pages": v,
        "page_tables": tables,
        "query_start": qs,
        "query_lens": ql,
        "context_lens": ctx,
        "max_query_len": 3,
    }


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("q", lambda a: {**a, "q": a["q"][0]}),
        ("q", lambda a: {**a, "q": a["q"].long()}),
        ("q", lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}),
        ("k_pages", lambda a: {**a, "k_pages": a["k_pages"].half()}),
        ("k_pages", lambda a: {**a, "k_pages": a["k_pages"][0]}),
        (
            "k_pages",
            lambda a: {**a, "k_pages": a["k_pages"][..., :8], "v_pages": a["v_pages"][..., :8]},
        ),
        (
            "k_pages",
            lambda a: {**a, "k_pages": a["k_pages"][:, :, :, None, 0].expand(-1, -1, -1, 16)},
        ),
        ("v_pages", lambda a: {**a, "v_pages": a["v_pages"][:, :2]}),
        ("v_pages", lambda a: {**a, "v_pages": a["v_pages"].double()}),
        ("page_tables", lambda a: {**a, "page_tables": a["page_tables"].float()}),
        ("page_tables", lambda a: {**a, "page_tables": a["page_tables"][0]}),
        ("query_start", lambda a: {**a, "query_start": a["query_start"][:1]}),
        ("query_start", lambda a: {**a, "query_start": a["query_start"].float()}),
        ("query_lens", lambda a: {**a, "query_lens": a["query_lens"][:, None]}),
        ("query_lens", lambda a: {**a, "query_lens": a["query_lens"].bool()}),
        ("context_lens", lambda a: {**a, "context_lens": a["context_lens"][:1]}),
        ("context_lens", lambda a: {**a, "context_lens": a["context_lens"].double()}),
        ("max_query_len", lambda a: {**a, "max_query_len": MAX_QUERY_LEN + 1}),
        ("max_query_len", lambda a: {**a, "max_query_len": -1}),
        ("max_query_len", lambda a: {**a, "max_query_len": 3.0}),
        ("max_query_len", lambda a: {**a, "max_query_len": True}),
        ("num_splits", lambda a: {**a, "num_splits": 0}),
        ("num_splits", lambda a: {**a, "num_splits": 2.0}),
        ("block_w", lambda a: {**a, "block_w": 3}),
        ("block_w", lambda a: {**a, "block_w": 4}),  # 4 x group 2 is under 16 rows
        ("block_n", lambda a: {**a, "block_n": 8}),
    ],
)
def test_launcher_names_bad_argument(name, bad):
    args = bad(_args(*_good()))
    with pytest.raises(ValueError, match=rf"^{name}:"):
        paged_verify_attention(**args, scale=0.1)


def test_launcher_refuses_gqa_mismatch_and_cpu_tensors_outside_the_interpreter(monkeypatch):
    q, k, v, tables, qs, ql, ctx = _inputs(20, 4, 3, 16, [(2, 3)])
    with pytest.raises(ValueError, match=r"^k_pages:.*kv_heads 3"):
        paged_verify_attention(q, k, v, tables, qs, ql, ctx, 0.1, 2)
    # As if compiled (no TRITON_INTERPRET): CPU tensors are refused, naming q.
    monkeypatch.setattr(checks, "interpreted", lambda kernel: False)
    with pytest.raises(ValueError, match=r"^q: on cpu"):
        paged_verify_attention(*_good(), 0.1, 3)
