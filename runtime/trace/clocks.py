"""Each rank's clock against the coordinator's, estimated from frame round trips.

A frame is a ping that carries timestamps both ways: the coordinator sends it
at ``t0`` (its clock), the rank reads it at ``t1`` and publishes its completion
at ``t2`` (the rank's clock, ``Completion.host_times``), and the completion
reaches the coordinator at ``t3``.  As in NTP, with ``offset`` = rank clock -
coordinator clock::

    offset ~ ((t1 - t0) + (t2 - t3)) / 2      delay = (t3 - t0) - (t2 - t1)

The error of one sample is at most ``delay / 2`` (the two legs' asymmetry); a
frame that waited in the rank's socket behind another has a long delay.  So, as
NTP's clock filter does, the estimate is the sample of least delay among the
last :data:`WINDOW`.  Without rank timestamps there is nothing to measure: the
offset is 0 and the source says why (:data:`SAME_HOST`), which is right for the
ranks ``flare run`` starts (one host, one ``CLOCK_MONOTONIC``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 64  # recent samples per rank the least-delay one is chosen from
SAME_HOST = "same-host monotonic"  # no rank timestamps: offset 0 assumed
ROUND_TRIPS = "frame round trips"  # least-delay sample of the recent frames


@dataclass(frozen=True)
class ClockEstimate:
    """``offset_ns``: rank clock minus coordinator clock (subtract it from a rank
    timestamp to read it on the coordinator's clock); ``error_ns``: its bound
    (half the chosen sample's delay); ``samples``: round trips it was chosen from."""

    offset_ns: int
    error_ns: int
    samples: int
    source: str

    def to_json(self) -> dict:
        return {
            "clock_offset_ns": self.offset_ns,
            "clock_error_ns": self.error_ns,
            "clock_samples": self.samples,
            "clock_source": self.source,
        }


ASSUMED = ClockEstimate(0, 0, 0, SAME_HOST)


class RankClocks:
    """Offset estimates for ``world`` ranks; fed one round trip at a time (one thread)."""

    def __init__(self, world: int, window: int = WINDOW) -> None:
        if world < 1 or window < 1:
            raise ValueError(f"world and window must be >= 1, got {world} and {window}")
        # Per rank: (delay, offset) of the recent samples.
        self._samples: list[deque[tuple[int, int]]] = [deque(maxlen=window) for _ in range(world)]
        self._best_sample: list[tuple[int, int] | None] = [None] * world  # (delay, offset)
        self._best: list[ClockEstimate] = [ASSUMED] * world

    def observe(self, rank: int, sent_ns: int, received_ns: int, published_ns: int,
                arrived_ns: int) -> None:  # fmt: skip
        """One round trip of ``rank``: coordinator send and arrival, rank read and publish."""
        delay = max(0, (arrived_ns - sent_ns) - (published_ns - received_ns))
        offset = ((received_ns - sent_ns) + (published_ns - arrived_ns)) // 2
        samples = self._samples[rank]
        evicted = samples[0] if len(samples) == samples.maxlen else None
        samples.append((delay, offset))
        best = self._best_sample[rank]
        if best is None or (delay, offset) <= best:
            best = (delay, offset)
        elif evicted == best:  # the best sample left the window
            best = min(samples)
        self._best_sample[rank] = best
        self._best[rank] = ClockEstimate(best[1], best[0] // 2, len(samples), ROUND_TRIPS)

    def estimate(self, rank: int) -> ClockEstimate:
        return self._best[rank]
