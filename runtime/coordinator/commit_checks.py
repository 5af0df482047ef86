"""Commit's rechecks of a plan's lanes (spec, "Planning and the execution queue":
"Commit checks ownership, epochs, resource availability, and feedback
dependencies without rerunning selection").  Each check raises CommitError
naming the request; nothing changes state.  Pure Python."""

from __future__ import annotations

from runtime.catalog import PREFILL_KINDS, GraphDescriptor, GraphKind
from runtime.coordinator.errors import CommitError
from runtime.coordinator.plan import LanePhase, LaneWork, ScheduledPlan
from runtime.coordinator.requests import Phase, Request
from runtime.image_spans import fit_chunk

# State programs (runtime.coordinator.state_ops) and the rows only they hold.
STATE_KINDS = frozenset({GraphKind.RESTORE, GraphKind.SNAPSHOT})
STATE_PHASES = frozenset({LanePhase.RESTORE, LanePhase.TERMINAL})


def check_shape(plan: ScheduledPlan) -> None:
    """The plan's lanes against its program's kind and capacities."""
    if not plan.lanes:
        raise CommitError("plan has no lanes")
    if len(plan.lanes) > plan.graph.batch_capacity:
        raise CommitError("plan has more lanes than its batch capacity")
    kind = plan.graph.kind
    prompt_rows = sum(1 for lane in plan.lanes if lane.phase is LanePhase.PREFILL)
    if kind in PREFILL_KINDS:
        if prompt_rows != len(plan.lanes):
            raise CommitError("every lane of a prefill plan is a prompt row")
        tokens = sum(lane.prompt_tokens for lane in plan.lanes)
        if tokens > plan.graph.prompt_capacity:
            raise CommitError(
                f"the prompt rows' {tokens} tokens exceed the prompt capacity "
                f"{plan.graph.prompt_capacity}"
            )
    if kind is GraphKind.DECODE and prompt_rows:
        raise CommitError("a decode plan has no prompt row")
    if kind is GraphKind.MIXED and prompt_rows > 1:
        raise CommitError(f"a mixed plan has at most one prompt row, got {prompt_rows}")
    if kind is GraphKind.MIXED and plan.graph.token_capacity > 1:
        rows = sum(lane.max_tokens for lane in plan.lanes if lane.phase is LanePhase.DECODE)
        if rows > plan.graph.target_capacity:
            raise CommitError(f"decode rows {rows} exceed the target capacity")
    if kind is GraphKind.SPECULATIVE:
        desc = plan.graph
        if prompt_rows:
            raise CommitError("a speculative plan has no prompt row")
        total = sum(lane.max_tokens for lane in plan.lanes)
        if not desc.device_allocated and total > desc.target_capacity:
            raise CommitError(
                f"the lanes' query lengths exceed the target capacity {desc.target_capacity}"
            )
        if any(lane.max_tokens > desc.proposal_depth + 1 for lane in plan.lanes):
            raise CommitError("a query length exceeds the proposal depth + 1")


def check_lane(lane: LaneWork, r: Request | None, graph: GraphDescriptor, capacity: int) -> Request:
    """An inference lane: its request still runnable at the planned epochs, its
    work within the request's state, its pages (``capacity`` tokens) holding what
    it writes."""
    if r is None or not r.runnable:
        raise CommitError(f"request {lane.handle.id} is no longer runnable")
    if (lane.slot, lane.generation) != (r.slot, r.generation):
        raise CommitError(f"request {lane.handle.id}: slot epoch changed")
    if lane.phase is LanePhase.PREFILL:
        context = lane.prompt_start + lane.prompt_tokens
    else:
        context = r.spec.prompt_len + lane.output_start - 1 + lane.max_tokens
    if context > capacity:
        raise CommitError(
            f"request {lane.handle.id}: the lane writes a context of {context} tokens, "
            f"its pages hold {capacity}"
        )
    if lane.phase is LanePhase.PREFILL:
        _check_prompt_row(lane, r, graph)
    else:
        _check_decode_row(lane, r, graph)
    return r


def _check_prompt_row(lane: LaneWork, r: Request, graph: GraphDescriptor) -> None:
    if r.phase is not Phase.PREFILL or r.inflight_fences:
        raise CommitError(f"request {lane.handle.id} cannot run a prefill chunk now")
    if (graph.kind is GraphKind.SCORED_PREFILL) != r.spec.score_prompt:
        # A scored prompt runs on scored prefill programs only, an unscored one never.
        scored = "a scored" if r.spec.score_prompt else "an unscored"
        raise CommitError(
            f"request {lane.handle.id}: {scored} prompt row on {graph.kind.value} "
            "(scored prompts run on scored prefill programs only)"
        )
    if lane.prompt_start != r.consumed_prompt:
        raise CommitError(f"request {lane.handle.id}: prompt epoch changed")
    if not 0 < lane.prompt_tokens <= r.prefill_available(lane.prompt_start):
        raise CommitError(f"request {lane.handle.id}: prompt extent out of range")
    if lane.prompt_tokens > graph.prompt_capacity:
        raise CommitError(f"request {lane.handle.id}: chunk exceeds prompt capacity")
    spans = r.spec.images  # atomic on any prompt row (prefill or a mixed program's)
    if spans and fit_chunk(spans, lane.prompt_start, lane.prompt_tokens) != lane.prompt_tokens:
        raise CommitError(f"request {lane.handle.id}: the chunk splits an image span")
    ends = lane.prompt_start + lane.prompt_tokens == r.prefill_target
    ends = ends and r.spec.max_output_tokens > 0  # (a request of no output commits none)
    if lane.max_tokens != (1 if ends else 0):
        raise CommitError(
            f"request {lane.handle.id}: a prompt row commits one token exactly "
            "when it ends the prompt"
        )


def _check_decode_row(lane: LaneWork, r: Request, graph: GraphDescriptor) -> None:
    if r.phase is not Phase.DECODE:
        raise CommitError(f"request {lane.handle.id} is not decoding")
    if lane.prompt_tokens or not 1 <= lane.max_tokens <= graph.token_capacity:
        raise CommitError(
            f"request {lane.handle.id}: a decode row takes no prompt tokens and "
            f"commits 1..{graph.token_capacity} tokens"
        )
    if lane.output_start != r.committed_output + r.inflight_output:
        raise CommitError(f"request {lane.handle.id}: output epoch changed")
    if r.inflight_fences and r.spec.step_feedback:
        raise CommitError(f"request {lane.handle.id} needs completion feedback")
    if r.remaining_output - r.inflight_output < lane.max_tokens:
        raise CommitError(f"request {lane.handle.id}: output limit reached")


def check_state_lane(lane: LaneWork, r: Request | None, kind: GraphKind, awaits: bool) -> Request:
    """A state program's row: a pending restore, or a request awaiting its
    snapshot (``awaits``: it waits for a state program now)."""
    if r is None or not awaits:
        raise CommitError(f"request {lane.handle.id} awaits no state program")
    if (lane.slot, lane.generation) != (r.slot, r.generation):
        raise CommitError(f"request {lane.handle.id}: slot epoch changed")
    if lane.phase is LanePhase.RESTORE:
        if kind is not GraphKind.RESTORE or not r.restore_pending:
            raise CommitError(f"request {lane.handle.id} has no restore to run")
        if lane.prompt_start != r.consumed_prompt:
            raise CommitError(f"request {lane.handle.id}: restore position changed")
    elif r.restore_pending:
        raise CommitError(f"request {lane.handle.id} is restoring, not terminal")
    return r
