"""What the engine needs from a scheduler: one stated interface.

The engine (:mod:`runtime.coordinator.engine`) drives a scheduler through
:class:`EngineScheduler` alone.  Two schedulers satisfy it: the coordinator's
:class:`~runtime.coordinator.scheduler.Scheduler` and direct mode's
:class:`~runtime.direct.scheduler.DirectScheduler` (``flare run --direct``),
which answers the members it has no notion of plainly (no generation starts,
no memory counters, no speculative rounds).

A completion goes to one of four methods, by what the frame's program sent
back: ``complete`` (no sidecars), ``complete_with_survival`` (a host-allocated
round's survival rows), ``complete_packed_round`` (a device-allocated round's
confidence sidecar) and ``complete_packed_round_with_survival`` (both).  The
engine chooses among them in one place (``runtime.coordinator.engine.completions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.plan import ScheduledPlan, SelectionReason, TraceRecord
from runtime.coordinator.records import (
    CompletionRecord,
    Confidence,
    ExecutionTiming,
    GeneratedToken,
)
from runtime.coordinator.requests import GenerationStart, RequestHandle, RequestSpec


class CostEstimates(Protocol):
    """A scheduler's cost catalog, as the engine reads it."""

    def estimates(self) -> dict[str, int]:
        """Each program's current duration estimate in ns (0: not measured yet)."""
        ...


@runtime_checkable
class EngineScheduler(Protocol):
    """Everything the engine calls or reads on its scheduler."""

    config: SchedulerConfig

    @property
    def catalog(self) -> CostEstimates:
        """The scheduler's cost catalog (read-only here: each scheduler keeps its own kind)."""
        ...

    executions: dict[SelectionReason, int]  # frames applied, by execution class
    execution_ns: dict[SelectionReason, int]  # their charged nanoseconds

    # ---------------------------------------------------------------- the loop
    def advance_to(self, now_ns: int) -> None: ...

    def admit(self, spec: RequestSpec) -> RequestHandle: ...

    def cancel(self, handle: RequestHandle) -> bool: ...

    def plan(self) -> ScheduledPlan | None: ...

    def commit(self, plan: ScheduledPlan, fence: int) -> None: ...

    def complete(
        self, fence: int, records: Sequence[CompletionRecord], timing: ExecutionTiming
    ) -> list[GeneratedToken]: ...

    def complete_with_survival(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        survival: Sequence[Sequence[float]],
    ) -> list[GeneratedToken]: ...

    def complete_packed_round(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        confidence: Confidence,
    ) -> list[GeneratedToken]: ...

    def complete_packed_round_with_survival(
        self,
        fence: int,
        records: Sequence[CompletionRecord],
        timing: ExecutionTiming,
        confidence: Confidence,
        survival: Sequence[Sequence[float]],
    ) -> list[GeneratedToken]: ...

    def published_output(
        self, handle: RequestHandle, fence: int, at_ns: int | None = None
    ) -> bool: ...

    # ---------------------------------------------------------------- requests
    def request(self, handle: RequestHandle) -> object | None:
        """The live request (any object), or None once it is retired."""
        ...

    def page_table(self, handle: RequestHandle) -> list[int]: ...

    def generation_start(self, handle: RequestHandle) -> GenerationStart | None:
        """How the request's current generation begins on the ranks (None: plainly)."""
        ...

    # ---------------------------------------------------------------- readings
    def drain_trace(self) -> list[TraceRecord]: ...

    def trim_trace(self, keep: int) -> None: ...

    def memory_stats(self) -> dict[str, int]:
        """KV memory counters for the metrics (empty: none)."""
        ...

    @property
    def in_flight(self) -> int: ...

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def free_pages(self) -> int: ...
