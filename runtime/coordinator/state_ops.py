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
  over T).  Following shapes: decode; mixed at width one with the prompt row
  absent, already ready, or enabled by the restore (a prompt-ready request);
  prefill of a prompt-ready request.  Only the restore executes; the plan keeps
  its own duration T (lookahead time never enters timing or cost learning).

Pure Python: no torch, sockets or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.catalog import GraphKind
from runtime.coordinator.config import PolicyConfig
from runtime.coordinator.cost import CostEntry
from runtime.coordinator.policy import Candidate, LaneView, SelectionContext, prompt_lane_value
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

TERMINAL = "terminal"
RESTORE = "restore"


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
    ctx: SelectionContext, states: StateViews, policy: PolicyConfig, out: list[Candidate]
) -> None:
    """Snapshot candidates and, per restore shape, its best pair, appended to ``out``."""
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
    for index, prereq in enumerate(ctx.catalog.entries(GraphKind.RESTORE)):
        best: Candidate | None = None
        for cand in _pairs(ctx, states, policy, prereq, index):
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


def _follows(ctx: SelectionContext, states: StateViews):
    """The following shapes the mixed contract lists, with their prompt rows."""
    for entry in ctx.catalog.entries(GraphKind.DECODE):
        yield _Follow(entry, entry.descriptor.batch_capacity, True)
    for entry in ctx.catalog.entries(GraphKind.MIXED):
        if entry.descriptor.token_capacity != 1:
            continue  # wide mixed rows verify drafts: not a restore's following graph
        rows = entry.descriptor.batch_capacity
        yield _Follow(entry, rows, True)  # the prompt absent
        for lane in ctx.prefill[:1]:  # the best already ready prompt row
            yield _Follow(entry, rows, True, lane)
        for lane in states.prompt_ready:  # a prompt row the restore enables
            yield _Follow(entry, rows, True, lane, True)
    for entry in ctx.catalog.entries(GraphKind.PREFILL):
        for lane in states.prompt_ready:
            yield _Follow(entry, 1, False, lane, True)


# A forced newly ready row (an enabled prompt row) sorts first in best_pair.
_FORCED = 1e30


def _pairs(
    ctx: SelectionContext, states: StateViews, policy: PolicyConfig, prereq: CostEntry, index: int
):
    """Each following shape's exact best joint cohort with ``prereq``, as a candidate."""
    t_ms = prereq.estimate_ns / 1e6 if prereq.known else 0.0
    tv, p, sigma = policy.terminal_value, policy.terminal_age_price, states.sigma_ms
    slope = ctx.decode_age_slope
    for follow in _follows(ctx, states):
        f_ms = follow.entry.estimate_ns / 1e6 if follow.entry.known else 0.0
        newly: list[float] = []
        ready: list[float] = []
        if follow.decoders:
            newly = [following_contribution(v.decode_value, slope, t_ms, f_ms)
                     for v in states.decode_ready]  # fmt: skip
            ready = [following_contribution(v.decode_value, slope, t_ms, f_ms)
                     for v in ctx.decode]  # fmt: skip
        term = [terminal_sequence_contribution(tv, p, sigma, age, t_ms, f_ms)
                for _, age in states.terminal]  # fmt: skip
        extra = 0.0
        rows = follow.rows
        prompt = follow.prompt
        if prompt is not None:
            tokens = min(prompt.available, follow.entry.descriptor.prompt_capacity)
            extra = prompt_lane_value(prompt, tokens, ctx.beta)
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
        restored = [
            prompt if (offset and i == 0) else states.decode_ready[i - offset]
            for i in (*choice.newly_ready, *choice.advanced)
        ]
        total = choice.value - (_FORCED if offset else 0.0) + extra
        yield _candidate(ctx, prereq, index, t_ms, f_ms, states, choice, restored, total, policy)


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
