"""Direct mode's graph costs: a 7/8 moving average that forgets after 30 s.

Each prepared program has one estimate.  It starts unmeasured (zero), whatever
the descriptor carried.  The first valid sample sets it; every later one moves
it an eighth of the way: ``estimate = 7/8 * estimate + 1/8 * sample``.  An
estimate that has had no valid sample for ``estimate_ttl_ns`` (30 s of
scheduler time) reverts to unmeasured, and the next sample starts it afresh.
(The coordinator's scheduler keeps a median of nine and never forgets a
measured cost; direct mode shares none of that code.)

A sample is the largest rank interval less that rank's launch wait (the time
the rank waited at the first collective for the others: a late host, not the
program).  A sample of zero or less is not a measurement and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime.catalog import GraphDescriptor, GraphKind, validate_catalog
from runtime.coordinator.records import ExecutionTiming


def cost_sample_ns(timing: ExecutionTiming) -> int:
    """max over ranks of (interval - launch wait); 0 when that is not positive."""
    intervals = timing.rank_device_ns
    waits = timing.rank_launch_wait_ns or (0,) * len(intervals)
    sample = max((d - w for d, w in zip(intervals, waits)), default=0)
    return sample if sample > 0 else 0


class CostEstimate:
    """One program's moving average and when it last had a sample."""

    __slots__ = ("descriptor", "last_sample_ns", "mean_ns", "samples")

    def __init__(self, descriptor: GraphDescriptor) -> None:
        self.descriptor = descriptor
        self.mean_ns = 0.0  # 0: unmeasured
        self.last_sample_ns: int | None = None
        self.samples = 0  # since the estimate last started

    @property
    def measured(self) -> bool:
        return self.mean_ns > 0

    @property
    def estimate_ns(self) -> int:
        """The average in whole ns (0: unmeasured)."""
        return round(self.mean_ns) if self.mean_ns > 0 else 0

    def observe(self, sample_ns: int, now_ns: int, weight: float) -> bool:
        """Fold one sample in; False (nothing changes) for a sample <= 0."""
        if sample_ns <= 0:
            return False
        if self.measured:
            self.mean_ns = (1 - weight) * self.mean_ns + weight * sample_ns
        else:
            self.mean_ns = float(sample_ns)
            self.samples = 0
        self.samples += 1
        self.last_sample_ns = now_ns
        return True

    def expire(self, now_ns: int, ttl_ns: int) -> bool:
        """Revert to unmeasured after ``ttl_ns`` without a sample; True if it did."""
        if self.last_sample_ns is None or now_ns - self.last_sample_ns < ttl_ns:
            return False
        self.mean_ns = 0.0
        self.last_sample_ns = None
        self.samples = 0
        return True

    def observation_age_ns(self, now_ns: int) -> int | None:
        return None if self.last_sample_ns is None else now_ns - self.last_sample_ns


class DirectCatalog:
    """Every program's estimate, keyed by physical identity.

    ``programs(kind)`` lists one kind's estimates by capacity (prompt capacity
    for prefill, batch capacity for decode), smallest first.
    """

    def __init__(self, descriptors: Iterable[GraphDescriptor], weight: float, ttl_ns: int) -> None:
        self.descriptors = validate_catalog(list(descriptors))
        self.weight = weight
        self.ttl_ns = ttl_ns
        self._entries = {d.key: CostEstimate(d) for d in self.descriptors}
        self._by_kind: dict[GraphKind, list[CostEstimate]] = {}
        for entry in self._entries.values():
            self._by_kind.setdefault(entry.descriptor.kind, []).append(entry)
        for entries in self._by_kind.values():
            entries.sort(key=lambda e: (e.descriptor.prompt_capacity, e.descriptor.batch_capacity))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, descriptor: object) -> bool:
        return isinstance(descriptor, GraphDescriptor) and descriptor.key in self._entries

    def entry(self, descriptor: GraphDescriptor) -> CostEstimate:
        try:
            return self._entries[descriptor.key]
        except KeyError:
            raise KeyError(f"graph not in catalog: {descriptor.describe()}") from None

    def programs(self, kind: GraphKind) -> list[CostEstimate]:
        return self._by_kind.get(kind, [])

    def observe(self, descriptor: GraphDescriptor, sample_ns: int, now_ns: int) -> bool:
        return self.entry(descriptor).observe(sample_ns, now_ns, self.weight)

    def expire(self, now_ns: int) -> list[GraphDescriptor]:
        """Revert every estimate without a sample for ``ttl_ns``; those reverted."""
        return [e.descriptor for e in self._entries.values() if e.expire(now_ns, self.ttl_ns)]

    def estimates(self) -> dict[str, int]:
        """Each program's estimate by readable name, in ns (0: unmeasured)."""
        return {e.descriptor.describe(): e.estimate_ns for e in self._entries.values()}
