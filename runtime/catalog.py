"""Prepared-graph descriptors shared by the coordinator and the ranks.

A prepared program (a "graph") is a fixed-shape physical program captured ahead
of time.  Its identity is its kind and its physical extents; the number of rows
that happen to be active in one execution never changes that identity (spec,
"Duration estimates").

Extents, in the spec's letters:

* ``batch_capacity``  B: request rows (vision: images per frame, a power of
  two).  A prefill program of B > 1 is packed: up to B prompt rows share
  its ``prompt_capacity`` tokens, each with its own query length (their
  offsets are the prefix sums, as in mixed programs).
  Scored prefill programs (a prefill that also returns every prompt
  position's log probabilities, docs/scored-prefill.md) are packed the same
  way.
* ``token_capacity``  W: per-request target capacity, including the pending
  token (decode width).  Ordinary decode has W = 1.
* ``proposal_depth``  D: captured proposal depth; width-one programs have D = 0.
* ``target_capacity`` P: aggregate target rows.  Rectangular programs declare
  P = B x W; ragged programs declare less.  Zero on input means "rectangular".
* ``prompt_capacity``: prompt tokens (prefill, scored prefill, mixed); a
  multiple of 64.
* ``device_allocated``: the speculative program's value source (spec,
  "Speculative graph coverage").  False: an exact QueryLength binding, the host
  fixes each lane's target rows before proposals are drawn.  True: a
  SpeculativePrefixLimit binding, the host supplies lane ceilings and the
  program allocates its P rows from its own causal confidence (D > 0 only;
  adaptive selection only).

``estimated_duration_ns`` exists so descriptors can travel with a cost, but the
coordinator ignores it on input: every estimate starts indeterminate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

MAX_BATCH_CAPACITY = 64
PROMPT_ALIGNMENT = 64
MAX_MIXED_TOKEN_CAPACITY = 8


class CatalogError(ValueError):
    """A descriptor or catalog is malformed; the message names the field."""


class GraphKind(str, Enum):
    PREFILL = "prefill"
    SCORED_PREFILL = "scored_prefill"
    DECODE = "decode"
    SPECULATIVE = "speculative"
    MIXED = "mixed"
    VISION = "vision"
    INIT = "init"
    SNAPSHOT = "snapshot"
    RESTORE = "restore"


# Only ordinary decode and complete speculative generation may occupy both
# frame slots; every other kind drains the window (spec, "Planning and the
# execution queue").
QUEUEABLE_KINDS = frozenset({GraphKind.DECODE, GraphKind.SPECULATIVE})
PROMPT_KINDS = frozenset({GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.MIXED})
# The prefill kinds: programs whose every lane is a prompt row (B > 1: packed).
PREFILL_KINDS = (GraphKind.PREFILL, GraphKind.SCORED_PREFILL)


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CatalogError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise CatalogError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class GraphDescriptor:
    kind: GraphKind
    batch_capacity: int
    token_capacity: int = 1
    proposal_depth: int = 0
    target_capacity: int = 0
    prompt_capacity: int = 0
    device_allocated: bool = False
    estimated_duration_ns: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        try:
            kind = GraphKind(self.kind)
        except ValueError:
            raise CatalogError(f"kind: unknown graph kind {self.kind!r}") from None
        object.__setattr__(self, "kind", kind)
        _require_int("batch_capacity", self.batch_capacity, 1)
        _require_int("token_capacity", self.token_capacity, 1)
        _require_int("proposal_depth", self.proposal_depth, 0)
        _require_int("target_capacity", self.target_capacity, 0)
        _require_int("prompt_capacity", self.prompt_capacity, 0)
        _require_int("estimated_duration_ns", self.estimated_duration_ns, 0)
        if not isinstance(self.device_allocated, bool):
            raise CatalogError(f"device_allocated must be a bool, got {self.device_allocated!r}")
        if self.device_allocated and (kind is not GraphKind.SPECULATIVE or self.proposal_depth < 1):
            raise CatalogError(
                "device_allocated is for speculative programs with proposal_depth > 0"
            )
        if self.batch_capacity > MAX_BATCH_CAPACITY:
            raise CatalogError(
                f"batch_capacity must be <= {MAX_BATCH_CAPACITY}, got {self.batch_capacity}"
            )
        if self.target_capacity == 0 and kind not in PREFILL_KINDS:
            object.__setattr__(self, "target_capacity", self.batch_capacity * self.token_capacity)
        self._validate_kind(kind)

    def _validate_kind(self, kind: GraphKind) -> None:
        b, w, d, p, c = (
            self.batch_capacity,
            self.token_capacity,
            self.proposal_depth,
            self.target_capacity,
            self.prompt_capacity,
        )
        if kind in PROMPT_KINDS:
            if c <= 0 or c % PROMPT_ALIGNMENT:
                raise CatalogError(
                    f"prompt_capacity must be a positive multiple of {PROMPT_ALIGNMENT} "
                    f"for {kind.value}, got {c}"
                )
        elif c:
            raise CatalogError(f"prompt_capacity must be 0 for {kind.value}, got {c}")
        if kind in PREFILL_KINDS:
            # A packed prefill: up to B prompt rows share the C prompt tokens.
            if not _is_power_of_two(b):
                raise CatalogError(
                    f"batch_capacity must be a power of two for {kind.value}, got {b}"
                )
            if w != 1 or d != 0:
                raise CatalogError(f"{kind.value} takes token_capacity=1 and proposal_depth=0")
        elif kind is GraphKind.DECODE:
            if not _is_power_of_two(b):
                raise CatalogError(f"batch_capacity must be a power of two for decode, got {b}")
            if w != 1 or d != 0 or p != b:
                raise CatalogError(
                    "decode takes token_capacity=1, proposal_depth=0 and target_capacity=B"
                )
        elif kind is GraphKind.SPECULATIVE:
            if not _is_power_of_two(b):
                raise CatalogError(
                    f"batch_capacity must be a power of two for speculative, got {b}"
                )
            if w == 1 and d != 0:
                raise CatalogError("width-one speculative programs have proposal_depth=0")
            if p > b * w or p < b:
                raise CatalogError(
                    f"target_capacity must lie in [B, B*W] = [{b}, {b * w}], got {p}"
                )
        elif kind is GraphKind.VISION:
            # B: images per frame, in power-of-two image-count buckets (docs/vision.md).
            if not _is_power_of_two(b):
                raise CatalogError(f"batch_capacity must be a power of two for vision, got {b}")
            if w != 1 or d != 0:
                raise CatalogError("vision takes token_capacity=1 and proposal_depth=0")
        elif kind is GraphKind.MIXED:
            if not _is_power_of_two(b) or b < 2:
                raise CatalogError(
                    f"batch_capacity must be a power of two from 2 through 64 for mixed, got {b}"
                )
            if w > MAX_MIXED_TOKEN_CAPACITY:
                raise CatalogError(
                    f"token_capacity must be <= {MAX_MIXED_TOKEN_CAPACITY} for mixed, got {w}"
                )
            if c < w:
                raise CatalogError("mixed prompt_capacity must be at least token_capacity")

    @property
    def key(self) -> tuple:
        """Cost-entry identity: kind and every physical extent, never the active rows."""
        return (
            self.kind.value,
            self.batch_capacity,
            self.token_capacity,
            self.proposal_depth,
            self.target_capacity,
            self.prompt_capacity,
            self.device_allocated,
        )

    @property
    def queueable(self) -> bool:
        return self.kind in QUEUEABLE_KINDS

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "batch_capacity": self.batch_capacity,
            "token_capacity": self.token_capacity,
            "proposal_depth": self.proposal_depth,
            "target_capacity": self.target_capacity,
            "prompt_capacity": self.prompt_capacity,
            "device_allocated": self.device_allocated,
            "estimated_duration_ns": self.estimated_duration_ns,
        }

    @classmethod
    def from_wire(cls, data: Any) -> GraphDescriptor:
        if not isinstance(data, dict):
            raise CatalogError(f"descriptor must be a map, got {type(data).__name__}")
        allowed = set(cls.__dataclass_fields__)
        unknown = set(data) - allowed
        if unknown:
            raise CatalogError(f"descriptor has unknown field(s): {sorted(unknown)}")
        if "kind" not in data or "batch_capacity" not in data:
            raise CatalogError("descriptor needs 'kind' and 'batch_capacity'")
        return cls(**data)

    def describe(self) -> str:
        parts = [self.kind.value, f"B={self.batch_capacity}"]
        if self.kind in (GraphKind.SPECULATIVE, GraphKind.MIXED):
            parts += [
                f"D={self.proposal_depth}",
                f"W={self.token_capacity}",
                f"P={self.target_capacity}",
            ]
        if self.prompt_capacity:
            parts.append(f"C={self.prompt_capacity}")
        if self.device_allocated:
            parts.append("device-allocated")
        return " ".join(parts)


# The programs that copy KV state (prefix-cache snapshots and restores): they run
# no forward and have no prepared body on the ranks.
STATE_KIND_NAMES = frozenset({GraphKind.SNAPSHOT.value, GraphKind.RESTORE.value})


def describe_counts(programs: Iterable[GraphDescriptor | str]) -> str:
    """``22 programs (10 forward + 12 state)``: a catalog counted the same way in
    the ranks' log and in the coordinator's and the frontend's summaries.  Forward
    programs run the model (prepared on every rank; on CUDA captured as graphs);
    state programs (snapshot, restore) copy KV pages and have no prepared body.
    ``programs``: descriptors, or their :meth:`GraphDescriptor.describe` names."""
    kinds = [p.kind.value if isinstance(p, GraphDescriptor) else p.split()[0] for p in programs]
    state = sum(1 for kind in kinds if kind in STATE_KIND_NAMES)
    return f"{len(kinds)} programs ({len(kinds) - state} forward + {state} state)"


def within_speculative_envelope(desc: GraphDescriptor, capacity: int) -> bool:
    """The ``--speculative-token-capacity`` envelope R (spec, "Speculative graph
    coverage"): a wider program (W > 1, speculative or mixed) needs B x W <= R
    when rectangular and P <= R when ragged; other programs are not bounded."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise CatalogError(
            f"speculative token capacity must be a positive integer, got {capacity!r}"
        )
    if desc.kind not in (GraphKind.SPECULATIVE, GraphKind.MIXED) or desc.token_capacity == 1:
        return True
    rectangular = desc.target_capacity == desc.batch_capacity * desc.token_capacity
    rows = desc.batch_capacity * desc.token_capacity if rectangular else desc.target_capacity
    return rows <= capacity


def validate_catalog(descriptors: list[GraphDescriptor]) -> tuple[GraphDescriptor, ...]:
    """Reject duplicate identities; return the catalog in a stable order."""
    seen: dict[tuple, int] = {}
    for index, desc in enumerate(descriptors):
        if not isinstance(desc, GraphDescriptor):
            raise CatalogError(f"catalog[{index}] is not a GraphDescriptor")
        if desc.key in seen:
            raise CatalogError(
                f"catalog[{index}] duplicates catalog[{seen[desc.key]}] ({desc.describe()})"
            )
        seen[desc.key] = index
    return tuple(descriptors)
