"""The prepared-program catalog a rank captures, from capacity settings.

* Prefill buckets: prompt capacities aligned to 64, doubling from
  ``min_prefill_tokens`` up to ``max_prefill_tokens`` (always included), never
  beyond the model's context.
* Decode buckets: power-of-two batch capacities through the padded concurrency:
  a concurrency of 6 captures batches 1, 2, 4 and 8.
* Packed prefill buckets (``packed_prefill``):
  :func:`packed_prefill_shapes`, a prefill of B rows for every decode batch
  B >= 2, at every prompt bucket that holds at least 64 tokens a row.

* Scored prefill buckets (``scored_prefill``): :func:`scored_prefill_shapes`,
  the prefill shapes again as SCORED_PREFILL programs (a prefill that also
  returns every prompt position's log probabilities): a single scored prefill
  at every prompt bucket, and the packed ones where ``packed_prefill`` is on
  (docs/scored-prefill.md, "Catalog").

* Mixed prefill/decode shapes (opt-in, ``mixed_prefill``): :func:`mixed_shapes`,
  the spec's joint-catalog rule ("Mixed execution contract"), over those two
  ladders.

* Speculative rounds (``speculative_widths``, the spec's "Speculative graph
  coverage"): for every decode batch B and width W, the rectangular program
  (B, W, D = W - 1, P = B x W) when B x W fits the target-row envelope
  ``speculative_token_capacity`` R (0: unbounded); with
  ``device_allocation`` (adaptive selection only), also a prefix-limit program
  per batch of at least two rows at the widest W with P = B x W / 2 rows
  (P <= R).  Width one is the ordinary decode program, which keeps the draft
  context (runtime/ranks/draft.py).

* Vision programs (a vision model only, ``build_catalog(..., vision=True)``):
  :func:`vision_shapes`, a VISION program per power-of-two image count
  through ``max_vision_images`` (B = images per frame).  Their feature store
  (``vision_windows`` windows of ``window_rows`` rows, :class:`VisionCapacity`)
  is sized at rank start-up from the model's image tokens (docs/vision.md,
  "Rank programs").

* State programs (spec, "Prerequisites and completion"): a RESTORE and a
  SNAPSHOT program per decode batch B (token capacity 1, no prompt capacity).
  They run no forward (runtime/ranks/worker.py: page copies, restored rows and
  dropped slots, timed as one device interval), so each costs what its state
  writes cost; :func:`forward_programs` leaves them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtime.catalog import (
    MAX_BATCH_CAPACITY,
    MAX_MIXED_TOKEN_CAPACITY,
    PROMPT_ALIGNMENT,
    GraphDescriptor,
    GraphKind,
)

# Resident request slots when nobody says (--max-num-seqs): measured on the CPU
# runtime with flare bench (docs/serving.md, "Default concurrency").
DEFAULT_MAX_CONCURRENCY = 32
# A vision model's feature store when nobody says: windows, images a window
# holds (its rows: that many images' tokens), the largest vision frame.
DEFAULT_VISION_WINDOWS = 4
DEFAULT_WINDOW_IMAGES = 4
DEFAULT_MAX_VISION_IMAGES = 4


class CapacityError(ValueError):
    """A capacity setting is invalid; the message names it."""


def padded_concurrency(concurrency: int) -> int:
    """The smallest power of two at least ``concurrency``."""
    return 1 << (concurrency - 1).bit_length()


@dataclass(frozen=True)
class CapacityConfig:
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    min_prefill_tokens: int = 64
    max_prefill_tokens: int = 2048
    mixed_prefill: bool = False
    packed_prefill: bool = False
    scored_prefill: bool = False
    speculative_widths: tuple[int, ...] = ()
    speculative_token_capacity: int = 0
    device_allocation: bool = False
    # A vision model's feature store and vision programs (ignored for text-only
    # models): windows, rows per window (0: DEFAULT_WINDOW_IMAGES images' tokens),
    # the most images one vision frame encodes.
    vision_windows: int = DEFAULT_VISION_WINDOWS
    window_rows: int = 0
    max_vision_images: int = DEFAULT_MAX_VISION_IMAGES

    def __post_init__(self) -> None:
        for name, least in (("vision_windows", 1), ("window_rows", 0), ("max_vision_images", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise CapacityError(f"{name} must be an integer >= {least}, got {v!r}")
        if self.max_vision_images > MAX_BATCH_CAPACITY:
            raise CapacityError(
                f"max_vision_images must be <= {MAX_BATCH_CAPACITY}, got {self.max_vision_images}"
            )
        widths = self.speculative_widths
        if not isinstance(widths, tuple) or any(
            isinstance(w, bool) or not isinstance(w, int) or not 2 <= w <= 16 for w in widths
        ):
            raise CapacityError(f"speculative_widths must hold integers in [2, 16], got {widths!r}")
        r = self.speculative_token_capacity
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise CapacityError(f"speculative_token_capacity must be an integer >= 0, got {r!r}")
        if self.device_allocation and not widths:
            raise CapacityError("device_allocation needs speculative_widths")
        if not isinstance(self.mixed_prefill, bool):
            raise CapacityError(f"mixed_prefill must be a bool, got {self.mixed_prefill!r}")
        if not isinstance(self.packed_prefill, bool):
            raise CapacityError(f"packed_prefill must be a bool, got {self.packed_prefill!r}")
        if not isinstance(self.scored_prefill, bool):
            raise CapacityError(f"scored_prefill must be a bool, got {self.scored_prefill!r}")
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

    def vision_batches(self) -> tuple[int, ...]:
        """The vision programs' image counts: powers of two through the padded
        ``max_vision_images``."""
        top = padded_concurrency(self.max_vision_images)
        return tuple(1 << i for i in range(top.bit_length()))


@dataclass(frozen=True)
class VisionCapacity:
    """A vision model's feature store: ``windows`` windows of ``window_rows``
    feature rows each (row ``windows * window_rows`` is scratch), for images
    of ``image_tokens`` rows."""

    windows: int
    window_rows: int
    image_tokens: int

    @property
    def rows(self) -> int:
        """Addressable feature rows (the scratch row is not one)."""
        return self.windows * self.window_rows

    @classmethod
    def of(cls, cfg: CapacityConfig, image_tokens: int) -> VisionCapacity:
        """The store ``cfg`` asks for, for a model of ``image_tokens`` rows per
        image; CapacityError when a window cannot hold one image."""
        rows = cfg.window_rows or DEFAULT_WINDOW_IMAGES * image_tokens
        if rows < image_tokens:
            raise CapacityError(
                f"window_rows ({rows}) cannot hold one image of {image_tokens} feature rows"
            )
        return cls(cfg.vision_windows, rows, image_tokens)


def balanced_prompt_bucket(prompt_buckets: Sequence[int]) -> int:
    """The bucket minimizing max(P / P_min, P_max / P); ties choose the smaller.

    It balances the worst multiplicative distance to short and long prompt
    chunks (the geometric middle of the ladder).
    """
    lo, hi = min(prompt_buckets), max(prompt_buckets)
    return min(sorted(prompt_buckets), key=lambda p: max(p / lo, hi / p))


def mixed_shapes(
    batch_buckets: Sequence[int],
    prompt_buckets: Sequence[int],
    *,
    wider_widths: Sequence[int] = (),
    token_envelope: int | None = None,
) -> list[GraphDescriptor]:
    """The joint mixed prefill/decode catalog (spec, "Mixed execution contract").

    Each batch bucket of at least two rows gets every prompt bucket at
    verification width one, and, for each wider width ``W`` the loaded decode
    mode verifies (``wider_widths``; proposal depth ``W - 1``) whose ``B * W``
    fits the target-token envelope ``token_envelope`` (``--speculative-token-
    capacity``; ``None``: unbounded), one graph at the balanced prompt bucket
    (:func:`balanced_prompt_bucket`).  The prompt bucket limits the
    prompt/depth combinations; the envelope limits the batch/depth ones.
    Ordinary execution passes no wider widths.
    """
    if not prompt_buckets:
        raise CapacityError("prompt_buckets: a mixed catalog needs at least one prompt bucket")
    for w in wider_widths:
        if isinstance(w, bool) or not isinstance(w, int) or w < 2:
            raise CapacityError(f"wider_widths must hold integers >= 2, got {w!r}")
    if token_envelope is not None and (
        isinstance(token_envelope, bool)
        or not isinstance(token_envelope, int)
        or token_envelope < 1
    ):
        raise CapacityError(f"token_envelope must be a positive integer, got {token_envelope!r}")
    balanced = balanced_prompt_bucket(prompt_buckets)
    out: list[GraphDescriptor] = []
    for b in sorted(set(batch_buckets)):
        if b < 2:
            continue
        out += [
            GraphDescriptor(GraphKind.MIXED, b, prompt_capacity=c) for c in sorted(prompt_buckets)
        ]
        for w in sorted(set(wider_widths)):
            if token_envelope is not None and b * w > token_envelope:
                continue
            out.append(
                GraphDescriptor(
                    GraphKind.MIXED, b, token_capacity=w, proposal_depth=w - 1,
                    prompt_capacity=balanced,
                )
            )  # fmt: skip
    return out


def packed_prefill_shapes(
    batch_buckets: Sequence[int],
    prompt_buckets: Sequence[int],
    kind: GraphKind = GraphKind.PREFILL,
) -> list[GraphDescriptor]:
    """The packed prefill programs: for every batch bucket B >= 2, a prefill of
    B rows at each prompt bucket C >= 64 B (so its rows average at least one
    64-token chunk when it is full).  The spec gives prefill no batch capacity;
    this bounds the catalog to sum over B of the buckets of at least 64 B
    tokens, at most log2(B_max) programs per prompt bucket: the default
    (batches 2-32, prompts 64-2048) adds 15.  ``kind``: PREFILL, or
    SCORED_PREFILL for the packed scored programs (the same shapes)."""
    return [
        GraphDescriptor(kind, b, prompt_capacity=c)
        for b in sorted(set(batch_buckets))
        if b >= 2
        for c in sorted(prompt_buckets)
        if c >= b * PROMPT_ALIGNMENT
    ]


def scored_prefill_shapes(
    batch_buckets: Sequence[int], prompt_buckets: Sequence[int], packed: bool
) -> list[GraphDescriptor]:
    """The scored prefill programs: the prefill shapes as SCORED_PREFILL, a
    single row at every prompt bucket and, with ``packed``, the packed shapes of
    :func:`packed_prefill_shapes`.  The same bucket set as prefill, so a scored
    prompt is chunked and packed exactly as an unscored one is and the catalog
    at most doubles its prefill programs (the default flare run: 10 more)."""
    kind = GraphKind.SCORED_PREFILL
    out = [GraphDescriptor(kind, 1, prompt_capacity=c) for c in sorted(prompt_buckets)]
    if packed:
        out += packed_prefill_shapes(batch_buckets, prompt_buckets, kind)
    return out


def vision_shapes(batches: Sequence[int]) -> list[GraphDescriptor]:
    """The vision programs: one per image count (B images per frame)."""
    return [GraphDescriptor(GraphKind.VISION, b) for b in sorted(set(batches))]


def build_catalog(
    cfg: CapacityConfig, max_context: int | None = None, vision: bool = False
) -> list[GraphDescriptor]:
    """The catalog ``cfg`` asks for; ``vision``: the model encodes images (its
    vision programs too)."""
    prompts = cfg.prefill_buckets(max_context)
    batches = cfg.decode_batches()
    out = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=c) for c in prompts]
    if cfg.packed_prefill:
        out += packed_prefill_shapes(batches, prompts)
    if cfg.scored_prefill:
        out += scored_prefill_shapes(batches, prompts, cfg.packed_prefill)
    out += [GraphDescriptor(GraphKind.DECODE, b) for b in batches]
    if cfg.mixed_prefill:  # with speculation, wide mixed programs at each round width
        wider = [w for w in cfg.speculative_widths if w <= MAX_MIXED_TOKEN_CAPACITY]
        envelope = cfg.speculative_token_capacity or None
        out += mixed_shapes(batches, prompts, wider_widths=wider, token_envelope=envelope)
    out += speculative_shapes(
        batches, cfg.speculative_widths, cfg.speculative_token_capacity, cfg.device_allocation
    )
    if vision:
        out += vision_shapes(cfg.vision_batches())
    out += [GraphDescriptor(kind, b) for kind in STATE_PROGRAMS for b in batches]
    return out


# The state programs, in catalog order (no forward, no prepared body).
STATE_PROGRAMS = (GraphKind.RESTORE, GraphKind.SNAPSHOT)


def forward_programs(catalog: Sequence[GraphDescriptor]) -> list[GraphDescriptor]:
    """The descriptors that run the model (every one but the state programs)."""
    return [d for d in catalog if d.kind not in STATE_PROGRAMS]


def speculative_shapes(
    batches: Sequence[int], widths: Sequence[int], envelope: int = 0, device: bool = False
) -> list[GraphDescriptor]:
    """The speculative round programs (module docstring)."""
    out: list[GraphDescriptor] = []
    for b in batches:
        for w in sorted(set(widths)):
            if not envelope or b * w <= envelope:
                out.append(GraphDescriptor(GraphKind.SPECULATIVE, b, w, w - 1))
        if device and b >= 2:
            w = max(widths)
            p = b * w // 2
            if not envelope or p <= envelope:
                out.append(
                    GraphDescriptor(GraphKind.SPECULATIVE, b, w, w - 1, p, device_allocated=True)
                )
    return out
