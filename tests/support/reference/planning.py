"""``Scheduler.plan()`` over the reference selection (see ``__init__``), and the
comparison the differential test makes."""

from __future__ import annotations

import math

from runtime.catalog import GraphDescriptor
from runtime.coordinator.plan import LanePhase, LaneWork, ScheduledPlan, SelectionReason
from runtime.coordinator.scheduler import Scheduler
from runtime.coordinator.utility import log_scale_for
from tests.support.reference.learning import choose_probe
from tests.support.reference.packing import packed_prefill_candidates
from tests.support.reference.policy import (
    Candidate,
    LaneView,
    SelectionContext,
    best,
    candidates,
    prompt_lane_value,
)
from tests.support.reference.projection import CatalogView, build_context
from tests.support.reference.refresh import choose_refresh
from tests.support.reference.rounds import (
    complete_prefix_value,
    expected_tokens,
    round_candidates,
    speculative_candidates,
)
from tests.support.reference.state_ops import RESTORE as RESTORE_ROLE
from tests.support.reference.state_ops import state_candidates


def reference_plan(s: Scheduler) -> ScheduledPlan | None:
    """What ``s.plan()`` chose before selection was made fast (its plan_id is 0)."""
    if not s._queue.accepts_queued(s.now_ns):
        return None
    ctx = _context(s)
    if ctx is None:
        return None
    cands = _candidates(s, ctx)
    winner = best(cands)
    if winner is None:
        return None
    reason = SelectionReason.DISCOVERY if winner.unknown else SelectionReason.ORDINARY
    alternative = choose_refresh(cands, winner, s.refresh_ledger)
    if alternative is not None:
        winner, reason = alternative, SelectionReason.TIMING_REFRESH
    else:
        probe = _probe(s, ctx, winner)
        if probe is not None:
            winner, reason = probe, SelectionReason.ACCEPTANCE_LEARNING
    requires_empty = winner.requires_feedback or reason in (
        SelectionReason.TIMING_REFRESH,
        SelectionReason.ACCEPTANCE_LEARNING,
    )
    if requires_empty and not s._queue.empty:
        return None
    log_scale = log_scale_for(max(abs(c.value) for c in cands))
    return _build_plan(s, winner, reason, requires_empty, ctx, log_scale)


def _context(s: Scheduler) -> SelectionContext | None:
    runnable, terminal, restoring = [], [], []
    for r in s._resident.values():
        if r.runnable:
            runnable.append(r)
        elif s._awaits_state_program(r):
            (restoring if r.restore_pending else terminal).append(r)
    terminal.sort(key=lambda r: (r.terminal_since_ns or 0, r.handle.id))
    return build_context(
        s.now_ns, runnable, s._queue, s.policy, s.catalog, CatalogView(s.catalog),
        s.config.page_size, terminal, restoring,
    )  # fmt: skip


def _candidates(s: Scheduler, ctx: SelectionContext) -> list[Candidate]:
    cands = candidates(ctx)
    packed_prefill_candidates(ctx, cands)
    fixed = s._fixed_width
    if ctx.states is not None:
        rounds = s.speculation is not None and fixed != 1

        def round_value(lane: LaneView, desc: GraphDescriptor) -> float:
            alpha = s.policy.adaptive_verification_alpha
            return complete_prefix_value(
                lane, desc, _survival(s), alpha, s.policy.output_token_value
            )

        state_candidates(ctx, ctx.states, s.policy, cands, round_value if rounds else None, fixed)
    if s.speculation is not None and fixed != 1:
        round_candidates(
            ctx, cands, _survival(s), s.policy.adaptive_verification_alpha, fixed, _forecast(s)
        )
        if fixed > 1:
            cands = [c for c in cands if _fixed_width_allows(c, fixed)]
    return cands


def _fixed_width_allows(candidate: Candidate, width: int) -> bool:
    from runtime.catalog import GraphKind

    desc = candidate.entry.descriptor
    if desc.kind is GraphKind.DECODE:
        return False
    if desc.kind is GraphKind.MIXED and desc.token_capacity != width:
        return candidate.prompt_row >= 0 and len(candidate.lanes) == 1
    return True


def _survival(s: Scheduler):
    def survival(lane: LaneView, depth: int) -> list[float]:
        state = lane.request.speculation
        if state is None or depth <= 0:
            return []
        return state.acceptance(s.config.proposer).means(depth)

    return survival


def _forecast(s: Scheduler):
    def forecast(lane: LaneView, depth: int) -> list[float]:
        state = lane.request.speculation
        return [] if state is None or depth <= 0 else state.forecast.means(depth)

    return forecast


def _optimistic(s: Scheduler):
    def optimistic(lane: LaneView, depth: int) -> list[float]:
        state = lane.request.speculation
        if state is None or depth <= 0:
            return []
        return state.acceptance(s.config.proposer).optimistic(depth)

    return optimistic


def _probe(s: Scheduler, ctx: SelectionContext, winner: Candidate) -> Candidate | None:
    if s.speculation is None or s._fixed_width or not s.learning_ledger.can_open():
        return None
    optimistic: list[Candidate] = []
    speculative_candidates(
        ctx, optimistic, _optimistic(s), s.policy.adaptive_verification_alpha, 0, _forecast(s)
    )
    source = s.config.proposer

    def weight(cand: Candidate, i: int, depth: int) -> float:
        state = cand.lanes[i].request.speculation
        assert state is not None
        return state.acceptance(source).weight(depth)

    return choose_probe(optimistic, winner, s.learning_ledger, weight)


def _build_plan(
    s: Scheduler,
    winner: Candidate,
    reason: SelectionReason,
    requires_empty: bool,
    ctx: SelectionContext,
    log_scale: float,
) -> ScheduledPlan:
    lanes = [_lane_work(s, winner, i, view, ctx) for i, view in enumerate(winner.lanes)]
    return ScheduledPlan(
        plan_id=0,
        graph=winner.entry.descriptor,
        lanes=tuple(lanes),
        estimated_duration_ns=winner.entry.estimate_ns,
        reason=reason,
        requires_empty_window=requires_empty,
        planned_at_ns=ctx.now_ns,
        expected_start_ns=ctx.start_ns,
        value_rate_scaled=winner.score * math.exp(log_scale),
        log_scale=log_scale,
        useful_value=winner.value + winner.age_slope * winner.t_ms,
        catalog_version=s.catalog.version,
    )


def _lane_work(
    s: Scheduler, winner: Candidate, i: int, view: LaneView, ctx: SelectionContext
) -> LaneWork:
    r = view.request
    if winner.chunks is not None:
        return _prompt_work(view, winner.chunks[i], ctx.beta)
    roles = winner.roles or ()
    if roles:
        phase = LanePhase.RESTORE if roles[i] == RESTORE_ROLE else LanePhase.TERMINAL
        return LaneWork(
            r.handle, r.slot, r.generation, phase, r.consumed_prompt, 0,
            r.committed_output, 0, 0.0, 0.0, 0.0,
        )  # fmt: skip
    queries, ceilings = winner.queries, winner.ceilings
    if queries is not None and i != winner.prompt_row:
        q = queries[i]
        rows = q if ceilings is None else ceilings[i]
        return LaneWork(
            r.handle, r.slot, r.generation, LanePhase.DECODE, r.spec.prompt_len, 0,
            view.output_start, rows, expected_tokens(_survival(s)(view, q - 1), q),
            1.0, view.decode_value + ctx.decode_age_slope * winner.t_ms,
        )  # fmt: skip
    if i == winner.prompt_row:
        return _prompt_work(view, winner.prompt_tokens, ctx.beta)
    return LaneWork(
        r.handle, r.slot, r.generation, LanePhase.DECODE, r.spec.prompt_len, 0,
        view.output_start, 1, 1.0, 1.0, view.decode_value + ctx.decode_age_slope * winner.t_ms,
    )  # fmt: skip


def _prompt_work(view: LaneView, tokens: int, beta: float) -> LaneWork:
    r = view.request
    finishes = view.prompt_pos + tokens == r.prefill_target
    return LaneWork(
        r.handle, r.slot, r.generation, LanePhase.PREFILL, view.prompt_pos, tokens,
        view.output_start, 1 if finishes else 0, 1.0 if finishes else 0.0, 0.0,
        prompt_lane_value(view, tokens, beta),
    )  # fmt: skip


REL = 1e-9


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


def plan_differences(fast: ScheduledPlan | None, ref: ScheduledPlan | None) -> list[str]:
    """Where ``fast`` departs from the reference plan ``ref`` (empty: none)."""
    if fast is None or ref is None:
        return [] if fast is ref else [f"plan {fast!r} != reference {ref!r}"]
    out = []
    for name in ("graph", "reason", "requires_empty_window", "estimated_duration_ns",
                 "planned_at_ns", "expected_start_ns", "catalog_version"):  # fmt: skip
        a, b = getattr(fast, name), getattr(ref, name)
        if a != b:
            out.append(f"{name}: {a!r} != reference {b!r}")
    if len(fast.lanes) != len(ref.lanes):
        out.append(f"lanes: {len(fast.lanes)} != reference {len(ref.lanes)}")
    for i, (a, b) in enumerate(zip(fast.lanes, ref.lanes)):
        for name in ("handle", "slot", "generation", "phase", "prompt_start", "prompt_tokens",
                     "output_start", "max_tokens"):  # fmt: skip
            if getattr(a, name) != getattr(b, name):
                out.append(f"lane {i} {name}: {getattr(a, name)!r} != {getattr(b, name)!r}")
        for name in ("expected_tokens", "expected_deliveries", "value"):
            if not _close(getattr(a, name), getattr(b, name)):
                out.append(f"lane {i} {name}: {getattr(a, name)!r} != {getattr(b, name)!r}")
    for name in ("value_rate_scaled", "log_scale", "useful_value"):
        a, b = getattr(fast, name), getattr(ref, name)
        if not _close(a, b):
            out.append(f"{name}: {a!r} != reference {b!r}")
    return out
