"""Layers on their own: shard loaders (simulated ranks, no process group), RoPE
frequencies against transformers, the paged KV write and the paged attention
reference against dense per-lane attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from runtime.ranks.model.attention import (
    AttentionMetadata,
    compute_slot_mapping,
    paged_attention_reference,
)
from runtime.ranks.model.config import RopeScaling
from runtime.ranks.model.errors import LoadError
from runtime.ranks.model.kv_cache import PagedKVCache
from runtime.ranks.model.layers import rope_inv_freq
from runtime.ranks.model.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)


def _ranks(world_size: int) -> list[TPGroup]:
    return [TPGroup(rank, world_size) for rank in range(world_size)]


# -- shard loaders -------------------------------------------------------------------------


def test_column_and_row_shards_reassemble_the_full_layer() -> None:
    torch.manual_seed(0)
    w1, b1, w2 = torch.randn(8, 6), torch.randn(8), torch.randn(5, 8)
    x = torch.randn(3, 6)
    partials = []
    for group in _ranks(2):
        col = ColumnParallelLinear(6, 8, bias=True, group=group)
        col.weight_loader(col.weight, w1)
        col.weight_loader(col.bias, b1)
        row = RowParallelLinear(8, 5, bias=False, group=group)
        row.weight_loader(row.weight, w2)
        # Row-parallel math without the all-reduce: the partial sums add up.
        partials.append(F.linear(col(x), row.weight))  # (3, 5)
    torch.testing.assert_close(sum(partials), F.linear(F.linear(x, w1, b1), w2))


def test_merged_column_places_each_part() -> None:
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    for group in _ranks(2):
        layer = MergedColumnParallelLinear(4, [8, 8], bias=False, group=group)
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        r = group.rank
        expected = torch.cat([gate[4 * r : 4 * r + 4], up[4 * r : 4 * r + 4]])
        assert torch.equal(layer.weight, expected)


def test_qkv_shards_split_heads_and_replicate_kv_heads() -> None:
    head_dim, heads, kv_heads, hidden = 2, 8, 2, 4
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(kv_heads * head_dim, hidden)
    v = torch.randn(kv_heads * head_dim, hidden)
    for group in _ranks(4):  # 4 ranks, 2 KV heads: each KV head on two ranks
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=False, group=group)
        for shard_id, src in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, src, shard_id)
        r = group.rank
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        q_local, k_local, v_local = layer.weight.split([4, 2, 2])
        assert torch.equal(q_local, q[4 * r : 4 * r + 4])  # query heads 2r, 2r + 1
        kv_head = r // 2  # = (query head) // (heads / kv_heads)
        assert torch.equal(k_local, k[2 * kv_head : 2 * kv_head + 2])
        assert torch.equal(v_local, v[2 * kv_head : 2 * kv_head + 2])


def test_vocab_shards_pad_with_zero_rows_and_trim_logits() -> None:
    table = torch.randn(101, 4)
    shards = []
    for group in _ranks(2):
        emb = VocabParallelEmbedding(101, 4, group=group)
        emb.weight_loader(emb.weight, table)
        assert emb.weight.shape == (51, 4)
        shards.append(emb.weight)
    assert torch.equal(torch.cat(shards)[:101], table)
    assert torch.equal(shards[1][50], torch.zeros(4))  # padding row 101
    head = ParallelLMHead(101, 4, group=TPGroup.single())
    head.weight_loader(head.weight, table)
    hidden = torch.randn(3, 4)
    assert head(hidden).shape == (3, 101)


def test_loader_shape_errors_say_expected_and_got() -> None:
    layer = QKVParallelLinear(4, 2, 4, 2, bias=False, group=TPGroup.single())
    with pytest.raises(LoadError, match=r"has shape \[4, 4\], expected \[8, 4\]"):
        layer.weight_loader(layer.weight, torch.zeros(4, 4), "q")
    row = RowParallelLinear(8, 5, bias=False, group=TPGroup.single())
    with pytest.raises(LoadError, match=r"expected \[5, 8\]"):
        row.weight_loader(row.weight, torch.zeros(8, 5))


def test_tp_group_single_needs_no_process_group() -> None:
    group = TPGroup.single()
    x = torch.randn(2, 3)
    assert group.all_reduce(x) is x
    assert torch.equal(group.all_gather(x), x.unsqueeze(0))
    with pytest.raises(ValueError):
        TPGroup(rank=2, world_size=2)


# -- RoPE --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        RopeScaling("linear", 4.0),
        RopeScaling("llama3", 8.0, 1.0, 4.0, 32),
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_frequencies_match_transformers(scaling: RopeScaling | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params: dict = {"rope_type": "default", "rope_theta": 50000.0}
    if scaling is not None:
        params.update(scaling.to_hf())
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=params)
    ours = rope_inv_freq(64, 50000.0, scaling)
    if scaling is None:
        ref = 1.0 / (50000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling.rope_type](cfg, torch.device("cpu"))
    assert torch.equal(ours, ref)


# -- paged KV cache ----------------------------------------------------------------------------


def test_kv_write_skips_minus_one_slots() -> None:
    cache = PagedKVCache(num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=3)
    before_k, before_v = cache.key(1).clone(), cache.value(1).clone()
    k, v = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    cache.write(1, k, v, torch.tensor([13, -1, 2, -1]))
    key = cache.key(1).reshape(16, 2, 3)
    value = cache.value(1).reshape(16, 2, 3)
    assert torch.equal(key[13], k[0]) and torch.equal(key[2], k[2])
    assert torch.equal(value[13], v[0]) and torch.equal(value[2], v[2])
    changed = (cache.key(1) != before_k).any(-1).any(-1).nonzero().tolist()
    assert changed == [[0, 2], [3, 1]]  # (page, offset) of slots 2 and 13 only
    assert ((cache.value(1) != before_v).any(-1).any(-1).nonzero().tolist()) == changed
    assert torch.equal(cache.key(0), torch.zeros(4, 4, 2, 3))  # other layers untouched
    assert cache.key(1).shape == (4, 4, 2, 3)


def test_slot_mapping_follows_page_tables_and_skips_padding() -> None:
    tables = [[7, 2, 5], [], [4, 1]]
    meta, positions = AttentionMetadata.build(
        query_lens=[3, 0, 2],
        context_lens=[10, 0, 6],
        page_tables=tables,
        page_size=4,
        num_tokens=8,
        num_lanes=4,
        max_pages=4,
        max_query_len=4,
    )
    assert positions.tolist() == [7, 8, 9, 4, 5, 0, 0, 0]
    expected = [2 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1, 1 * 4 + 0, 1 * 4 + 1, -1, -1, -1]
    assert meta.slot_mapping.tolist() == expected
    assert meta.query_start.tolist() == [0, 3, 3, 5]
    again = compute_slot_mapping(
        positions, meta.query_start, meta.query_lens, meta.page_tables, 4, 4
    )
    assert torch.equal(again, meta.slot_mapping)


def test_paged_attention_matches_dense_per_lane_attention() -> None:
    torch.manual_seed(0)
    heads, kv_heads, d, page_size, num_pages = 4, 2, 8, 4, 32
    cache = PagedKVCache(
        num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=kv_heads, head_dim=d
    )
    # Lanes: (past tokens, new tokens); one inactive lane; padded tokens and pages.
    lanes = [(0, 9), (6, 1), (0, 0), (13, 3)]
    pages = torch.randperm(num_pages).tolist()
    tables, past_kv = [], []
    for past, new in lanes:
        n = -(-(past + new) // page_size)
        tables.append(pages[:n])
        pages = pages[n:]
        past_kv.append((torch.randn(past, kv_heads, d), torch.randn(past, kv_heads, d)))
    # Fill the past through the cache's own write path.
    for (past, _), table, (k, v) in zip(lanes, tables, past_kv):
        if past:
            meta, _ = AttentionMetadata.build(
                query_lens=[past], context_lens=[past], page_tables=[table], page_size=page_size
            )
            cache.write(0, k, v, meta.slot_mapping)
    meta, positions = AttentionMetadata.build(
        query_lens=[new for _, new in lanes],
        context_lens=[past + new for past, new in lanes],
        page_tables=tables,
        page_size=page_size,
        num_tokens=16,
        num_lanes=5,
        max_pages=5,
        max_query_len=9,
    )
    q = torch.randn(16, heads, d)
    k_new, v_new = torch.randn(16, kv_heads, d), torch.randn(16, kv_heads, d)
    cache.write(0, k_new, v_new, meta.slot_mapping)
    scale = 1 / math.sqrt(d)
    out = paged_attention_reference(q, cache.key(0), cache.value(0), positions, meta, scale)

    start = 0
    for (past, new), (k_past, v_past) in zip(lanes, past_kv):
        if new:
            k = torch.cat([k_past, k_new[start : start + new]])  # (ctx, KV, d)
            v = torch.cat([v_past, v_new[start : start + new]])
            k = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (H, ctx, d)
            v = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
            qs = q[start : start + new].transpose(0, 1)  # (H, new, d)
            causal = torch.ones(new, past + new, dtype=torch.bool).tril(past)  # (new, ctx)
            ref = F.scaled_dot_product_attention(qs, k, v, attn_mask=causal, scale=scale)
            torch.testing.assert_close(out[start : start + new], ref.transpose(0, 1))
        start += new
    assert torch.equal(out[start:], torch.zeros(16 - start, heads, d))  # padding rows
