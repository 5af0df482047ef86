"""Paged attention over a flat packed batch: metadata, torch reference, layer.

A forward step packs the new tokens of several lanes (requests) into one flat
token dimension N. Lane ``i`` owns tokens ``[query_start[i], query_start[i] +
query_lens[i])``; its context after the step is ``context_lens[i]`` tokens whose
K/V live in pages ``page_tables[i, :]``. Every tensor has a fixed shape (N tokens,
L lanes, P pages per lane, Q = ``max_query_len`` tokens per lane at most), so the
caller may pad: tokens outside every lane and lanes with ``query_lens == 0`` are
inert (slot -1: they write nothing; their outputs are zero or ignored).

All index arithmetic is done with tensor ops (no ``.item()``, no data-dependent
shapes), so a step can be captured in a CUDA graph and replayed with new values.

Mixed prefill/decode steps (``prefill_row`` set) have one prompt row of up to
``max_query_len`` = C new tokens and other rows of up to ``row_query_len`` = W
each.  Their attention runs in two passes that write disjoint token rows and
are added (:func:`mixed_paged_attention`): the prompt row alone with Q = C,
then every row with Q = W, the prompt row's query length masked to 0.  So no
(L, C) query block is gathered for the decode rows.

On CUDA :class:`PagedAttention` picks its kernel by :func:`attention_kernel`:
decode (Q = 1), verify (an unmixed step of 1 < Q <= 16: speculative
verification's pending token plus proposals per lane) or prefill (the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.reference.paged_decode_attention import decode_plan, paged_decode_attention_reference
from kernels.reference.paged_prefill_attention import (
    paged_prefill_attention_reference,
    prefill_plan,
)
from runtime.ranks.model.kv_cache import PagedKVCache

__all__ = [
    "AttentionMetadata",
    "PagedAttention",
    "attention_kernel",
    "compute_slot_mapping",
    "lane_token_index",
    "mixed_paged_attention",
    "packed_query_start",
    "paged_attention_reference",
    "split_prompt_row",
]


@dataclass
class AttentionMetadata:
    """Per-lane description of a packed batch; tensors on the model's device.

    Lanes' token ranges must not overlap. ``page_tables`` padding may be any value
    (e.g. -1): entries past a lane's context are never read.
    """

    query_start: Tensor  # (L,) int64: flat index of the lane's first new token
    query_lens: Tensor  # (L,) int64: new tokens this step; 0 = inactive lane
    context_lens: Tensor  # (L,) int64: context length after this step (past + new)
    page_tables: Tensor  # (L, P) int64: the lane's pages in order
    slot_mapping: Tensor  # (N,) int64: page * page_size + offset per token; -1 = no write
    max_query_len: int  # static: bound on query_lens (a program constant, not data)
    # Mixed steps only: (1,) int64, the prompt row's index in the lane list (-1: none).
    # None: an ordinary step, every lane bounded by max_query_len.
    prefill_row: Tensor | None = None
    row_query_len: int = 0  # static, mixed steps: bound on every other row's query_len (W)
    # CPU: what the torch references read from the lengths (kernels/reference/),
    # built by the first layer of a step and shared by the others; never copied.
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def mixed(self) -> bool:
        return self.prefill_row is not None

    @property
    def num_lanes(self) -> int:
        return self.page_tables.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def to(self, device: torch.device | str) -> AttentionMetadata:
        return AttentionMetadata(
            query_start=self.query_start.to(device),
            query_lens=self.query_lens.to(device),
            context_lens=self.context_lens.to(device),
            page_tables=self.page_tables.to(device),
            slot_mapping=self.slot_mapping.to(device),
            max_query_len=self.max_query_len,
            prefill_row=None if self.prefill_row is None else self.prefill_row.to(device),
            row_query_len=self.row_query_len,
        )

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        page_size: int,
        num_tokens: int | None = None,
        num_lanes: int | None = None,
        max_pages: int | None = None,
        max_query_len: int | None = None,
        device: torch.device | str = "cpu",
    ) -> tuple[AttentionMetadata, Tensor]:
        """Host-side packing of lanes in order (lane i's tokens follow lane i-1's).

        Returns (metadata, positions (num_tokens,)); lanes past ``len(query_lens)``
        are inactive and tokens past the lanes' total are padding (position 0,
        slot -1). Sizes default to the tight ones.
        """
        lanes = len(query_lens)
        if not lanes == len(context_lens) == len(page_tables):
            raise ValueError("query_lens, context_lens and page_tables differ in length")
        total = sum(query_lens)
        num_tokens = total if num_tokens is None else num_tokens
        num_lanes = lanes if num_lanes is None else num_lanes
        needed_pages = max((len(t) for t in page_tables), default=0)
        max_pages = max(1, needed_pages) if max_pages is None else max_pages
        max_query_len = max([1, *query_lens]) if max_query_len is None else max_query_len
        if total > num_tokens or lanes > num_lanes or needed_pages > max_pages:
            raise ValueError(
                f"batch ({total} tokens, {lanes} lanes, {needed_pages} pages) exceeds "
                f"its padding ({num_tokens}, {num_lanes}, {max_pages})"
            )
        if max(query_lens, default=0) > max_query_len:
            raise ValueError(f"a lane has more than max_query_len={max_query_len} tokens")

        q_lens = torch.zeros(num_lanes, dtype=torch.int64)  # (L,)
        ctx_lens = torch.zeros(num_lanes, dtype=torch.int64)  # (L,)
        tables = torch.full((num_lanes, max_pages), -1, dtype=torch.int64)  # (L, P)
        positions = torch.zeros(num_tokens, dtype=torch.int64)  # (N,)
        starts = torch.zeros(num_lanes, dtype=torch.int64)  # (L,)
        start = 0
        for i, (q, ctx, table) in enumerate(zip(query_lens, context_lens, page_tables)):
            if q > ctx:
                raise ValueError(f"lane {i}: query_len {q} exceeds context_len {ctx}")
            if ctx > len(table) * page_size:
                raise ValueError(f"lane {i}: context_len {ctx} exceeds its {len(table)} pages")
            q_lens[i], ctx_lens[i], starts[i] = q, ctx, start
            tables[i, : len(table)] = torch.as_tensor(list(table), dtype=torch.int64)
            positions[start : start + q] = torch.arange(ctx - q, ctx)
            start += q
        starts[lanes:] = start
        slots = compute_slot_mapping(positions, starts, q_lens, tables, page_size, max_query_len)
        meta = cls(starts, q_lens, ctx_lens, tables, slots, max_query_len)
        return meta.to(device), positions.to(device)


def packed_query_start(query_lens: Tensor) -> Tensor:
    """(L,) flat index of each lane's first new token: the exclusive prefix sum of
    ``query_lens`` (L,) in lane order (inactive lanes, length 0, start where the
    next lane would).  Tensor ops only, so a program derives its offsets from the
    one query-length upload, inside a captured graph."""
    return torch.cumsum(query_lens, 0) - query_lens  # (L,)


def lane_token_index(
    query_start: Tensor, query_lens: Tensor, max_query_len: int, num_tokens: int
) -> tuple[Tensor, Tensor]:
    """(index (L, Q), valid (L, Q)): flat token index of each lane's q-th new token;
    invalid entries point at ``num_tokens`` (one past the end: a pad row)."""
    offsets = torch.arange(max_query_len, device=query_lens.device)  # (Q,)
    valid = offsets < query_lens.unsqueeze(1)  # (L, Q)
    index = torch.where(valid, query_start.unsqueeze(1) + offsets, num_tokens)  # (L, Q)
    return index, valid


def compute_slot_mapping(
    positions: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    page_tables: Tensor,
    page_size: int,
    max_query_len: int,
) -> Tensor:
    """Cache slot (N,) of each token: ``page_tables[lane, pos // page_size] *
    page_size + pos % page_size``; -1 for tokens outside every active lane.
    Tensor ops only, so it can run on device inside a captured program."""
    num_tokens = positions.shape[0]
    index, valid = lane_token_index(query_start, query_lens, max_query_len, num_tokens)
    pos = torch.cat([positions, positions.new_zeros(1)])[index]  # (L, Q)
    page_col = (pos // page_size).clamp(max=page_tables.shape[1] - 1)  # (L, Q)
    page = page_tables.long().gather(1, page_col)  # (L, Q)
    slots = torch.where(valid, page * page_size + pos % page_size, -1)  # (L, Q)
    out = torch.full((num_tokens + 1,), -1, dtype=torch.int64, device=positions.device)
    out.index_copy_(0, index.flatten(), slots.flatten())  # pad row num_tokens absorbs invalid
    return out[:num_tokens]  # (N,)


def paged_attention_reference(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    positions: Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> Tensor:
    """Causal attention of each lane's new queries over its whole paged context.

    q (N, heads, d); k_pages, v_pages (num_pages, page_size, kv_heads, d) already
    holding this step's K/V; positions (N,). Query at position p of lane i sees keys
    at positions ``j <= p`` with ``j < context_lens[i]``. Grouped-query attention:
    query head h uses KV head ``h // (heads / kv_heads)``. Returns (N, heads, d);
    rows of padding tokens are zero. Masked keys still enter the matmul with zero
    weight, so pages must hold finite values (the cache starts zeroed).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_lanes, max_pages = metadata.page_tables.shape
    max_q = metadata.max_query_len
    group = num_heads // num_kv_heads
    ctx = max_pages * page_size  # C: context capacity of a lane

    # Gather each lane's queries into (L, Q) rows; row N of the padded q is zeros.
    index, valid = lane_token_index(
        metadata.query_start, metadata.query_lens, max_q, num_tokens
    )  # (L, Q)
    lane_q = torch.cat([q, q.new_zeros(1, num_heads, head_dim)])[index]  # (L, Q, H, d)
    lane_pos = torch.cat([positions, positions.new_zeros(1)])[index]  # (L, Q)

    # Gather each lane's context from its pages.
    pages = metadata.page_tables.long().clamp(0, num_pages - 1)  # (L, P)
    k = k_pages[pages].reshape(num_lanes, ctx, num_kv_heads, head_dim)  # (L, C, KV, d)
    v = v_pages[pages].reshape(num_lanes, ctx, num_kv_heads, head_dim)  # (L, C, KV, d)

    # Causal mask with the lane's offset: key j visible to a query at position p
    # iff j <= p and j < context length. Padded query rows see every key (finite
    # softmax); their outputs are dropped below.
    key_pos = torch.arange(ctx, device=q.device)  # (C,)
    visible = (key_pos <= lane_pos.unsqueeze(-1)) & (
        key_pos < metadata.context_lens.view(-1, 1, 1)
    )  # (L, Q, C)
    visible = visible | ~valid.unsqueeze(-1)  # (L, Q, C)

    # GQA without repeating K/V: the G query heads of a KV head become G*Q rows.
    lane_q = lane_q.view(num_lanes, max_q, num_kv_heads, group, head_dim)  # (L, Q, KV, G, d)
    lane_q = lane_q.permute(0, 2, 3, 1, 4).reshape(num_lanes, num_kv_heads, group * max_q, -1)
    mask = visible.unsqueeze(1).expand(num_lanes, group, max_q, ctx)  # (L, G, Q, C)
    mask = mask.reshape(num_lanes, 1, group * max_q, ctx)  # (L, 1, G*Q, C)
    out = F.scaled_dot_product_attention(
        lane_q,  # (L, KV, G*Q, d)
        k.transpose(1, 2),  # (L, KV, C, d)
        v.transpose(1, 2),  # (L, KV, C, d)
        attn_mask=mask,
        scale=scale,
    )  # (L, KV, G*Q, d)
    out = out.view(num_lanes, num_kv_heads, group, max_q, head_dim)  # (L, KV, G, Q, d)
    out = out.permute(0, 3, 1, 2, 4).reshape(num_lanes * max_q, num_heads, head_dim)

    # Scatter back to the flat token order; invalid rows land in the pad row.
    flat = q.new_zeros(num_tokens + 1, num_heads, head_dim)  # (N + 1, H, d)
    flat.index_copy_(0, index.flatten(), out)
    return flat[:num_tokens]  # (N, H, d)


def split_prompt_row(metadata: AttentionMetadata) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A mixed step's two attention passes, as ordinary metadata.

    (prompt pass: the ``prefill_row`` lane alone, one lane with Q =
    ``max_query_len``, query length 0 when there is no prompt row; row pass:
    every lane with Q = ``row_query_len``, the prompt row's query length 0).
    Each token row belongs to exactly one pass.  Tensor ops only (no
    ``.item()``), fixed shapes whatever ``prefill_row`` holds.
    """
    if metadata.prefill_row is None:
        raise ValueError("split_prompt_row needs a mixed step (prefill_row set)")
    row = metadata.prefill_row.long()  # (1,)
    index = row.clamp(min=0)  # (1,) a valid lane even when there is no prompt row
    prompt = AttentionMetadata(
        query_start=metadata.query_start.index_select(0, index),  # (1,)
        query_lens=torch.where(row >= 0, metadata.query_lens.index_select(0, index), 0),  # (1,)
        context_lens=metadata.context_lens.index_select(0, index),  # (1,)
        page_tables=metadata.page_tables.index_select(0, index),  # (1, P)
        slot_mapping=metadata.slot_mapping,
        max_query_len=metadata.max_query_len,
    )
    lanes = torch.arange(metadata.num_lanes, device=row.device)  # (L,)
    rows = AttentionMetadata(
        query_start=metadata.query_start,
        query_lens=torch.where(lanes == row, 0, metadata.query_lens),  # (L,)
        context_lens=metadata.context_lens,
        page_tables=metadata.page_tables,
        slot_mapping=metadata.slot_mapping,
        max_query_len=metadata.row_query_len,
    )
    return prompt, rows


def mixed_paged_attention(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    positions: Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> Tensor:
    """:func:`paged_attention_reference` for a mixed step, in two passes.

    The prompt row attends causally over its cached prefix and its new chunk
    (Q = C); the other rows over their own pages (Q = W).  Each pass leaves
    zeros in the other's token rows, so the sum is each row's own result.
    Returns (N, H, d).
    """
    prompt, rows = split_prompt_row(metadata)
    out = paged_attention_reference(q, k_pages, v_pages, positions, prompt, scale)  # (N, H, d)
    return out + paged_attention_reference(q, k_pages, v_pages, positions, rows, scale)


VERIFY_MAX_QUERY_LEN = 16  # kernels/triton/paged_verify_attention.py's MAX_QUERY_LEN


def attention_kernel(metadata: AttentionMetadata, num_tokens: int) -> str:
    """Which attention kernel a step runs on CUDA (static facts only, so a captured
    program keeps its choice): ``"decode"`` when every lane has at most one token at
    its own row (Q = 1, token i is lane i); ``"verify"`` for an unmixed step with
    1 < Q <= 16 (speculative verification: each lane's pending token and its
    proposals); else ``"prefill"`` (prompts and mixed steps)."""
    max_q = metadata.max_query_len
    if not metadata.mixed and max_q == 1 and num_tokens == metadata.num_lanes:
        return "decode"
    if not metadata.mixed and 1 < max_q <= VERIFY_MAX_QUERY_LEN:
        return "verify"
    return "prefill"


class PagedAttention(nn.Module):
    """One layer's attention core: store this step's K/V, attend over the pages."""

    def __init__(
        self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads do not group over {num_kv_heads} KV heads")
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> Tensor:
        """q (N, H, d), k and v (N, KV, d) for the new tokens -> (N, H, d).

        CUDA: the Triton kernels (kernels/triton/): the KV write, then, by
        :func:`attention_kernel`, decode attention (flash-decoding) when every
        lane has one token at its own row; verify attention (flash-decoding
        over W queries per lane) for an unmixed step of 1 < max_query_len <=
        16 (speculative verification, short chunks); else varlen prefill
        attention (prefill and mixed steps).  CPU: their torch references
        (kernels/reference/), whose work follows each lane's actual context;
        the verify and prefill references are one, and the plan they read from
        the lengths is built once per step (:attr:`AttentionMetadata.plans`).
        ``positions`` are implied by the lengths.
        """
        del positions
        kv_cache.write(self.layer_index, k, v, metadata.slot_mapping)
        k_pages = kv_cache.key(self.layer_index)
        v_pages = kv_cache.value(self.layer_index)
        kind = attention_kernel(metadata, q.shape[0])
        if not q.is_cuda:
            return self._reference(q, k_pages, v_pages, metadata, kind)
        from kernels.triton.paged_decode_attention import paged_decode_attention
        from kernels.triton.paged_prefill_attention import paged_prefill_attention
        from kernels.triton.paged_verify_attention import paged_verify_attention

        decode_attention, prefill_attention = paged_decode_attention, paged_prefill_attention
        if kind == "verify":
            prefill_attention = paged_verify_attention
        if kind == "decode":
            return decode_attention(
                q, k_pages, v_pages, metadata.page_tables, metadata.context_lens, self.scale
            )
        return prefill_attention(
            q,
            k_pages,
            v_pages,
            metadata.page_tables,
            metadata.query_start,
            metadata.query_lens,
            metadata.context_lens,
            self.scale,
            metadata.max_query_len,
        )

    def _reference(
        self, q: Tensor, k_pages: Tensor, v_pages: Tensor, metadata: AttentionMetadata, kind: str
    ) -> Tensor:
        """The torch references (the CPU path), over the plan the step's first
        layer built from the lengths (one host read per step, not per layer)."""
        page_size, plans = k_pages.shape[1], metadata.plans
        key = (kind, page_size, self.num_heads // self.num_kv_heads)
        plan = plans.get(key)
        if kind == "decode":
            if plan is None:
                plan = plans[key] = decode_plan(
                    metadata.page_tables, metadata.context_lens, page_size
                )
            return paged_decode_attention_reference(
                q, k_pages, v_pages, metadata.page_tables, metadata.context_lens, self.scale, plan
            )
        if plan is None:
            plan = plans[key] = prefill_plan(
                metadata.page_tables,
                metadata.query_start,
                metadata.query_lens,
                metadata.context_lens,
                page_size,
                key[2],
            )
        return paged_prefill_attention_reference(
            q,
            k_pages,
            v_pages,
            metadata.page_tables,
            metadata.query_start,
            metadata.query_lens,
            metadata.context_lens,
            self.scale,
            metadata.max_query_len,
            plan,
        )
