"""What completion carries back, and what the scheduler hands to publication."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.coordinator.errors import CompletionError
from runtime.coordinator.requests import RequestHandle

if TYPE_CHECKING:
    from runtime.coordinator.plan import LaneWork

FINISH_REASONS = frozenset({"stop", "length"})

# A device-allocated round's FP32 confidence sidecar, [2, request_slots,
# draft_capacity] (checked by runtime.coordinator.sidecars).
Confidence = Sequence[Sequence[Sequence[float]]]


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
    cost sample only.  ``rank_launch_wait_ns``: each rank's wait for the others
    at the first collective, left out of the cost sample only.  ``host_wall_ns``:
    dispatch to observed completion at the coordinator.  ``queued``: the frame
    was dispatched behind another.
    """

    rank_device_ns: tuple[int, ...]
    readiness_delay_ns: int = 0
    host_wall_ns: int = 0
    queued: bool = False
    rank_launch_wait_ns: tuple[int, ...] = ()  # per rank, or empty: left out of the cost sample

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
    cached_tokens: int = 0  # prompt tokens its first residency found in the prefix cache


def validate_timing(timing: ExecutionTiming) -> None:
    """Raise CompletionError unless ``timing`` is well formed."""
    if not isinstance(timing, ExecutionTiming):
        raise CompletionError("timing must be an ExecutionTiming")
    ranks = timing.rank_device_ns
    if not isinstance(timing.queued, bool):
        raise CompletionError(f"timing.queued must be a bool, got {timing.queued!r}")
    if not isinstance(ranks, tuple) or not ranks:
        raise CompletionError("timing.rank_device_ns must be a non-empty tuple")
    waits = timing.rank_launch_wait_ns
    if not isinstance(waits, tuple) or len(waits) not in (0, len(ranks)):
        raise CompletionError("timing.rank_launch_wait_ns must be empty or one per rank")
    for name, value in [("rank_device_ns", v) for v in ranks] + [
        ("readiness_delay_ns", timing.readiness_delay_ns),
        ("host_wall_ns", timing.host_wall_ns),
        *[("rank_launch_wait_ns", w) for w in waits],
    ]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CompletionError(f"timing.{name} must be non-negative integers, got {value!r}")


def validate_records(
    fence: int,
    lanes: Sequence[LaneWork],
    records: Sequence[CompletionRecord],
    speculative: bool = False,
) -> None:
    """Raise CompletionError unless ``records`` match ``lanes`` one for one.

    A lane commits exactly ``max_tokens`` tokens, except in a speculative round
    (``speculative``), where it commits 1..``max_tokens``: the accepted
    proposals plus the correction or bonus token.
    """
    if not isinstance(records, (list, tuple)):
        raise CompletionError(f"fence {fence}: records must be a list or tuple")
    if len(records) != len(lanes):
        raise CompletionError(f"fence {fence}: {len(records)} records for {len(lanes)} lanes")
    for i, (lane, record) in enumerate(zip(lanes, records)):
        if not isinstance(record, CompletionRecord):
            raise CompletionError(f"fence {fence} lane {i}: not a CompletionRecord")
        if (record.slot, record.generation) != (lane.slot, lane.generation):
            raise CompletionError(
                f"fence {fence} lane {i}: record names slot {record.slot} "
                f"generation {record.generation}, lane is slot {lane.slot} "
                f"generation {lane.generation}"
            )
        tokens = record.tokens
        if not isinstance(tokens, (tuple, list)):
            raise CompletionError(f"fence {fence} lane {i}: tokens must be a sequence")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise CompletionError(f"fence {fence} lane {i}: bad token id {t!r}")
        if speculative and lane.max_tokens > 0:
            if not 1 <= len(tokens) <= lane.max_tokens:
                raise CompletionError(
                    f"fence {fence} lane {i}: {len(tokens)} tokens, "
                    f"a speculative lane commits 1..{lane.max_tokens}"
                )
        elif len(tokens) != lane.max_tokens:
            raise CompletionError(
                f"fence {fence} lane {i}: {len(tokens)} tokens, "
                f"lane commits exactly {lane.max_tokens}"
            )
        reason = record.finish_reason
        if reason is not None and (
            not isinstance(reason, str) or reason not in FINISH_REASONS or not tokens
        ):
            raise CompletionError(f"fence {fence} lane {i}: bad finish_reason {reason!r}")
