"""What selection produces: an immutable plan, and the trace record of a commit.

:class:`TraceBuffer` holds a scheduler's records between drains; both the
coordinator's scheduler and direct mode's write theirs with :func:`commit_record`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

from runtime.catalog import GraphDescriptor
from runtime.coordinator.requests import RequestHandle


class SelectionReason(str, Enum):
    ORDINARY = "ordinary"  # the best value rate among measured candidates
    DISCOVERY = "discovery"  # an indeterminate (never measured) graph
    TIMING_REFRESH = "timing-refresh"  # a funded stale alternative displaced the winner
    ACCEPTANCE_LEARNING = "acceptance-learning"  # a funded acceptance probe


class LanePhase(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    # State-program rows (runtime.coordinator.state_ops): a resumed request's
    # restore, and a terminal request's retirement (its snapshot).
    RESTORE = "restore"
    TERMINAL = "terminal"
    # Image rows (runtime.coordinator.vision): a vision frame's request (its
    # images in ScheduledPlan.vision_images), and the two rows of a window
    # transition on SNAPSHOT and RESTORE programs (private: nothing published).
    VISION = "vision"
    WINDOW_SNAPSHOT = "window-snapshot"
    WINDOW_RESTORE = "window-restore"


@dataclass(frozen=True)
class VisionImage:
    """One image a vision frame encodes: request ``handle``'s span ``span``
    (``rows`` feature rows) written into window slot ``window_slot`` at feature
    offset ``offset`` (compact from zero within the request's window)."""

    handle: RequestHandle
    span: int
    window_slot: int
    offset: int
    rows: int
    digest: str


@dataclass(frozen=True)
class ImageRead:
    """An image a prefill chunk reads: lane ``lane``'s span ``span`` at prompt
    positions ``[position, position + rows)``, its features in window slot
    ``window_slot`` from feature offset ``offset``."""

    lane: int
    span: int
    position: int
    rows: int
    window_slot: int
    offset: int


@dataclass(frozen=True, init=False)
class LaneWork:
    """One request's row in a plan, frozen with the epoch it was planned against.

    ``prompt_start``/``prompt_tokens``: the prompt extent a prefill row consumes.
    ``output_start``: committed output the row starts from (its epoch).
    ``max_tokens``: the most tokens the row can commit; ``expected_tokens`` and
    ``expected_deliveries`` are what selection scored.
    """

    handle: RequestHandle
    slot: int
    generation: int
    phase: LanePhase
    prompt_start: int
    prompt_tokens: int
    output_start: int
    max_tokens: int
    expected_tokens: float
    expected_deliveries: float
    value: float  # unscaled lane value (priced service plus age value)

    def __init__(
        self, handle: RequestHandle, slot: int, generation: int, phase: LanePhase,
        prompt_start: int, prompt_tokens: int, output_start: int, max_tokens: int,
        expected_tokens: float, expected_deliveries: float, value: float,
    ) -> None:  # fmt: skip
        # Every field in one dict: the generated frozen __init__ sets them one
        # by one through object.__setattr__, a cost per lane of every plan.
        object.__setattr__(self, "__dict__", {
            "handle": handle, "slot": slot, "generation": generation, "phase": phase,
            "prompt_start": prompt_start, "prompt_tokens": prompt_tokens,
            "output_start": output_start, "max_tokens": max_tokens,
            "expected_tokens": expected_tokens, "expected_deliveries": expected_deliveries,
            "value": value,
        })  # fmt: skip

    @property
    def finishes_prompt(self) -> bool:
        return self.phase is LanePhase.PREFILL and self.max_tokens > 0


@dataclass(frozen=True)
class ScheduledPlan:
    plan_id: int
    graph: GraphDescriptor
    lanes: tuple[LaneWork, ...]
    estimated_duration_ns: int  # 0 = indeterminate
    reason: SelectionReason
    requires_empty_window: bool
    planned_at_ns: int
    expected_start_ns: int
    value_rate_scaled: float  # selection score times the decision's scale factor
    log_scale: float  # natural log of that positive factor
    useful_value: float  # unscaled expected useful value (priced service + age value)
    catalog_version: int
    # Vision frames: the images encoded, each into its window slot and offset;
    # prefill frames: the image spans their chunks read (runtime.coordinator.vision).
    vision_images: tuple[VisionImage, ...] = ()
    image_reads: tuple[ImageRead, ...] = ()

    def selection_value_rate(self) -> float:
        """The scaled selection score (value/ms for measured graphs, value if unknown)."""
        return self.value_rate_scaled

    def selection_log_scale(self) -> float:
        return self.log_scale

    @property
    def prompt_row(self) -> int:
        """Index of the lane that consumes prompt tokens (-1: none).

        A prefill plan's only lane; a mixed plan's prompt row, if it has one.
        """
        for i, lane in enumerate(self.lanes):
            if lane.phase is LanePhase.PREFILL:
                return i
        return -1

    def unscaled_value_rate(self) -> float:
        return self.value_rate_scaled / math.exp(self.log_scale)

    @property
    def padding(self) -> int:
        if self.vision_images:
            return self.graph.batch_capacity - len(self.vision_images)
        if self.graph.prompt_capacity:
            used = sum(lane.prompt_tokens for lane in self.lanes)
            return self.graph.prompt_capacity - used
        return self.graph.batch_capacity - len(self.lanes)


@dataclass(frozen=True)
class TraceRecord:
    fence: int
    committed_at_ns: int
    graph: str
    kind: str
    batch_capacity: int
    token_capacity: int
    proposal_depth: int
    target_capacity: int
    prompt_capacity: int
    active_rows: int
    selected_cost_ns: int
    observation_age_ns: int | None
    reason: str
    refresh_credit_ns: float
    learning_credit_ns: float
    value_rate_scaled: float
    log_scale: float
    requests: tuple[int, ...]
    prompt_row: int = -1  # index of the lane consuming prompt tokens, -1: none
    prompt_tokens: int = 0  # prompt tokens the frame consumes
    decode_rows: int = 0  # lanes that decode

    def to_json(self) -> dict:
        return dict(self.__dict__)


# Trace records kept between drains (older ones are dropped and counted).
TRACE_LIMIT = 65536


def commit_record(
    plan: ScheduledPlan,
    fence: int,
    now_ns: int,
    selected_cost_ns: int,
    observation_age_ns: int | None,
    refresh_credit_ns: float = 0.0,
    learning_credit_ns: float = 0.0,
) -> TraceRecord:
    """The trace record of committing ``plan`` as ``fence`` at ``now_ns``."""
    desc = plan.graph
    return TraceRecord(
        fence=fence,
        committed_at_ns=now_ns,
        graph=desc.describe(),
        kind=desc.kind.value,
        batch_capacity=desc.batch_capacity,
        token_capacity=desc.token_capacity,
        proposal_depth=desc.proposal_depth,
        target_capacity=desc.target_capacity,
        prompt_capacity=desc.prompt_capacity,
        active_rows=len(plan.lanes),
        selected_cost_ns=selected_cost_ns,
        observation_age_ns=observation_age_ns,
        reason=plan.reason.value,
        refresh_credit_ns=refresh_credit_ns,
        learning_credit_ns=learning_credit_ns,
        value_rate_scaled=plan.value_rate_scaled,
        log_scale=plan.log_scale,
        requests=tuple(lane.handle.id for lane in plan.lanes),
        prompt_row=plan.prompt_row,
        prompt_tokens=sum(lane.prompt_tokens for lane in plan.lanes),
        decode_rows=sum(1 for lane in plan.lanes if lane.phase is LanePhase.DECODE),
    )


class TraceBuffer:
    """Trace records since the last :meth:`drain`, bounded so that a runtime that
    never drains cannot grow without limit (``dropped`` counts the loss)."""

    def __init__(self, limit: int = TRACE_LIMIT) -> None:
        self._records: deque[TraceRecord] = deque(maxlen=limit)
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._records)

    def append(self, record: TraceRecord) -> None:
        if len(self._records) == self._records.maxlen:
            self.dropped += 1
        self._records.append(record)

    def drain(self) -> list[TraceRecord]:
        out = list(self._records)
        self._records.clear()
        return out

    def trim(self, keep: int) -> None:
        """Drop all but the newest ``keep`` undrained records (not counted as dropped:
        the caller reads none of them)."""
        while len(self._records) > keep:
            self._records.popleft()
