"""Duration estimates for prepared graphs (spec, "Duration estimates").

* An estimate starts indeterminate (zero), whatever the descriptor said.
* The first positive observation sets it; further fresh observations give the
  median of the last nine (the middle pair averaged for an even count).
* An entry is stale after ``ttl_ns`` without a valid observation.  Its measured
  cost stays available for ranking and normalization; the first valid
  observation of a stale entry replaces the estimate and restarts the window.
* Missing or non-positive samples change nothing and do not refresh freshness.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from statistics import median
from typing import Any, TypeVar

from runtime.catalog import GraphDescriptor, GraphKind, validate_catalog

WINDOW = 9
T = TypeVar("T")


def cost_sample_ns(
    rank_device_ns: tuple[int, ...],
    readiness_delay_ns: int = 0,
    rank_launch_wait_ns: tuple[int, ...] = (),
) -> int:
    """The cost sample of one execution: the largest rank interval less that
    rank's launch wait, minus the exposed readiness delay.

    ``rank_launch_wait_ns`` (per rank, or empty): the time a rank waited at
    the frame's first collective for the others to launch.  That is a late
    host, not the program's cost, so it leaves the sample (this runtime's
    reading of the spec's readiness correction); raw intervals still feed
    service accounting and the exploration ledgers.  Returns 0 (no
    observation) when no rank reported a positive interval or the corrections
    leave nothing positive.
    """
    waits = rank_launch_wait_ns or (0,) * len(rank_device_ns)
    raw = max((ns - w for ns, w in zip(rank_device_ns, waits) if ns > 0), default=0)
    if raw <= 0:
        return 0
    sample = raw - max(0, readiness_delay_ns)
    return sample if sample > 0 else 0


class CostEntry:
    __slots__ = ("descriptor", "estimate_ns", "last_attempt_ns", "last_valid_ns", "samples")

    def __init__(self, descriptor: GraphDescriptor) -> None:
        self.descriptor = descriptor
        self.estimate_ns = 0
        self.samples: deque[int] = deque(maxlen=WINDOW)
        self.last_valid_ns: int | None = None
        self.last_attempt_ns: int | None = None

    @property
    def known(self) -> bool:
        return self.estimate_ns > 0

    def stale(self, now_ns: int, ttl_ns: int) -> bool:
        return self.last_valid_ns is not None and now_ns - self.last_valid_ns >= ttl_ns

    def fresh(self, now_ns: int, ttl_ns: int) -> bool:
        return self.known and not self.stale(now_ns, ttl_ns)

    def observe(self, sample_ns: int, now_ns: int, ttl_ns: int) -> bool:
        """Record one cost sample; returns False (and changes nothing) if invalid."""
        if sample_ns <= 0:
            return False
        if not self.known or self.stale(now_ns, ttl_ns):
            self.samples.clear()
            self.samples.append(sample_ns)
            self.estimate_ns = sample_ns
        else:
            self.samples.append(sample_ns)
            self.estimate_ns = round(median(self.samples))
        self.last_valid_ns = now_ns
        return True

    def observation_age_ns(self, now_ns: int) -> int | None:
        return None if self.last_valid_ns is None else now_ns - self.last_valid_ns


class CostCatalog:
    """Cost entries keyed by physical identity, indexed by kind for selection."""

    def __init__(self, descriptors: list[GraphDescriptor], ttl_ns: int) -> None:
        self.descriptors = validate_catalog(list(descriptors))
        self.ttl_ns = ttl_ns
        self._entries: dict[tuple, CostEntry] = {d.key: CostEntry(d) for d in self.descriptors}
        self.by_kind: dict[GraphKind, list[CostEntry]] = {}
        for entry in self._entries.values():
            self.by_kind.setdefault(entry.descriptor.kind, []).append(entry)
        for entries in self.by_kind.values():
            entries.sort(
                key=lambda e: (
                    e.descriptor.prompt_capacity,
                    e.descriptor.batch_capacity,
                    e.descriptor.token_capacity,
                    e.descriptor.target_capacity,
                    e.descriptor.proposal_depth,
                )
            )
        self.version = 0  # bumps on every estimate change, for derived caches
        self._derived: dict[str, tuple[int, Any]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, descriptor: GraphDescriptor) -> CostEntry:
        try:
            return self._entries[descriptor.key]
        except KeyError:
            raise KeyError(f"graph not in catalog: {descriptor.describe()}") from None

    def entries(self, kind: GraphKind) -> list[CostEntry]:
        return self.by_kind.get(kind, [])

    def observe(self, descriptor: GraphDescriptor, sample_ns: int, now_ns: int) -> bool:
        changed = self.entry(descriptor).observe(sample_ns, now_ns, self.ttl_ns)
        if changed:
            self.version += 1
        return changed

    def derived(self, key: str, build: Callable[[], T], per_version: bool = True) -> T:
        """``build()``, cached until the next estimate change (catalog version), or
        for good with ``per_version=False`` (what depends on the descriptors only)."""
        held = self._derived.get(key)
        if held is None or (per_version and held[0] != self.version):
            held = (self.version, build())
            self._derived[key] = held
        return held[1]

    def estimates(self) -> dict[str, int]:
        """Current estimates by readable name (zero = indeterminate), for metrics."""
        return {e.descriptor.describe(): e.estimate_ns for e in self._entries.values()}
