"""What completion carries back, and what the scheduler hands to publication."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.coordinator.requests import RequestHandle

FINISH_REASONS = frozenset({"stop", "length"})


@dataclass(frozen=True)
class CompletionRecord:
    """One lane's result, in the plan's lane order.

    ``tokens``: committed target tokens for that row (empty for a prefill chunk
    that does not reach the prompt end).  ``finish_reason``: "stop" when the rank
    saw a stop token; the scheduler itself finishes rows at the output limit.
    """

    slot: int
    generation: int
    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None


@dataclass(frozen=True)
class ExecutionTiming:
    """Timing of one frame.

    ``rank_device_ns``: each rank's replay interval (CUDA events or perf counter).
    ``readiness_delay_ns``: exposed embedding-delivery delay, subtracted from the
    cost sample only.  ``host_wall_ns``: dispatch to observed completion at the
    coordinator.  ``queued``: the frame was dispatched behind another.
    """

    rank_device_ns: tuple[int, ...]
    readiness_delay_ns: int = 0
    host_wall_ns: int = 0
    queued: bool = False

    @property
    def raw_device_ns(self) -> int:
        return max((ns for ns in self.rank_device_ns if ns > 0), default=0)

    @property
    def credited_ns(self) -> int:
        """Service/credit interval: device time if queued, else max(device, wall)."""
        raw = self.raw_device_ns
        return raw if self.queued else max(raw, self.host_wall_ns)


@dataclass(frozen=True)
class GeneratedToken:
    """Tokens one completion commits for one live request."""

    handle: RequestHandle
    fence: int
    tokens: tuple[int, ...]
    first: bool  # the request's first output
    finished: bool
    finish_reason: str | None
