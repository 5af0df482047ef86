"""What a speculative round's completion carries beyond its tokens (spec,
"Completed confidence and acceptance", "Planning and the execution queue").

* The confidence sidecar of a device-allocated program: FP32, shape
  [2, request_slots, draft_capacity], row i the plan's lane i (request_slots
  >= lanes: the program's rows), column d - 1 the prefix of d proposals.
  Plane 0 holds each proposal's conditional confidence, plane 1 the joint
  prefix probability (the running product), the value the program allocated
  its rows by.  Every value must be a probability.
* Survival rows (``completion_speculative_survival``), per lane: cumulative
  products of min(1, p/q) for the prefixes the round evaluated, non-increasing;
  they replace the binary acceptance observations at those depths.

:func:`round_offers` gives what each lane of a completed round offered: its
query length for a host-allocated program; for a device-allocated one the
allocation recomputed from plane 1 (:func:`runtime.coordinator.rounds.device_allocation`,
the program's own rule), so the host learns acceptance from exactly the
prefixes that were verified.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

from runtime.coordinator.errors import CompletionError
from runtime.coordinator.plan import ScheduledPlan
from runtime.coordinator.records import CompletionRecord, Confidence
from runtime.coordinator.rounds import device_allocation


def _probabilities(fence: int, name: str, values: object, length: int | None = None) -> list:
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise CompletionError(f"fence {fence}: {name} must be a sequence")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise CompletionError(f"fence {fence}: {name} holds {v!r}, not a probability")
        if not 0.0 <= v <= 1.0:
            raise CompletionError(f"fence {fence}: {name} holds {v!r}, outside [0, 1]")
        out.append(float(v))
    if length is not None and len(out) != length:
        raise CompletionError(f"fence {fence}: {name} has {len(out)} values, expected {length}")
    return out


def check_confidence(fence: int, plan: ScheduledPlan, confidence: Confidence) -> list[list[float]]:
    """Validate a confidence sidecar against ``plan``; the joint prefix
    probabilities of each lane (plane 1)."""
    depth = plan.graph.proposal_depth
    if not isinstance(confidence, Sequence) or len(confidence) != 2:
        raise CompletionError(f"fence {fence}: the confidence sidecar needs 2 planes")
    joint: list[list[float]] = []
    for plane_index, plane in enumerate(confidence):
        if not isinstance(plane, Sequence) or len(plane) < len(plan.lanes):
            raise CompletionError(
                f"fence {fence}: confidence plane {plane_index} needs a row per lane "
                f"({len(plan.lanes)})"
            )
        for row_index, row in enumerate(plane):
            name = f"confidence[{plane_index}][{row_index}]"
            values = _probabilities(fence, name, row, depth)
            if plane_index == 1 and row_index < len(plan.lanes):
                joint.append(values)
    return joint


def check_survival(
    fence: int, plan: ScheduledPlan, survival: Sequence[Sequence[float]]
) -> list[list[float]]:
    """Validate survival rows: one per lane, non-increasing probabilities."""
    if not isinstance(survival, Sequence) or len(survival) != len(plan.lanes):
        raise CompletionError(f"fence {fence}: survival needs one row per lane")
    rows = []
    for i, row in enumerate(survival):
        values = _probabilities(fence, f"survival[{i}]", row)
        if len(values) > plan.graph.proposal_depth:
            raise CompletionError(f"fence {fence}: survival[{i}] is longer than the depth")
        if any(b > a for a, b in pairwise(values)):
            raise CompletionError(f"fence {fence}: survival[{i}] must not increase")
        rows.append(values)
    return rows


def round_offers(
    fence: int,
    plan: ScheduledPlan,
    records: Sequence[CompletionRecord],
    joint: list[list[float]] | None,
) -> list[int]:
    """Target rows each lane used (offered proposals + 1); raises when a lane
    committed more tokens than that."""
    if plan.graph.device_allocated:
        assert joint is not None
        ceilings = [lane.max_tokens for lane in plan.lanes]
        slots = [lane.slot for lane in plan.lanes]
        rows = device_allocation(joint, ceilings, slots, plan.graph.target_capacity)
    else:
        rows = [lane.max_tokens for lane in plan.lanes]
    for i, (record, q) in enumerate(zip(records, rows)):
        if len(record.tokens) > q:
            raise CompletionError(
                f"fence {fence} lane {i}: {len(record.tokens)} tokens from {q} allocated rows"
            )
    return rows
