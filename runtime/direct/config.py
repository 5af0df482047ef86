"""Direct mode's own settings (frozen): the cost average, its expiry, the window.

These are constants of the diagnostic scheduler, not policy preferences: direct
mode has no prices to tune.  They exist as a dataclass so a test can shorten the
expiry or a reader can see every number the scheduler uses in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from runtime.coordinator.errors import SchedulerError


@dataclass(frozen=True)
class DirectConfig:
    """The numbers of direct mode.

    * ``sample_weight``: the weight of a new cost sample in the moving average
      (1/8: ``estimate = 7/8 * estimate + 1/8 * sample``).
    * ``estimate_ttl_ns``: an estimate with no sample for this long (scheduler
      time, from ``advance_to``) reverts to unmeasured (30 s).
    * ``max_in_flight``: frames submitted and not yet completed, all requests
      together (2, the transport's two frame slots).  A request is in at most
      one of them.
    """

    sample_weight: float = 1 / 8
    estimate_ttl_ns: int = 30_000_000_000
    max_in_flight: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SchedulerError(f"{f.name} must be a number, got {value!r}")
        if not 0 < self.sample_weight <= 1:
            raise SchedulerError(f"sample_weight must lie in (0, 1], got {self.sample_weight!r}")
        for name in ("estimate_ttl_ns", "max_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SchedulerError(f"{name} must be a positive integer, got {value!r}")
