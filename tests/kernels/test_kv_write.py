"""KV write kernel against kv_write_reference, the runtime's reference store.

The kernel runs under the Triton interpreter on CPU: conftest.py imports it with
TRITON_INTERPRET=1 before this module does.
"""

import pytest
import torch

from kernels.reference.kv_write import kv_write_reference
from kernels.triton.kv_write import kv_write
from kernels.triton.paged_prefill_attention import paged_prefill_attention
from runtime.ranks.model.attention import AttentionMetadata, paged_attention_reference


def _inputs(seed, tokens, kv_heads, head_dim, num_slots, skip, dtype=torch.float32):
    """Random k, v (N, KV, d) and distinct slots in [0, num_slots), -1 at ``skip``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    slots[list(skip)] = -1
    return k, v, slots


def _caches(seed, num_slots, kv_heads, head_dim, dtype):
    """Random (slots + 1, KV, d) K and V storage, so untouched rows are visible."""
    gen = torch.Generator().manual_seed(seed)
    k_slots = torch.randn(num_slots + 1, kv_heads, head_dim, generator=gen).to(dtype)
    v_slots = torch.randn(num_slots + 1, kv_heads, head_dim, generator=gen).to(dtype)
    return k_slots, v_slots


@pytest.mark.parametrize(
    ("seed", "kv_heads", "head_dim", "slot_dtype", "skip"),
    [
        (0, 2, 16, torch.int64, [1, 4]),  # padding tokens in the middle
        (1, 1, 32, torch.int32, []),  # every token written
        (2, 3, 24, torch.int64, [0, 1, 2, 3, 4, 5]),  # nothing written
    ],
)
def test_kernel_matches_kv_write_reference(seed, kv_heads, head_dim, slot_dtype, skip):
    k, v, slots = _inputs(seed, 6, kv_heads, head_dim, 20, skip)
    k_slots, v_slots = _caches(seed, 20, kv_heads, head_dim, torch.float32)
    k_ref, v_ref = k_slots.clone(), v_slots.clone()
    scratch = k_slots[-1].clone(), v_slots[-1].clone()
    kv_write(k_slots, v_slots, k, v, slots.to(slot_dtype))
    kv_write_reference(k_ref, v_ref, k, v, slots)
    assert torch.equal(k_slots[:-1], k_ref[:-1]) and torch.equal(v_slots[:-1], v_ref[:-1])
    # -1 writes nothing at all: the scratch row is left as it was.
    assert torch.equal(k_slots[-1], scratch[0]) and torch.equal(v_slots[-1], scratch[1])


@pytest.mark.parametrize(
    ("src", "cache", "exact"),
    [
        (torch.float32, torch.float16, True),
        (torch.float16, torch.float32, True),
        # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest, as torch).
        (torch.float32, torch.bfloat16, False),
    ],
)
def test_cast_to_the_cache_dtype(src, cache, exact):
    k, v, slots = _inputs(3, 5, 2, 16, 12, [2], dtype=src)
    k_slots, v_slots = _caches(3, 12, 2, 16, cache)
    k_ref, v_ref = k_slots.clone(), v_slots.clone()
    kv_write(k_slots, v_slots, k, v, slots)
    kv_write_reference(k_ref, v_ref, k, v, slots)
    tol = {"atol": 0, "rtol": 0} if exact else {"atol": 1e-6, "rtol": 2**-7}
    torch.testing.assert_close(k_slots[:-1], k_ref[:-1], **tol)
    torch.testing.assert_close(v_slots[:-1], v_ref[:-1], **tol)


def test_strided_inputs_and_caches():
    """k and v split from a fused projection; caches as one layer of the runtime's
    (layers, 2, slots + 1, KV, d) storage. The scratch row's own index (30) writes
    nothing either."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(7, 4 + 2 + 2, 16, generator=gen)  # (N, H + 2 KV, d)
    k = qkv[:, 4:6]  # (N, KV, d) view
    v = torch.randn(7, 2, 32, generator=gen)[..., :16]  # (N, KV, d), head stride 32
    storage = torch.zeros(2, 2, 30 + 1, 2, 16)  # (layers, 2, slots + 1, KV, d)
    ref = storage.clone()
    slots = torch.tensor([3, -1, 29, 0, 17, 30, 8])
    kv_write(storage[1, 0], storage[1, 1], k, v, slots)
    kv_write_reference(ref[1, 0], ref[1, 1], k, v, slots)
    assert torch.equal(storage[:, :, :-1], ref[:, :, :-1])
    assert torch.all(storage[:, :, -1] == 0)


def test_a_step_writes_then_attends():
    """kv_write at the metadata's slot_mapping, then paged_prefill_attention over the
    pages, equals kv_write_reference then the runtime's paged_attention_reference."""
    gen = torch.Generator().manual_seed(5)
    page_size, kv_heads, heads, head_dim, num_pages = 4, 2, 4, 16, 12
    metadata, positions = AttentionMetadata.build(
        query_lens=[6, 1, 3],
        context_lens=[9, 5, 3],
        page_tables=[[7, 2, 9], [0, 11], [4]],
        page_size=page_size,
        num_tokens=12,
        num_lanes=4,
        max_pages=4,
    )
    num_slots = num_pages * page_size
    # Earlier steps' K/V (the cached prefixes) already in the cache.
    k_slots = torch.randn(num_slots + 1, kv_heads, head_dim, generator=gen)
    v_slots = torch.randn(num_slots + 1, kv_heads, head_dim, generator=gen)
    k_ref, v_ref = k_slots.clone(), v_slots.clone()
    q = torch.randn(metadata.num_tokens, heads, head_dim, generator=gen)
    k = torch.randn(metadata.num_tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(metadata.num_tokens, kv_heads, head_dim, generator=gen)

    kv_write(k_slots, v_slots, k, v, metadata.slot_mapping)
    shape = (num_pages, page_size, kv_heads, head_dim)
    out = paged_prefill_attention(
        q,
        k_slots[:-1].view(shape),
        v_slots[:-1].view(shape),
        metadata.page_tables,
        metadata.query_start,
        metadata.query_lens,
        metadata.context_lens,
        0.25,
        metadata.max_query_len,
    )
    kv_write_reference(k_ref, v_ref, k, v, metadata.slot_mapping)
    expected = paged_attention_reference(
        q, k_ref[:-1].view(shape), v_ref[:-1].view(shape), positions, metadata, 0.25
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _good():
    k, v, slots = _inputs(6, 4, 2, 16, 10, [1])
    k_slots, v_slots = _caches(6, 10, 2, 16, torch.float32)
    return {"k_slots": k_slots, "v_slots": v_slots, "k": k, "v": v, "slot_mapping": slots}


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("k", lambda a: {**a, "k": a["k"][0]}),
        ("k", lambda a: {**a, "k": a["k"].long()}),
        ("k", lambda a: {**a, "k": a["k"].transpose(1, 2).contiguous().transpose(1, 2)}),
        ("v", lambda a: {**a, "v": a["v"][:, :1]}),
        ("v", lambda a: {**a, "v": a["v"][:3]}),
        ("v", lambda a: {**a, "v": a["v"].int()}),
        ("k_slots", lambda a: {**a, "k_slots": a["k_slots"][..., :8]}),
        ("k_slots", lambda a: {**a, "k_slots": a["k_slots"][:0]}),
        ("k_slots", lambda a: {**a, "k_slots": a["k_slots"].double()}),
        ("v_slots", lambda a: {**a, "v_slots": a["v_slots"][:5]}),
        (
            "v_slots",
            lambda a: {**a, "v_slots": a["v_slots"][:, :, None, 0].expand(-1, -1, 16)},
        ),
        ("slot_mapping", lambda a: {**a, "slot_mapping": a["slot_mapping"][:2]}),
        ("slot_mapping", lambda a: {**a, "slot_mapping": a["slot_mapping"].float()}),
        ("slot_mapping", lambda a: {**a, "slot_mapping": a["slot_mapping"][:, None]}),
    ],
)
def test_launcher_names_bad_argument(name, bad):
    args = bad(_good())
    with pytest.raises(ValueError, match=rf"^{name}:"):
        kv_write(**args)
