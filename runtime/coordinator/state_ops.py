"""State-operation candidates: terminal snapshots and restore prerequisites
(spec, "Prerequisites and completion"; docs/checkpoints.md, docs/prerequisites.md).

* **Terminal snapshots.**  A request that finished (or that preemption
  retires) waits, holding its slot and pages, for a SNAPSHOT program (or a
  RESTORE program's spare row) to retire it: that publishes its pages in the
  prefix cache, frees them, and completes its response visibly.  A terminal
  lane of a graph of duration T is worth ``terminal_value +
  terminal_age_price * sigma * (A + T)``, sigma the snapshot family's
  batch-feasible reference interval, A its terminal age; the cohort of a
  snapshot program of capacity B is the B oldest terminal requests.  Terminal
  work competes through the same value per time as inference.
* **Restore prerequisites.**  A preempted request resumes with a new
  generation whose RESTORE row binds its cached pages, runs its copies and
  restores its step, penalties and history.  It is then *decode-ready* (its
  pages hold everything but its pending token: the row leaves that token
  pending) or *prompt-ready* (it recomputes the rest by prefill).  Every pair
  of a RESTORE shape and a following inference shape is scored jointly:
  :func:`runtime.coordinator.prerequisites.best_pair` chooses, for fixed
  shapes, the newly ready rows the following graph serves, the already ready
  rows beside them and the terminal rows filling the restore's spare rows, and
  the two-stage sequence is scored over T + F (or its productive first stage
  over T).  Following shapes: decode; every mixed shape with the prompt row
  absent, the best already ready one, or one enabled by the restore (a
  prompt-ready request); prefill of a prompt-ready request; a packed prefill
  serving k >= 1 prompt-ready requests beside the already ready prompt rows
  (C shared: the packing search, :func:`_packed_pair`); and, when the
  deployment speculates, the rectangular host-allocated speculative programs.
  An unmeasured following shape whose cohort a smaller shape of its family
  holds does not follow (:mod:`runtime.coordinator.exploration`).  A
  prompt-ready request with images still to encode is a longer chain: F adds
  its chunk's vision frames (:func:`~runtime.coordinator.window_select.chunk_encode_ms`).
  The restore's spare rows restore further prompt-ready requests at no extra
  physical cost (worth nothing in this lookahead, like decode-ready rows
  advanced).
  On a round program (speculative, or mixed wider than one) a decoder is worth
  its complete prefix (``RoundValue``).  Ragged and device-allocated programs
  do not follow: their lanes share a row budget P, so lane values are not
  additive and the spec's fixed-pair calculation does not hold for them (the
  rectangular program of the same width and batch stands in).  Under fixed
  width only shapes that may run follow: no decode, mixed shapes of another
  width as prompt-only rows, speculative programs of that width.  Only the
  restore executes; the plan keeps its own duration T (lookahead time never
  enters timing or cost learning).

Pure Python: no torch, sockets or clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PolicyConfig
from runtime.coordinator.cost import CostEntry
from runtime.coordinator.exploration import dominated_unmeasured
from runtime.coordinator.packing import PromptRows
from runtime.coordinator.policy import (
    Candidate,
    LaneView,
    SelectionContext,
    fit_tokens,
    prompt_lane_value,
)
from runtime.coordinator.prerequisites import (
    PairChoice,
    best_pair,
    following_contribution,
    graph_score,
    sequence_rate,
    terminal_contribution,
    terminal_sequence_contribution,
)
from runtime.coordinator.utility import reference_interval_ms
from runtime.coordinator.window_select import chunk_encode_ms, encode_ms, pending_images

TERMINAL = "terminal"
RESTORE = "restore"

# A decoder's value on a round program (speculative, or mixed wider than one) at
# its complete prefix: its decode value plus its scored proposal rows.
RoundValue = Callable[[LaneView, GraphDescriptor], float]


@dataclass(slots=True)
class StateViews:
    """The state-operation population of one decision.

    ``terminal``: requests awaiting retirement, oldest first, with their
    terminal ages (ms, at the planning start).  ``decode_ready``: resumed
    requests whose restore leaves them decoding, each with its lane as a
    decoder.  ``prompt_ready``: resumed requests whose restore leaves them
    prefilling, each with its lane as a prompt row.  ``sigma_ms``: the
    snapshot family's reference interval for the terminal population.
    """

    terminal: list[tuple[LaneView, float]]
    decode_ready: list[LaneView]
    prompt_ready: list[LaneView]
    sigma_ms: float

    @property
    def empty(self) -> bool:
        return not (self.terminal or self.decode_ready or self.prompt_ready)


def snapshot_sigma_ms(ctx: SelectionContext, terminals: int) -> float:
    """sigma of the snapshot family (SNAPSHOT programs, and RESTORE programs whose
    rows can retire) for ``terminals`` terminal requests; 0 when unmeasured."""
    graphs = [
        (e.estimate_ns / 1e6, e.descriptor.batch_capacity)
        for kind in (GraphKind.SNAPSHOT, GraphKind.RESTORE)
        for e in ctx.catalog.entries(kind)
        if e.known
    ]
    return reference_interval_ms(graphs, terminals, terminals)


def state_candidates(
    ctx: SelectionContext,
    states: StateViews,
    policy: PolicyConfig,
    out: list[Candidate],
    round_value: RoundValue | None = None,
    fixed_width: int = 0,
) -> None:
    """Snapshot candidates and, per restore shape, its best pair, appended to ``out``.
    ``round_value``: decoders' values on round programs (None: the deployment
    does not speculate, no round program follows); ``fixed_width``: fixed-width
    execution at that width (0: adaptive)."""
    if states.empty:
        return
    tv, p, sigma = policy.terminal_value, policy.terminal_age_price, states.sigma_ms
    terminals = states.terminal
    for index, entry in enumerate(ctx.catalog.entries(GraphKind.SNAPSHOT)):
        if not terminals:
            break
        batch = entry.descriptor.batch_capacity
        cohort = terminals[:batch]
        value = sum(tv + p * sigma * age for _, age in cohort)
        cand = Candidate(
            entry, index, [v for v, _ in cohort], value, p * sigma * len(cohort),
            batch - len(cohort), 0, 0, ctx,
        )  # fmt: skip
        cand.roles = [TERMINAL] * len(cohort)
        out.append(cand)
        if batch >= len(terminals):
            break  # larger capacities only pad
    if not (states.decode_ready or states.prompt_ready):
        return
    follows = list(_follows(ctx, states, round_value is not None, fixed_width))
    for index, prereq in enumerate(ctx.catalog.entries(GraphKind.RESTORE)):
        best: Candidate | None = None
        for cand in _pairs(ctx, states, policy, prereq, index, follows, round_value):
            if best is None or cand.rank_key() > best.rank_key():
                best = cand
        if best is not None:
            out.append(best)


@dataclass(frozen=True, slots=True)
class _Follow:
    """A following shape and the prompt row it carries (None: no prompt row)."""

    entry: CostEntry
    rows: int  # its batch capacity (every row: prompt and decoders)
    decoders: bool  # whether its other rows may decode
    prompt: LaneView | None = None
    enabled: bool = False  # the prompt row is made ready by the restore
    rounds: bool = False  # its decoders run complete prefixes (RoundValue)
    packed: bool = False  # a packed prefill: restored prompt rows and ready ones share C


def _follows(ctx: SelectionContext, states: StateViews, speculating: bool, fixed_width: int):
    """The following shapes, with their prompt rows (module docstring)."""
    catalog = ctx.catalog
    if fixed_width <= 1:
        for entry in catalog.entries(GraphKind.DECODE):
            yield _Follow(entry, entry.descriptor.batch_capacity, True)
    for entry in catalog.entries(GraphKind.MIXED):
        desc = entry.descriptor
        wide = desc.token_capacity > 1
        if wide and not speculating:
            continue
        # Fixed width: a mixed shape of another width runs prompt-only rows.
        decoders = fixed_width <= 1 or desc.token_capacity == fixed_width
        rows = desc.batch_capacity if decoders else 1
        if decoders:
            yield _Follow(entry, rows, True, rounds=wide)  # the prompt absent
        ready = _best_ready_row(ctx, desc.prompt_capacity)
        if ready is not None:  # the best already ready prompt row
            yield _Follow(entry, rows, decoders, ready, rounds=wide)
        for lane in states.prompt_ready:  # a prompt row the restore enables
            if getattr(lane.request, "vision", None) is None:  # (images: prefill only)
                yield _Follow(entry, rows, decoders, lane, True, rounds=wide)
    if speculating:
        for entry in catalog.entries(GraphKind.SPECULATIVE):
            desc = entry.descriptor
            b, w = desc.batch_capacity, desc.token_capacity
            if desc.device_allocated or desc.target_capacity < b * w:
                continue  # a shared row budget: lane values are not additive
            if not fixed_width or w == fixed_width:
                yield _Follow(entry, b, True, rounds=True)
    restored = len(_packable(states))  # (k >= 1 of them, with the ready prompt rows >= 2)
    packable = restored >= 1 and restored + len(ctx.prompt_rows(GraphKind.PREFILL)) >= 2
    for entry in catalog.entries(GraphKind.PREFILL):
        if entry.descriptor.batch_capacity > 1:
            if packable:  # k restored rows (and ready ones) share C
                yield _Follow(entry, entry.descriptor.batch_capacity, False, packed=True)
            continue
        for lane in states.prompt_ready:
            yield _Follow(entry, 1, False, lane, True)


def _packable(states: StateViews) -> list[LaneView]:
    """The prompt-ready rows a packed PREFILL program may serve (unscored)."""
    return [v for v in states.prompt_ready if not v.request.spec.score_prompt]


def _best_ready_row(ctx: SelectionContext, capacity: int) -> LaneView | None:
    """The already ready prompt row worth most on a mixed shape of ``capacity``
    prompt tokens (its value does not depend on the decoders beside it; ties: the
    less recently served, then the first resident)."""
    best, best_key = None, None
    for lane in ctx.prefill + ctx.imaged if ctx.imaged else ctx.prefill:
        tokens = fit_tokens(lane, min(lane.available, capacity))  # (image spans whole)
        if tokens <= 0:
            continue
        key = (prompt_lane_value(lane, tokens, ctx.beta), -lane.lru)
        if best_key is None or key > best_key:
            best, best_key = lane, key
    return best


# A forced newly ready row (an enabled prompt row) sorts first in best_pair.
_FORCED = 1e30


def _pairs(
    ctx: SelectionContext,
    states: StateViews,
    policy: PolicyConfig,
    prereq: CostEntry,
    index: int,
    follows: list[_Follow],
    round_value: RoundValue | None,
):
    """Each following shape's exact best joint cohort with ``prereq``, as a candidate."""
    t_ms = prereq.estimate_ns / 1e6 if prereq.known else 0.0
    tv, p, sigma = policy.terminal_value, policy.terminal_age_price, states.sigma_ms
    slope = ctx.decode_age_slope
    for follow in follows:
        if follow.packed:
            cand = _packed_pair(ctx, states, policy, prereq, index, follow.entry, t_ms)
            if cand is not None:
                yield cand
            continue
        f_ms = follow.entry.estimate_ns / 1e6 if follow.entry.known else 0.0
        extra = 0.0
        rows = follow.rows
        prompt = follow.prompt
        tokens = 0
        if prompt is not None:
            tokens = fit_tokens(
                prompt, min(prompt.available, follow.entry.descriptor.prompt_capacity)
            )
            extra = prompt_lane_value(prompt, tokens, ctx.beta)
            if follow.enabled and f_ms > 0.0:  # a chain: its images are encoded first
                encode = chunk_encode_ms(ctx.catalog.entries(GraphKind.VISION), prompt, tokens)
                f_ms = 0.0 if encode is None else f_ms + encode
        newly: list[float] = []
        ready: list[float] = []
        if follow.decoders:
            desc = follow.entry.descriptor
            if follow.rounds:
                assert round_value is not None  # round shapes follow only when speculating
                newly = [round_value(v, desc) for v in states.decode_ready]
                ready = [round_value(v, desc) for v in ctx.decode]
            else:
                newly = [v.decode_value for v in states.decode_ready]
                ready = [v.decode_value for v in ctx.decode]
            newly = [following_contribution(x, slope, t_ms, f_ms) for x in newly]
            ready = [following_contribution(x, slope, t_ms, f_ms) for x in ready]
        term = [terminal_sequence_contribution(tv, p, sigma, age, t_ms, f_ms)
                for _, age in states.terminal]  # fmt: skip
        if follow.enabled:  # the prompt row is the newly ready row that must participate
            choice = best_pair([_FORCED, *newly], ready, term, prereq.descriptor.batch_capacity,
                               rows)  # fmt: skip
            offset = 1
        else:
            if prompt is not None:
                rows -= 1
            choice = best_pair(newly, ready, term, prereq.descriptor.batch_capacity, rows)
            offset = 0
        if choice is None:
            continue
        family = ctx.catalog.entries(follow.entry.descriptor.kind)
        served = choice.following_rows + (prompt is not None and not follow.enabled)
        if dominated_unmeasured(family, follow.entry, served, tokens):
            continue  # (runtime.coordinator.exploration)
        restored: list[LaneView] = []
        for i in (*choice.newly_ready, *choice.advanced):
            if offset and i == 0:
                assert prompt is not None  # the enabled prompt row is newly ready row 0
                restored.append(prompt)
            else:
                restored.append(states.decode_ready[i - offset])
        restored += _spare_prompt_rows(states, restored, spare(prereq, restored, choice))
        total = choice.value - (_FORCED if offset else 0.0) + extra
        yield _candidate(ctx, prereq, index, t_ms, f_ms, states, choice, restored, total, policy)


def _packed_pair(
    ctx: SelectionContext,
    states: StateViews,
    policy: PolicyConfig,
    prereq: CostEntry,
    index: int,
    follow: CostEntry,
    t_ms: float,
) -> Candidate | None:
    """The restore ``prereq`` followed by the packed prefill ``follow``: ``k >= 1``
    restored prompt rows (at most the restore's rows, the most valuable on C)
    and already ready prompt rows share its C tokens, chosen by the packing
    search (``packing.PromptRows``, as packed prefill itself); the restore's
    other rows finish the terminal rows worth most.  F is the prefill's time
    plus the vision frames of the restored rows' images its chunks read."""
    desc = follow.descriptor
    batch, capacity = desc.batch_capacity, desc.prompt_capacity
    cap = prereq.descriptor.batch_capacity
    newly = _packable(states)
    if len(newly) > cap:
        worth = [(prompt_lane_value(v, fit_tokens(v, min(v.available, capacity)), ctx.beta), v)
                 for v in newly]  # fmt: skip
        worth.sort(key=lambda item: (-item[0], item[1].lru, item[1].request.handle.id))
        newly = [v for _, v in worth[:cap]]
    value, cohort, chunks = PromptRows(newly + ctx.prompt_rows(GraphKind.PREFILL), ctx.beta).best(
        batch, capacity
    )
    picked = [(i, chunk) for i, chunk in zip(cohort, chunks) if i < len(newly)]
    if not picked:
        return None
    family = ctx.catalog.entries(GraphKind.PREFILL)
    if dominated_unmeasured(family, follow, len(cohort), sum(chunks)):
        return None  # (runtime.coordinator.exploration)
    f_ms = follow.estimate_ns / 1e6 if follow.known else 0.0
    if f_ms > 0.0:  # the restored rows' images are encoded first
        images = sum(pending_images(newly[i], chunk) for i, chunk in picked)
        encode = encode_ms(ctx.catalog.entries(GraphKind.VISION), images)
        f_ms = 0.0 if encode is None else f_ms + encode
    tv, p, sigma = policy.terminal_value, policy.terminal_age_price, states.sigma_ms
    term = sorted(
        ((terminal_sequence_contribution(tv, p, sigma, age, t_ms, f_ms), i)
         for i, (_, age) in enumerate(states.terminal)),
        key=lambda item: (-item[0], item[1]),
    )  # fmt: skip
    term = [(x, i) for x, i in term if x > 0.0][: cap - len(picked)]
    total = value + sum(x for x, _ in term)
    choice = PairChoice(len(picked), (), (), tuple(i for _, i in term), (), total)
    restored = [newly[i] for i, _ in picked]
    restored += _spare_prompt_rows(states, restored, spare(prereq, restored, choice))
    return _candidate(ctx, prereq, index, t_ms, f_ms, states, choice, restored, total, policy)


def spare(prereq: CostEntry, restored: list[LaneView], choice: PairChoice) -> int:
    """The restore's rows left after its restored and terminal rows."""
    return prereq.descriptor.batch_capacity - len(restored) - len(choice.terminal)


def _spare_prompt_rows(states: StateViews, restored: list[LaneView], rows: int) -> list[LaneView]:
    """Prompt-ready rows the restore's spare rows advance at no extra physical
    cost (spec: "Unused prerequisite capacity can advance additional rows";
    worth nothing in this lookahead, like ``PairChoice.advanced``): those not
    restored already, in resident order."""
    if rows <= 0 or not states.prompt_ready:
        return []
    taken = {view.request.handle.id for view in restored}
    return [v for v in states.prompt_ready if v.request.handle.id not in taken][:rows]


def _candidate(
    ctx: SelectionContext,
    prereq: CostEntry,
    index: int,
    t_ms: float,
    f_ms: float,
    states: StateViews,
    choice: PairChoice,
    restored: list[LaneView],
    total: float,
    policy: PolicyConfig,
) -> Candidate:
    """The restore program's candidate for a scored pair: its lanes are the
    restored rows and the terminal rows; its score is the two-stage sequence's
    value per time over T + F, or its productive first stage's over T when
    that is higher (terminal rows only; setup alone earns nothing)."""
    terminal = [states.terminal[i] for i in choice.terminal]
    lanes = restored + [view for view, _ in terminal]
    cand = Candidate(
        prereq, index, lanes, total, 0.0, prereq.descriptor.batch_capacity - len(lanes),
        0, 0, ctx,
    )  # fmt: skip
    cand.roles = [RESTORE] * len(restored) + [TERMINAL] * len(terminal)
    if t_ms <= 0.0 or f_ms <= 0.0:
        cand.unknown, cand.score = True, total  # unknown durations: by useful value
        return cand
    active = ctx.active_age_price
    cand.unknown, cand.score = False, sequence_rate(total, t_ms, f_ms, active)
    if terminal:
        first = sum(
            terminal_contribution(
                policy.terminal_value, policy.terminal_age_price, states.sigma_ms, age, t_ms
            )
            for _, age in terminal
        )
        prefix = graph_score(first, 0.0, t_ms, active)
        cand.score = max(cand.score, prefix.score)
    return cand
