"""The prepared-program catalog a rank captures, from capacity settings.

* Prefill buckets: prompt capacities aligned to 64, doubling from
  ``min_prefill_tokens`` up to ``max_prefill_tokens`` (always included), never
  beyond the model's context.
* Decode buckets: power-of-two batch capacities through the padded concurrency:
  a concurrency of 6 captures batches 1, 2, 4 and 8.

Speculative and mixed shapes join with their issues (the spec's "Speculative
graph coverage" and ``mixed_shapes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.catalog import MAX_BATCH_CAPACITY, PROMPT_ALIGNMENT, GraphDescriptor, GraphKind


class CapacityError(ValueError):
    """A capacity setting is invalid; the message names it."""


def padded_concurrency(concurrency: int) -> int:
    """The smallest power of two at least ``concurrency``."""
    return 1 << (concurrency - 1).bit_length()


@dataclass(frozen=True)
class CapacityConfig:
    max_concurrency: int = 8
    min_prefill_tokens: int = 64
    max_prefill_tokens: int = 2048

    def __post_init__(self) -> None:
        c = self.max_concurrency
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_BATCH_CAPACITY:
            raise CapacityError(f"max_concurrency must be in 1..{MAX_BATCH_CAPACITY}, got {c!r}")
        for name in ("min_prefill_tokens", "max_prefill_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % PROMPT_ALIGNMENT:
                raise CapacityError(
                    f"{name} must be a positive multiple of {PROMPT_ALIGNMENT}, got {v!r}"
                )
        if self.min_prefill_tokens > self.max_prefill_tokens:
            raise CapacityError(
                f"min_prefill_tokens ({self.min_prefill_tokens}) exceeds "
                f"max_prefill_tokens ({self.max_prefill_tokens})"
            )

    def prefill_buckets(self, max_context: int | None = None) -> tuple[int, ...]:
        top = self.max_prefill_tokens
        if max_context is not None:
            top = min(top, max_context // PROMPT_ALIGNMENT * PROMPT_ALIGNMENT)
            if top < PROMPT_ALIGNMENT:
                raise CapacityError(f"max_context {max_context} is below one prefill bucket")
        buckets = []
        size = min(self.min_prefill_tokens, top)
        while size < top:
            buckets.append(size)
            size *= 2
        buckets.append(top)
        return tuple(buckets)

    def decode_batches(self) -> tuple[int, ...]:
        top = padded_concurrency(self.max_concurrency)
        return tuple(1 << i for i in range(top.bit_length()))


def build_catalog(cfg: CapacityConfig, max_context: int | None = None) -> list[GraphDescriptor]:
    out = [
        GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=c)
        for c in cfg.prefill_buckets(max_context)
    ]
    out += [GraphDescriptor(GraphKind.DECODE, b) for b in cfg.decode_batches()]
    return out
