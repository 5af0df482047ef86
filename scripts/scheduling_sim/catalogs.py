"""Synthetic measured catalogs: per-kind cost curves for prepared graphs.

The curves are estimates for a dense decoder on one H100 SXM (bf16, CUDA
graphs), not measurements of this project.  A graph's cost depends on its
physical shape only, never on how many rows are active: padding costs the same
as useful work.  Two families are offered, under the same constants:

Roofline (``llama1b-h100``, ``llama8b-h100``; :class:`RooflineProfile`)
    A step is bound by either memory traffic or arithmetic, whichever is
    slower, plus a fixed overhead::

        cost = overhead + max(memory_ms, compute_ms) [+ draft passes]

    so a few prompt tokens riding on a memory-bound decode batch are nearly
    free.  See :class:`RooflineProfile` for the terms and the arithmetic.

Additive (``llama1b-h100-additive``, ``llama8b-h100-additive``; :class:`AdditiveProfile`)
    The earlier curve, kept with unchanged numbers for comparison: compute
    time is added on top of the weight-streaming floor.

Constants (H100 SXM, bf16):

* ``HBM_BYTES_PER_MS``: 3.35 TB/s of HBM3 bandwidth, the data-sheet figure.
* ``ACHIEVED_FLOP_PER_MS``: about 550 TFLOP/s achieved in dense bf16 GEMMs,
  roughly 56 % of the 989 TFLOP/s dense peak, what large prefill GEMMs reach.
* ``LAUNCH_OVERHEAD_MS``: 0.8 ms per frame for graph replay, sampling and the
  host synchronization around it (the same figure in both families, so they
  agree on the cost of an empty-ish decode step).
* The ridge point: a frame is compute-bound once it packs more than
  ``550e12 * 2 bytes / (2 * 3.35e12) ~= 164`` tokens (weights only), for any
  model size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import mixed_shapes, packed_prefill_shapes

HBM_BYTES_PER_MS = 3.35e12 / 1e3
ACHIEVED_FLOP_PER_MS = 550e12 / 1e3
LAUNCH_OVERHEAD_MS = 0.8
BF16_BYTES = 2


@dataclass(frozen=True)
class AdditiveProfile:
    """The additive curve: compute time on top of the weight-streaming floor.

    * every forward streams the weights once: ``2 * params / 3.35 TB/s``, plus
      the fixed overhead of 0.8 ms;
    * prompt tokens cost ``2 * params`` FLOP each at about 550 TFLOP/s,
      plus causal attention growing with the square of the prompt extent;
    * each decode row adds its KV-cache read and sampling; each speculative
      target row adds verification work like a prompt token.
    """

    name: str
    params: float  # parameters
    kv_ms_per_row: float  # KV read + sampling per decode row
    attention_ms_per_token2: float  # causal attention, per prompt-token squared

    @property
    def floor_ms(self) -> float:
        return 2.0 * self.params / HBM_BYTES_PER_MS + LAUNCH_OVERHEAD_MS

    @property
    def ms_per_prompt_token(self) -> float:
        return 2.0 * self.params / ACHIEVED_FLOP_PER_MS

    def duration_ms(self, desc: GraphDescriptor) -> float:
        kind = desc.kind
        if kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
            c = desc.prompt_capacity
            return (
                self.floor_ms + c * self.ms_per_prompt_token + c * c * self.attention_ms_per_token2
            )
        if kind is GraphKind.DECODE:
            return self.floor_ms + desc.batch_capacity * self.kv_ms_per_row
        if kind is GraphKind.SPECULATIVE:
            rows = desc.target_capacity
            draft = 0.15 * self.floor_ms * desc.proposal_depth
            return (
                self.floor_ms
                + draft
                + desc.batch_capacity * self.kv_ms_per_row
                + rows * self.ms_per_prompt_token
            )
        if kind is GraphKind.MIXED:
            c = desc.prompt_capacity + desc.target_capacity
            return (
                self.floor_ms
                + c * self.ms_per_prompt_token
                + desc.batch_capacity * (self.kv_ms_per_row)
            )
        return self.floor_ms

    def duration_ns(self, desc: GraphDescriptor) -> int:
        return round(self.duration_ms(desc) * 1e6)


@dataclass(frozen=True)
class RooflineProfile:
    """``cost = overhead + max(memory_ms, compute_ms)``, plus draft passes.

    Memory: the weights (``params * 2`` bytes) stream once per frame, and every
    decode or verification row reads the KV cache of a nominal context of
    ``nominal_context`` tokens (the real context is not part of the shape, and
    a graph's cost depends on its shape only).  KV bytes per token are
    ``2 (K and V) * layers * kv_heads * head_dim * 2 bytes``.  Prefill chunks
    read no earlier KV (a chunk is priced as if it started the prompt).

    A packed prefill (B rows sharing C tokens) costs what the single-row
    prefill of capacity C does: the same C tokens, and attention priced as if
    one row held them all, the worst case of its shape (a graph's cost depends
    on its shape only, never on how its rows split the tokens).

    Compute: ``2 * params`` FLOP per packed token (prefill: C; decode: B;
    mixed: C + P, where P = B * W for rectangular shapes; speculative: the P
    target rows), plus causal attention over the prompt tokens,
    ``4 * layers * q_heads * head_dim * C**2 / 2`` FLOP (QK^T and PV, two
    FLOP per multiply-add, half the square for the causal mask).  Attention
    of decode rows is memory-bound and is counted by the KV bytes.

    Speculative frames first run ``D`` sequential draft passes over the ``B``
    rows; each is a scaled-down decode step costing ``draft_fraction`` of the
    target's decode step at batch B (a draft model that fraction of the
    target's size in weights, KV and launches).  They add to the verification
    step; they cannot overlap it.

    Arithmetic (1024-token nominal context):

    ======================  ===============  ===============
    quantity                Llama-3.2-1B     Llama-3-8B
    ======================  ===============  ===============
    params, weight bytes    1.24e9, 2.48 GB  8.03e9, 16.1 GB
    weight stream           0.740 ms         4.794 ms
    layers, KV heads, dim   16, 8, 64        32, 8, 128
    KV bytes per token      32 KiB           128 KiB
    KV read per row (1024)  0.0100 ms        0.0401 ms
    compute per token       4.51 us          29.2 us
    attention FLOP per C^2  2*16*2048=65536  2*32*4096=262144
    decode B=1              1.550 ms         5.634 ms
    decode B=16             1.701 ms         6.235 ms
    decode B=64             2.181 ms         8.158 ms
    mixed B=16 C=64         1.701 ms         6.235 ms
    prefill C=64            1.540 ms         5.594 ms
    prefill C=4096          21.27 ms         128.4 ms
    ======================  ===============  ===============
    """

    name: str
    params: float  # parameters, bf16 weights
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    nominal_context: int = 1024  # tokens of KV each decode/verification row reads
    overhead_ms: float = LAUNCH_OVERHEAD_MS
    draft_fraction: float = 0.15  # one draft pass, relative to a target decode step

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES

    @property
    def weight_ms(self) -> float:
        return self.params * BF16_BYTES / HBM_BYTES_PER_MS

    @property
    def kv_ms_per_row(self) -> float:
        return self.nominal_context * self.kv_bytes_per_token / HBM_BYTES_PER_MS

    @property
    def ms_per_token(self) -> float:
        return 2.0 * self.params / ACHIEVED_FLOP_PER_MS

    @property
    def attention_ms_per_token2(self) -> float:
        return 2.0 * self.layers * self.q_heads * self.head_dim / ACHIEVED_FLOP_PER_MS

    def memory_ms(self, desc: GraphDescriptor) -> float:
        if desc.kind in (GraphKind.DECODE, GraphKind.MIXED, GraphKind.SPECULATIVE):
            rows = desc.batch_capacity
        else:
            rows = 0
        return self.weight_ms + rows * self.kv_ms_per_row

    def compute_ms(self, desc: GraphDescriptor) -> float:
        kind = desc.kind
        c = desc.prompt_capacity
        if kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
            tokens = c
        elif kind is GraphKind.DECODE:
            tokens = desc.batch_capacity
        elif kind is GraphKind.MIXED:
            tokens = c + desc.target_capacity
        elif kind is GraphKind.SPECULATIVE:
            tokens = desc.target_capacity
        else:
            tokens = 0
        return tokens * self.ms_per_token + c * c * self.attention_ms_per_token2

    def draft_ms(self, desc: GraphDescriptor) -> float:
        if desc.kind is not GraphKind.SPECULATIVE or desc.proposal_depth == 0:
            return 0.0
        b = desc.batch_capacity
        step = self.overhead_ms + max(
            self.weight_ms + b * self.kv_ms_per_row, b * self.ms_per_token
        )
        return desc.proposal_depth * self.draft_fraction * step

    def duration_ms(self, desc: GraphDescriptor) -> float:
        return (
            self.overhead_ms
            + max(self.memory_ms(desc), self.compute_ms(desc))
            + self.draft_ms(desc)
        )

    def duration_ns(self, desc: GraphDescriptor) -> int:
        return round(self.duration_ms(desc) * 1e6)


@dataclass(frozen=True)
class CopyProposerProfile:
    """``base`` with copy proposals: a speculative program's D bounds a prefix
    copied from the context (spec, "Speculative graph coverage"), so it runs no
    draft passes.  A speculative shape costs what ``base`` charges for the same
    shape with ``proposal_depth`` 0 (verification only); every other shape, and
    every number of ``base``, is unchanged."""

    base: AdditiveProfile | RooflineProfile

    @property
    def name(self) -> str:
        return f"{self.base.name}+copy"

    def duration_ms(self, desc: GraphDescriptor) -> float:
        if desc.kind is GraphKind.SPECULATIVE and desc.proposal_depth:
            desc = replace(desc, proposal_depth=0, device_allocated=False)
        return self.base.duration_ms(desc)

    def duration_ns(self, desc: GraphDescriptor) -> int:
        return round(self.duration_ms(desc) * 1e6)


# Either family; both price any valid descriptor.
CostProfile = AdditiveProfile | RooflineProfile | CopyProposerProfile

PROPOSERS = ("draft", "copy")

PROFILES: dict[str, CostProfile] = {
    # Llama-3.2-1B: 1.24e9 parameters, 16 layers, 32 query heads, 8 KV heads, head_dim 64.
    "llama1b-h100": RooflineProfile("llama1b-h100", 1.24e9, 16, 32, 8, 64),
    # Llama-3-8B: 8.03e9 parameters, 32 layers, 32 query heads, 8 KV heads, head_dim 128.
    "llama8b-h100": RooflineProfile("llama8b-h100", 8.03e9, 32, 32, 8, 128),
    # The earlier additive curves, numbers unchanged.
    # Llama-3.2-1B class: 1.24e9 parameters (2.5 GB bf16).
    "llama1b-h100-additive": AdditiveProfile("llama1b-h100-additive", 1.24e9, 0.015, 1.0e-7),
    # Llama-3-8B class: 8.0e9 parameters (16 GB bf16).
    "llama8b-h100-additive": AdditiveProfile("llama8b-h100-additive", 8.0e9, 0.04, 3.0e-7),
}


def profile_for(name: str, proposer: str = "draft") -> CostProfile:
    """The cost profile ``name`` of :data:`PROFILES` for a proposal source:
    ``draft`` (learned proposals: the profile as it is) or ``copy``
    (:class:`CopyProposerProfile`: no draft passes).  The catalog's shapes are
    the same for both; only the cost of a speculative program differs."""
    if name not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {name!r}")
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {list(PROPOSERS)}, got {proposer!r}")
    base = PROFILES[name]
    return base if proposer == "draft" else CopyProposerProfile(base)


def build_catalog(
    prefill_buckets: Sequence[int] = (64, 128, 256, 512, 1024, 2048, 4096),
    decode_batches: Sequence[int] = (1, 2, 4, 8, 16),
    speculative_widths: Sequence[int] = (),
    mixed: bool = False,
    packed: bool = False,
) -> list[GraphDescriptor]:
    """Prefill buckets, power-of-two decode batches, rectangular speculative shapes,
    (``packed=True``) the packed prefill shapes of
    :func:`runtime.ranks.capacity.packed_prefill_shapes`, and (``mixed=True``)
    the joint mixed prefill/decode shapes of
    :func:`runtime.ranks.capacity.mixed_shapes` over the same two ladders.

    Speculative shapes: for every decode batch B and width W of
    ``speculative_widths``, host-allocated ``SPECULATIVE`` with D = W - 1 and
    P = B x W.  They serve learned and copy proposals alike (for copy
    proposals D bounds the supplied prefix); the proposal source changes their
    cost, not their shape: see :func:`profile_for`."""
    out = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=c) for c in prefill_buckets]
    if packed:
        out += packed_prefill_shapes(decode_batches, prefill_buckets)
    out += [GraphDescriptor(GraphKind.DECODE, b) for b in decode_batches]
    for b in decode_batches:
        for w in speculative_widths:
            out.append(
                GraphDescriptor(GraphKind.SPECULATIVE, b, token_capacity=w, proposal_depth=w - 1)
            )
    if mixed:
        out += mixed_shapes(decode_batches, prefill_buckets)
    return out
