"""The draft model's context, kept by every program (spec, "Speculative graph coverage").

A draft is a smaller decoder sharing the target's vocabulary, loaded like the
target (tensor-parallel over the same group) with a KV cache of its own over the
SAME page ids: the target's page tables address both caches, so the
coordinator's reservations cover the draft too.

Every program feeds the draft exactly the tokens it feeds the target (the same
packed ids, positions and metadata; only the logits are skipped), so a stretch
of width-one programs (prefill chunks, ordinary decode, mixed) leaves the
draft's context complete and the next speculative round proposes at once.  A
speculative round feeds the draft its pending token and then each of its D
proposals (D + 1 one-token steps; the last only writes KV), so whatever prefix
the target accepts already has draft KV, and the new pending token is fed by
the next program like any other.

Draft KV beyond the accepted prefix (rejected proposals) is overwritten by the
next program before any query can see it: every attention is bounded by the
lane's context, which ends at the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.ranks.arena import SlotArena
from runtime.ranks.model.attention import AttentionMetadata
from runtime.ranks.model.llama import LlamaForCausalLM


@dataclass
class Packed:
    """One packed forward's inputs: token ids, positions, metadata, the last
    token of each lane (where logits are read)."""

    input_ids: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    meta: AttentionMetadata
    last: torch.Tensor  # (L,)


def pack_lanes(
    arena: SlotArena,
    rows: torch.Tensor,
    first: torch.Tensor,
    lengths: torch.Tensor,
    tokens: int,
    width: int,
    page_size: int,
    max_query_len: int,
    ids: torch.Tensor | None = None,
    limit: torch.Tensor | None = None,
) -> Packed:
    """Lanes feeding ``lengths[i]`` tokens from position ``first[i]`` (both (L,)),
    packed in lane order into ``tokens`` rows, page tables ``width`` columns wide.

    ``ids``: (L, Q) the lanes' tokens (None: read from the slots' history).
    ``limit``: (L,) the positions a lane's pages hold; a lane that would pass
    it feeds nothing (None: no limit).  Padding rows and pages the slot does not hold
    (-1) write nothing.  Tensor ops only.
    """
    lanes = rows.shape[0]
    if limit is not None:  # a lane past its pages feeds nothing (its output is never used)
        lengths = torch.where(first + lengths <= limit, lengths, 0)
    ends = torch.cumsum(lengths, 0)  # (L,)
    start = ends - lengths  # (L,)
    n = torch.arange(tokens, device=rows.device)  # (N,)
    lane = torch.searchsorted(ends, n, right=True)  # (N,) L = padding
    valid = lane < lanes
    lane = lane.clamp(max=lanes - 1)
    offset = n - start.index_select(0, lane)  # (N,)
    positions = torch.where(valid, first.index_select(0, lane) + offset, 0)
    row = rows.index_select(0, lane)
    if ids is None:
        assert arena.history is not None
        h = arena.history_width
        flat = row * h + positions.clamp(max=h - 1)
        input_ids = torch.where(valid, arena.history.view(-1).index_select(0, flat), 0)
    else:
        q = ids.shape[1]
        flat = lane * q + offset.clamp(0, q - 1)
        input_ids = torch.where(valid, ids.reshape(-1).index_select(0, flat), 0).clamp(min=0)
    tables = arena.page_tables[:, :width].index_select(0, rows)  # (L, width)
    column = (positions // page_size).clamp(max=width - 1)
    page = tables.view(-1).index_select(0, lane * width + column)  # (N,)
    writes = valid & (page >= 0) & (positions < (width * page_size))
    slot_mapping = torch.where(writes, page * page_size + positions % page_size, -1)
    context = torch.where(lengths > 0, first + lengths, 0)
    meta = AttentionMetadata(
        query_start=start,
        query_lens=lengths,
        context_lens=context,
        page_tables=tables,
        slot_mapping=slot_mapping,
        max_query_len=max_query_len,
    )
    return Packed(input_ids, positions, meta, (ends - 1).clamp(0, tokens - 1))


class DraftContext:
    """The draft model beside the target: fed by every program."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._none = torch.zeros(
            0, dtype=torch.int64, device=model.model.embed_tokens.weight.device
        )

    def feed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Write the draft KV of the target's packed tokens (no logits)."""
        self.model(input_ids, positions, meta, self._none)

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One draft forward; the logits of every packed token (N, V) float32."""
        index = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.model(input_ids, positions, meta, index).float()
