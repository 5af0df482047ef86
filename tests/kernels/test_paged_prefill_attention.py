"""Paged prefill (varlen causal) attention kernel against its torch references.

The kernel runs under the Triton interpreter on CPU: conftest.py imports it with
TRITON_INTERPRET=1 before this module does. Shapes stay small (the interpreter
runs every program in Python).
"""

import pytest
import torch
import triton

from kernels.reference.paged_prefill_attention import paged_prefill_attention_reference
from kernels.triton.paged_prefill_attention import (
    default_prefill_blocks,
    paged_prefill_attention,
)
from runtime.ranks.model.attention import (
    AttentionMetadata,
    mixed_paged_attention,
    paged_attention_reference,
)


def _inputs(
    seed, heads, kv_heads, head_dim, lanes, *, page_size=4, dtype=torch.float32, pad=2, gap=1
):
    """Random packed q, shuffled pages and -1-padded tables for lanes [(query_len, context)].

    Active lanes' tokens are packed in order with ``gap`` padding rows after each
    (0: back to back, as the rank packs them), and ``pad`` padding rows at the
    end; inactive lanes (query_len 0) start where the next lane would. Returns
    q, k, v, tables, query_start, query_lens, context_lens.
    """
    gen = torch.Generator().manual_seed(seed)
    used = [-(-ctx // page_size) for _, ctx in lanes]
    num_pages = sum(used) + 2
    max_pages = max(used, default=0) + 1
    starts, start = [], 0
    for q_len, _ in lanes:
        starts.append(start)
        start += q_len + (gap if q_len else 0)
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


def _positions(query_start, query_lens, context_lens, num_tokens):
    """(N,) position of every token (0 on padding rows), as the runtime computes them."""
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    for start, n, ctx in zip(query_start.tolist(), query_lens.tolist(), context_lens.tolist()):
        positions[start : start + n] = torch.arange(ctx - n, ctx)
    return positions


def _metadata(tables, query_start, query_lens, context_lens, num_tokens, max_query_len):
    return AttentionMetadata(
        query_start=query_start,
        query_lens=query_lens,
        context_lens=context_lens,
        page_tables=tables.long(),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        max_query_len=max_query_len,
    )


# Lanes (query_len, context_len): a prompt from scratch, a single token, a chunk over
# a cached prefix that crosses page boundaries, an inactive lane with pages.
RAGGED = [(5, 5), (1, 1), (7, 13), (0, 6)]


@pytest.mark.parametrize(
    ("seed", "heads", "kv_heads", "head_dim", "page_size", "lanes", "block_q", "block_n"),
    [
        (0, 2, 2, 16, 4, RAGGED, None, None),  # GQA ratio 1, default blocks
        (1, 2, 2, 16, 4, RAGGED, 16, 16),  # ratio 1, one query block per lane
        (2, 4, 1, 32, 8, [(9, 20), (1, 9), (3, 3), (0, 0)], 4, 16),  # ratio 4, several blocks
        (3, 8, 1, 16, 4, [(6, 11), (1, 30), (2, 2)], 2, 32),  # ratio 8, tiles over pages
        (4, 6, 2, 24, 5, [(4, 9), (11, 11), (1, 2)], 8, 16),  # ratio 3, d 24, page 5
    ],
)
def test_kernel_matches_reference(
    seed, heads, kv_heads, head_dim, page_size, lanes, block_q, block_n
):
    q, k, v, tables, qs, ql, ctx = _inputs(
        seed, heads, kv_heads, head_dim, lanes, page_size=page_size
    )
    max_q = max(n for n, _ in lanes)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        q, k, v, tables, qs, ql, ctx, scale, max_q, block_q=block_q, block_n=block_n
    )
    ref = paged_prefill_attention_reference(q, k, v, tables, qs, ql, ctx, scale, max_q)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[_padding_rows(qs, ql, q.shape[0])] == 0)


def test_mixed_step_one_prompt_row_and_decode_rows():
    """One call with Q = C: a prompt chunk over a cached prefix, 1-token decode rows,
    inactive lanes and padding tokens; decode rows' later blocks exit. Also equals the
    runtime's two-pass mixed attention."""
    chunk = 12
    lanes = [(chunk, 19), (1, 5), (0, 0), (1, 17), (1, 1), (0, 3)]
    q, k, v, tables, qs, ql, ctx = _inputs(20, 8, 2, 16, lanes, page_size=4, pad=3)
    qkv = torch.cat([q, torch.randn(q.shape[0], 4, 16)], dim=1)  # (N, H + 2 KV, d)
    q = qkv[:, :8]  # a strided view, as split from a fused projection
    out = paged_prefill_attention(q, k, v, tables, qs, ql, ctx, 0.25, chunk, block_q=4)
    ref = paged_prefill_attention_reference(q, k, v, tables, qs, ql, ctx, 0.25, chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[_padding_rows(qs, ql, q.shape[0])] == 0)

    num_tokens = q.shape[0]
    metadata = _metadata(tables, qs, ql, ctx, num_tokens, chunk)
    metadata.prefill_row = torch.tensor([0])
    metadata.row_query_len = 1
    positions = _positions(qs, ql, ctx, num_tokens)
    expected = mixed_paged_attention(q, k, v, positions, metadata, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# A packed prefill program's rows (issue 26): prompt rows back to back at the
# prefix sums of their query lengths, over cached prefixes that end inside a
# page, one-token rows, the token capacity C = 64 as every row's bound, the
# unused rows of B = 8 inactive and the unused token rows at the end.
PACKED = [(17, 17), (9, 30), (1, 1), (20, 45), (1, 12), (0, 0), (0, 0), (0, 0)]


@pytest.mark.parametrize(("heads", "kv_heads", "block_q"), [(4, 2, None), (8, 2, 4), (4, 4, 16)])
def test_packed_prefill_rows_sharing_the_token_capacity(heads, kv_heads, block_q):
    capacity = 64
    used = sum(n for n, _ in PACKED)
    q, k, v, tables, qs, ql, ctx = _inputs(
        14, heads, kv_heads, 16, PACKED, page_size=8, pad=capacity - used, gap=0
    )
    assert q.shape[0] == capacity and qs.tolist()[:6] == [0, 17, 26, 27, 47, 48]
    out = paged_prefill_attention(q, k, v, tables, qs, ql, ctx, 0.25, capacity, block_q=block_q)
    ref = paged_prefill_attention_reference(q, k, v, tables, qs, ql, ctx, 0.25, capacity)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[used:] == 0) and bool(out[:used].abs().sum(-1).gt(0).all())
    # Each row is its own attention: the same row alone gives the same rows.
    for lane, (n, _) in enumerate(PACKED[:5]):
        start = qs[lane].item()
        alone = paged_prefill_attention(
            q[start : start + n].contiguous(), k, v, tables[lane : lane + 1], qs[:1] * 0,
            ql[lane : lane + 1], ctx[lane : lane + 1], 0.25, capacity, block_q=block_q,
        )  # fmt: skip
        torch.testing.assert_close(out[start : start + n], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_fp32(dtype):
    lanes = [(6, 14), (1, 3), (0, 0)]
    q, k, v, tables, qs, ql, ctx = _inputs(5, 8, 2, 32, lanes, page_size=4, dtype=dtype)
    out = paged_prefill_attention(q, k, v, tables, qs, ql, ctx, 0.125, 6)
    ref = paged_prefill_attention_reference(q, k, v, tables, qs, ql, ctx, 0.125, 6)
    assert out.dtype == dtype and ref.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


def test_nothing_past_the_context_or_outside_the_lanes_is_read():
    """Padding table columns point at a NaN page, slots past each context hold NaN,
    and padding query rows hold NaN: outputs stay finite, padding rows zero."""
    lanes = [(3, 6), (1, 1), (10, 13), (0, 0)]
    q, k, v, tables, qs, ql, ctx = _inputs(12, 4, 2, 16, lanes, page_size=4)
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
    out = paged_prefill_attention(q, k, v, tables, qs, ql, ctx, 0.25, 10, block_q=8)
    ref = paged_prefill_attention_reference(q, k, v, tables, qs, ql, ctx, 0.25, 10)
    assert torch.isfinite(out).all() and torch.all(out[padding] == 0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_int32_lengths_int64_tables_and_empty_steps():
    lanes = [(2, 7), (1, 4)]
    q, k, v, tables, qs, ql, ctx = _inputs(6, 4, 4, 16, lanes)
    out = paged_prefill_attention(q, k, v, tables.long(), qs.int(), ql.int(), ctx.int(), 0.3, 2)
    ref = paged_prefill_attention_reference(q, k, v, tables, qs, ql, ctx, 0.3, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # All lanes inactive, or Q = 0: zeros.
    zero = torch.zeros_like(ql)
    assert torch.all(paged_prefill_attention(q, k, v, tables, qs, zero, ctx, 0.3, 2) == 0)
    assert torch.all(paged_prefill_attention(q, k, v, tables, qs, ql, ctx, 0.3, 0) == 0)


@pytest.mark.parametrize(("seed", "heads", "kv_heads"), [(8, 4, 4), (9, 8, 2), (10, 8, 1)])
def test_reference_matches_runtime_paged_attention(seed, heads, kv_heads):
    """The length-following reference equals the fixed-width runtime one on a batch
    packed by AttentionMetadata.build (padding tokens, inactive lanes, ragged pages)."""
    gen = torch.Generator().manual_seed(seed)
    page_size, head_dim = 4, 16
    query_lens = [9, 1, 4, 1]
    context_lens = [9, 6, 15, 1]
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
        max_query_len=12,
    )
    num_pages = len(perm)
    q = torch.randn(metadata.num_tokens, heads, head_dim, generator=gen)
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    expected = paged_attention_reference(q, k, v, positions, metadata, 0.2)
    ref = paged_prefill_attention_reference(
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
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 16, 32, 64])
def test_default_blocks_fit_a_gpu_dot(group):
    """The interpreter runs any tl.dot; the GPU needs every dimension >= 16."""
    for max_q in (1, 3, 64, 2048):
        for head_dim in (64, 128, 256):
            for dtype in (torch.float32, torch.bfloat16):
                block_q, block_n = default_prefill_blocks(group, max_q, head_dim, dtype)
                group_p = triton.next_power_of_2(group)
                assert block_q * group_p >= 16 and block_n >= 16
                assert block_q & (block_q - 1) == 0 and block_n & (block_n - 1) == 0
                assert block_q <= max(triton.next_power_of_2(max_q), 16 // group_p)


def _good():
    return _inputs(11, 4, 2, 16, [(3, 5), (1, 2)])


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
        ("page_tables", lambda a: {**a, "page_tables": a["page_tables"].float()}),
        ("page_tables", lambda a: {**a, "page_tables": a["page_tables"][0]}),
        ("query_start", lambda a: {**a, "query_start": a["query_start"][:1]}),
        ("query_start", lambda a: {**a, "query_start": a["query_start"].float()}),
        ("query_lens", lambda a: {**a, "query_lens": a["query_lens"][:, None]}),
        ("query_lens", lambda a: {**a, "query_lens": a["query_lens"].bool()}),
        ("context_lens", lambda a: {**a, "context_lens": a["context_lens"][:1]}),
        ("context_lens", lambda a: {**a, "context_lens": a["context_lens"].double()}),
        ("max_query_len", lambda a: {**a, "max_query_len": -1}),
        ("max_query_len", lambda a: {**a, "max_query_len": 3.0}),
        ("block_q", lambda a: {**a, "block_q": 3}),
        ("block_q", lambda a: {**a, "block_q": 4}),  # 4 x group 2 is under 16 rows
        ("block_n", lambda a: {**a, "block_n": 8}),
    ],
)
def test_launcher_names_bad_argument(name, bad):
    args = bad(_args(*_good()))
    with pytest.raises(ValueError, match=rf"^{name}:"):
        paged_prefill_attention(**args, scale=0.1)


def test_launcher_refuses_gqa_mismatch():
    q, k, v, tables, qs, ql, ctx = _inputs(13, 4, 3, 16, [(2, 3)])
    with pytest.raises(ValueError, match=r"^k_pages:.*kv_heads 3"):
        paged_prefill_attention(q, k, v, tables, qs, ql, ctx, 0.1, 2)
