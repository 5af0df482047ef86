"""Synthetic measured catalogs: per-kind cost curves for prepared graphs.

The curves are roofline estimates for a dense decoder on one H100 SXM (bf16,
CUDA graphs), not measurements of this project:

* every forward streams the weights once: ``weight_bytes / 3.35 TB/s``, plus a
  fixed launch, sampling and synchronization overhead of about 0.8 ms;
* prompt tokens cost ``2 * params`` FLOP each at about 550 TFLOP/s achieved,
  plus causal attention growing with the square of the prompt extent;
* each decode row adds its KV-cache read and sampling; each speculative target
  row adds verification work like a prompt token.

A graph's cost depends on its physical shape only, never on how many rows are
active: padding costs the same as useful work.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.catalog import GraphDescriptor, GraphKind

HBM_BYTES_PER_MS = 3.35e12 / 1e3
ACHIEVED_FLOP_PER_MS = 550e12 / 1e3
LAUNCH_OVERHEAD_MS = 0.8


@dataclass(frozen=True)
class CostProfile:
    name: str
    params: float  # parameters
    kv_ms_per_row: float  # KV read + sampling per active decode row
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


PROFILES: dict[str, CostProfile] = {
    # Llama-3.2-1B class: 1.24e9 parameters (2.5 GB bf16).
    "llama1b-h100": CostProfile("llama1b-h100", 1.24e9, 0.015, 1.0e-7),
    # Llama-3-8B class: 8.0e9 parameters (16 GB bf16).
    "llama8b-h100": CostProfile("llama8b-h100", 8.0e9, 0.04, 3.0e-7),
}


def build_catalog(
    prefill_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096),
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16),
    speculative_widths: tuple[int, ...] = (),
) -> list[GraphDescriptor]:
    """Prefill buckets, power-of-two decode batches, and rectangular speculative shapes."""
    out = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=c) for c in prefill_buckets]
    out += [GraphDescriptor(GraphKind.DECODE, b) for b in decode_batches]
    for b in decode_batches:
        for w in speculative_widths:
            out.append(
                GraphDescriptor(GraphKind.SPECULATIVE, b, token_capacity=w, proposal_depth=w - 1)
            )
    return out
