"""Paged decode attention kernel against its torch references.

The kernel runs under the Triton interpreter on CPU: conftest.py imports it with
TRITON_INTERPRET=1 before this module does.
"""

import pytest
import torch

from kernels.reference.paged_decode_attention import paged_decode_attention_reference
from kernels.triton.paged_decode_attention import paged_decode_attention
from runtime.ranks.model.attention import AttentionMetadata, paged_attention_reference

PAGE_SIZE = 16
# Contexts: inactive, one token, exactly one page, exactly two pages, and a long one
# that spans several splits at num_splits > 1.
CONTEXTS = [0, 1, PAGE_SIZE, 2 * PAGE_SIZE, 7 * PAGE_SIZE + 5]


def _inputs(seed, heads, kv_heads, head_dim, contexts, dtype=torch.float32, max_pages=9):
    """Random q, pages (shuffled, with unused pages) and -1-padded page tables."""
    gen = torch.Generator().manual_seed(seed)
    lanes = len(contexts)
    used = [-(-c // PAGE_SIZE) for c in contexts]
    num_pages = sum(used) + 3
    q = torch.randn(lanes, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_pages, PAGE_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_pages, PAGE_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen)
    tables = torch.full((lanes, max_pages), -1, dtype=torch.int32)
    start = 0
    for lane, n in enumerate(used):
        tables[lane, :n] = perm[start : start + n].int()
        start += n
    ctx = torch.tensor(contexts, dtype=torch.int64)
    return q, k, v, tables, ctx


@pytest.mark.parametrize(
    ("seed", "heads", "kv_heads", "head_dim", "num_splits"),
    [
        (0, 4, 4, 64, 1),  # GQA ratio 1, one split
        (1, 4, 4, 64, 3),  # ratio 1, several splits
        (2, 8, 2, 128, 1),  # GQA ratio 4, head_dim 128
        (3, 8, 2, 128, 4),
        (4, 4, 1, 64, None),  # ratio 4, default splits
    ],
)
def test_kernel_matches_reference(seed, heads, kv_heads, head_dim, num_splits):
    q, k, v, tables, ctx = _inputs(seed, heads, kv_heads, head_dim, CONTEXTS)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k, v, tables, ctx, scale, num_splits=num_splits)
    ref = paged_decode_attention_reference(q, k, v, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[0] == 0)  # context 0: inactive lane


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_fp32(dtype):
    q, k, v, tables, ctx = _inputs(5, 8, 2, 64, [3, 2 * PAGE_SIZE + 1], dtype=dtype)
    out = paged_decode_attention(q, k, v, tables, ctx, 0.125, num_splits=2)
    ref = paged_decode_attention_reference(q, k, v, tables, ctx, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_int64_tables_and_all_inactive_give_zeros():
    q, k, v, tables, ctx = _inputs(6, 4, 2, 64, [0, 0, 0])
    out = paged_decode_attention(q, k, v, tables.long(), ctx.int(), 0.1, num_splits=2)
    assert torch.all(out == 0)
    # Garbage (NaN) in the pages of an inactive lane's padding is never read.
    q, k, v, tables, ctx = _inputs(7, 4, 2, 64, [0, 5])
    k[tables[1, 0], 5:] = float("nan")
    v[tables[1, 0], 5:] = float("nan")
    out = paged_decode_attention(q, k, v, tables.long(), ctx, 0.1, num_splits=3)
    assert torch.all(out[0] == 0) and torch.isfinite(out).all()


def test_pages_past_the_context_are_never_read():
    """Work follows the lengths: padding columns may point at a poisoned page."""
    q, k, v, tables, ctx = _inputs(12, 4, 2, 64, [0, 1, PAGE_SIZE, 3 * PAGE_SIZE + 2])
    poison = next(p for p in range(k.shape[0]) if not (tables == p).any())  # an unused page
    k[poison] = float("nan")
    v[poison] = float("nan")
    tables[tables < 0] = poison
    out = paged_decode_attention(q, k, v, tables, ctx, 0.125, num_splits=4)
    ref = paged_decode_attention_reference(q, k, v, tables, ctx, 0.125)
    assert torch.isfinite(out).all() and torch.all(out[0] == 0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("seed", "heads", "kv_heads"), [(8, 4, 4), (9, 8, 2)])
def test_reference_matches_runtime_paged_attention(seed, heads, kv_heads):
    """Decode-shaped metadata: one query per active lane at position context - 1."""
    q, k, v, tables, ctx = _inputs(seed, heads, kv_heads, 64, CONTEXTS)
    lanes = len(CONTEXTS)
    active = (ctx > 0).long()
    metadata = AttentionMetadata(
        query_start=torch.arange(lanes),
        query_lens=active,
        context_lens=ctx,
        page_tables=tables.long(),
        slot_mapping=torch.full((lanes,), -1, dtype=torch.int64),
        max_query_len=1,
    )
    positions = (ctx - 1).clamp(min=0)
    expected = paged_attention_reference(q, k, v, positions, metadata, 0.125)
    ref = paged_decode_attention_reference(q, k, v, tables, ctx, 0.125)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


def _good():
    return _inputs(10, 4, 2, 64, [3, 20])


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("q", lambda a: {**a, "q": a["q"][0]}),
        ("q", lambda a: {**a, "q": a["q"].long()}),
        ("q", lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}),
        ("k_pages", lambda a: {**a, "k_pages": a["k_pages"].half()}),
        (
            "k_pages",
            lambda a: {**a, "k_pages": a["k_pages"][..., :32], "v_pages": a["v_pages"][..., :32]},
        ),
        (
            "k_pages",
            lambda a: {**a, "k_pages": a["k_pages"][:, :, :, None, 0].expand(-1, -1, -1, 64)},
        ),
        ("v_pages", lambda a: {**a, "v_pages": a["v_pages"][:, :8]}),
        ("page_tables", lambda a: {**a, "page_tables": a["page_tables"].float()}),
        ("page_tables", lambda a: {**a, "page_tables": a["page_tables"][:1]}),
        ("context_lens", lambda a: {**a, "context_lens": a["context_lens"].float()}),
        ("context_lens", lambda a: {**a, "context_lens": a["context_lens"][:1]}),
        ("num_splits", lambda a: {**a, "num_splits": 0}),
    ],
)
def test_launcher_names_bad_argument(name, bad):
    q, k, v, tables, ctx = _good()
    args = {"q": q, "k_pages": k, "v_pages": v, "page_tables": tables, "context_lens": ctx}
    args = bad(args)
    num_splits = args.pop("num_splits", None)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        paged_decode_attention(**args, scale=0.1, num_splits=num_splits)


def test_launcher_refuses_gqa_mismatch():
    q, k, v, tables, ctx = _inputs(11, 4, 3, 64, [3])
    with pytest.raises(ValueError, match=r"^k_pages:.*kv_heads 3"):
        paged_decode_attention(q, k, v, tables, ctx, 0.1)
