"""Speculative round candidates (spec, "Speculative graph coverage", "Useful service
and selection", "Completed confidence and acceptance").

A speculative program has request capacity B, proposal depth D, per-request
target capacity W (the pending token included) and aggregate target capacity P.
A lane's *query length* q is the target rows it gets: it offers q - 1 proposals
and commits between 1 and q tokens (the accepted proposals plus the correction
or bonus token).  Its ceiling is min(D + 1, W, remaining output), and a queued
lane advances by at most that many tokens (``Request.inflight_output``).

Selection values a lane at query length q with the request's prefix-survival
means s_i (:mod:`runtime.coordinator.speculation`): expected output
E(q) = 1 + sum_{i<q} s_i, scored with each s_i raised to
``adaptive_verification_alpha``; the plan's projections use the plain values.
Its value is the decode lane value with E(q) output tokens and one delivery
(a visible burst is one delivery whatever its length).

Allocation of a QueryLength program is on the host (lengths fixed before any
proposal is drawn):

* a rectangular program (P = B x W) gives every lane of its cohort its
  complete prefix, its ceiling; the cohort is the B lanes of highest value;
* a ragged program (P < B x W) evaluates every cohort prefix (1 .. B lanes,
  while the pending rows fit P) under the spec's three orderings (total lane
  value, pending-token delivery value, value per target row), each cohort
  priced with its causal allocation: every lane gets its
  pending row, then the remaining P rows go one at a time to the lane whose
  next row adds the most expected value (a survival frontier, so rows extend
  prefixes in order), ties to the shorter prefix, then the lower slot.

A device-allocated program (``GraphDescriptor.device_allocated``, the
SpeculativePrefixLimit binding; adaptive selection only) gets each lane's
ceiling, and the program allocates its P rows itself, admitting the best
immediate causal frontier by joint prefix probability (ties: the shorter
prefix, then the lower slot).  The host prices a cohort with the allocation
the program is expected to make: the same frontier rule over the requests'
confidence forecasts (``forecast``), and the acceptance means for the value.

Mixed programs of width W > 1 (:func:`wide_mixed_candidates`) compete like
separate speculative programs: their decode rows are rectangular round lanes
(complete prefixes), beside at most one prompt row, the best undominated one
for the shape's prompt capacity; a decode-only cohort competes too.

Dominance: candidates of one kind with the same cohort, the same query lengths
and the same actual proposal depth (mixed: also the same prompt row and prompt
tokens) keep only physical shapes not larger in every capacity than an
alternative (timing estimates cannot make padding win).
Under fixed-width execution (``SchedulerConfig.fixed_speculative_width``) only
programs of that width compete, with complete prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.catalog import GraphKind
from runtime.coordinator.bounds import Pending, Shapes, summary
from runtime.coordinator.lanes import (
    Lane,
    LaneTable,
    SurvivalFn,
)
from runtime.coordinator.policy import (
    Candidate,
    LaneView,
    SelectionContext,
    fit_tokens,
    prompt_lane_value,
)


# Survival means s_1..s_n of a request's current proposal source.
def _deepest(entries, fixed_width: int) -> int:
    """The most proposals any competing program offers."""
    return max(
        (
            min(e.descriptor.token_capacity, e.descriptor.proposal_depth + 1) - 1
            for e in entries
            if not fixed_width or e.descriptor.token_capacity == fixed_width
        ),
        default=0,
    )


def _extents_of(desc) -> tuple[int, int, int, int]:
    """B, W, D, P of a speculative program."""
    return desc.batch_capacity, desc.token_capacity, desc.proposal_depth, desc.target_capacity


def _competes(desc, fixed_width: int, forecasts: bool) -> bool:
    """Whether speculative program ``desc`` competes in this decision: under fixed
    width only host programs of that width; device allocation needs forecasts."""
    if fixed_width and (desc.token_capacity != fixed_width or desc.device_allocated):
        return False
    return not (desc.device_allocated and not forecasts)


def _best_fitting(ranked: Sequence[Lane], batch: int, rows: int) -> list[Lane]:
    """The highest-value cohort of at most ``batch`` lanes whose complete prefixes
    (each lane's ceiling) sum to at most ``rows``, in ``ranked`` order.

    Exact: lanes of one ceiling enter best first (values are additive, so within
    a ceiling the cohort takes a prefix of ``ranked``), and a dynamic program over
    the ceilings (at most W of them) keeps per (lanes, rows) the best value.
    Ties keep the choice found first: fewer lanes of the smaller ceilings."""
    by_limit: dict[int, list[Lane]] = {}
    for lane in ranked:
        by_limit.setdefault(lane.limit, []).append(lane)
    # (lanes, rows) -> (value, lanes taken per ceiling class)
    states: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {(0, 0): (0.0, ())}
    for limit in sorted(by_limit):
        group = by_limit[limit]
        prefix = [0.0]
        for lane in group:
            prefix.append(prefix[-1] + lane.value(limit))
        grown: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
        for (n, used), (value, taken) in states.items():
            most = min(len(group), batch - n, (rows - used) // limit)
            for k in range(most + 1):
                key = (n + k, used + k * limit)
                candidate = (value + prefix[k], (*taken, k))
                held = grown.get(key)
                if held is None or candidate[0] > held[0]:
                    grown[key] = candidate
        states = grown
    _, taken = max(states.values(), key=lambda state: state[0])
    chosen = {id(lane) for limit, k in zip(sorted(by_limit), taken) for lane in by_limit[limit][:k]}
    return [lane for lane in ranked if id(lane) in chosen]


def speculative_candidates(
    ctx: SelectionContext,
    out: list[Candidate],
    survival: SurvivalFn,
    alpha: float,
    fixed_width: int = 0,
    forecast: SurvivalFn | None = None,
    table: LaneTable | None = None,
    bound: bool = False,
    floor: float | None = None,
) -> None:
    """One candidate per speculative program: its best cohort and query lengths
    (``Candidate.queries``; a device-allocated program's lanes also carry their
    ceilings, ``Candidate.ceilings``).  ``table``: the decision's lanes, when
    the caller already read them (:func:`round_candidates`).  ``bound``: ``out``
    holds the decision's other candidates, and a program whose bound rules it
    out is not searched (:mod:`runtime.coordinator.bounds`).  ``floor`` (with
    ``bound``): only a candidate scoring above it matters (an acceptance
    probe must beat the ordinary winner's score); nothing else is compared."""
    if not ctx.catalog.entries(GraphKind.SPECULATIVE) or not ctx.decode:
        return
    layout = _layout(ctx, fixed_width, forecast is not None)
    if table is None:
        table = LaneTable(ctx, survival, alpha, layout.deepest, forecast)
    competing = layout.competing
    now: list[int] = []
    deferred: list[int] = []
    if bound and not fixed_width:
        # Fresh measured programs are deferred to the bounds, but for the
        # rectangular ones that serve every lane on a shape larger than another
        # that does: the same work, dominated (_undominated).
        stale_before = ctx.now_ns - ctx.ttl_ns
        padded = layout.padded(sum(1 for left in table.left if left >= 1))
        for position, (_, entry, _) in enumerate(competing):
            seen = entry.last_valid_ns
            if entry.estimate_ns <= 0 or (seen is not None and seen <= stale_before):
                now.append(position)
            elif position not in padded:
                deferred.append(position)
    else:
        now = list(range(len(competing)))
    found = _evaluate(ctx, table, competing, now, fixed_width, {})
    kept = _settle(ctx, table, layout, deferred, found, out, floor) if deferred else None
    if kept is None:
        kept = _undominated([found[position] for position in sorted(found)])
    out.extend(kept)


class _Layout:
    """The speculative programs that compete under one setting (fixed width,
    forecasts or not) of a catalog, with their shapes as arrays and their
    ceiling groups (min(D + 1, W)): what every decision shares
    (``CostCatalog.derived``, for good)."""

    def __init__(self, catalog, fixed_width: int, forecasts: bool) -> None:
        entries = catalog.entries(GraphKind.SPECULATIVE)
        self.deepest = _deepest(entries, fixed_width)
        self.competing = [
            (index, entry, _extents_of(entry.descriptor))
            for index, entry in enumerate(entries)
            if _competes(entry.descriptor, fixed_width, forecasts)
        ]
        self.shapes = Shapes([entry.descriptor for _, entry, _ in self.competing])
        ceilings: dict[int, int] = {}
        self.groups = [
            ceilings.setdefault(min(d + 1, w), len(ceilings)) for *_, (_, w, d, _) in self.competing
        ]
        self.ceilings = list(ceilings)
        self._padded: dict[int, frozenset[int]] = {}

    def padded(self, lanes: int) -> frozenset[int]:
        """The rectangular host programs that serve all ``lanes`` lanes on a
        larger batch than another of their (W, D) that does (positions)."""
        held = self._padded.get(lanes)
        if held is None:
            smallest: dict[tuple[int, int], int] = {}
            for _, entry, (b, w, d, p) in self.competing:
                if b >= lanes and p >= b * w and not entry.descriptor.device_allocated:
                    smallest[(w, d)] = min(b, smallest.get((w, d), b))
            held = self._padded[lanes] = frozenset(
                position
                for position, (_, entry, (b, w, d, p)) in enumerate(self.competing)
                if p >= b * w and not entry.descriptor.device_allocated
                and b > smallest.get((w, d), b)
            )  # fmt: skip
        return held


def _layout(ctx: SelectionContext, fixed_width: int, forecasts: bool) -> _Layout:
    return ctx.catalog.derived(
        f"rounds:{fixed_width}:{forecasts}",
        lambda: _Layout(ctx.catalog, fixed_width, forecasts),
        per_version=False,
    )


def _evaluate(
    ctx: SelectionContext, table: LaneTable, competing: list, positions: Sequence[int],
    fixed_width: int, ranked_rect: dict[tuple[int, int], list[Lane]],
) -> dict[int, tuple[tuple, Candidate]]:  # fmt: skip
    """The candidates of the programs at ``positions`` of ``competing``, by position
    (with their dominance keys); causal ones share one search per width."""
    causal: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}
    for position in positions:
        _, entry, (b, w, d, p) = competing[position]
        if not fixed_width and (entry.descriptor.device_allocated or p < b * w):
            causal.setdefault((w, d, entry.descriptor.device_allocated), []).append((b, p))
    found: dict[int, tuple[tuple, Candidate]] = {}
    whole: dict[tuple[int, int], list[tuple]] = {}  # rectangular shapes serving every lane
    count = table.count
    for position in positions:
        index, entry, (b, w, d, p) = competing[position]
        device = entry.descriptor.device_allocated
        if not count:
            continue
        rectangular = p >= b * w and not device
        if rectangular and b >= count:  # every lane, complete prefixes: one work
            shapes, mine = whole.setdefault((w, d), []), (b, w, p, 0)
            if any(o != mine and all(a >= x for a, x in zip(mine, o)) for o in shapes):
                continue  # a smaller shape does the same work: dominated (_undominated)
            shapes.append(mine)
        best: tuple[float, list, list[int]] | None = None
        if rectangular and not fixed_width:  # the B best lanes at their complete prefixes
            top = table.ranked(w, d)[:b]
            views = [row[4] for row in top]
            best = (sum(-row[0] for row in top), views, [row[3] for row in top])
            candidate = Candidate(
                entry, index, views, best[0], ctx.decode_age_slope * len(views),
                p - sum(best[2]), max(v.lru for v in views), 0, ctx,
            )  # fmt: skip
            candidate.queries = best[2]
            key = (tuple(v.request.handle.id for v in views), tuple(best[2]), d, device)
            found[position] = (key, candidate)
            continue
        lanes = table.lanes(w, d, device)
        if rectangular or fixed_width:
            ranked = ranked_rect.get((w, d))
            if ranked is None:  # one order for every batch of this width and depth
                ranked = ranked_rect[(w, d)] = sorted(
                    lanes, key=lambda x: (-x.full, x.view.lru, x.view.request.handle.id)
                )
            # Complete prefixes (fixed host allocation): the B best lanes, or on a
            # ragged program the best cohort whose prefixes fit both B and P.
            cohort = ranked[:b] if rectangular else _best_fitting(ranked, b, p)
            if cohort:
                best = (sum(x.full for x in cohort), cohort, [x.limit for x in cohort])
        else:  # causal allocation: the search shared by this width's programs
            best = table.causal(w, d, device, causal[(w, d, device)]).best(b, p)
        if best is None:
            continue
        value, cohort, queries = best
        candidate = Candidate(
            entry, index, [x.view for x in cohort], value, ctx.decode_age_slope * len(cohort),
            p - sum(queries), max(x.view.lru for x in cohort), 0, ctx,
        )  # fmt: skip
        candidate.queries = queries
        if device:
            candidate.ceilings = [x.limit for x in cohort]
        key = (tuple(x.view.request.handle.id for x in cohort), tuple(queries), d, device)
        found[position] = (key, candidate)
    return found


def _settle(
    ctx: SelectionContext, table: LaneTable, layout: _Layout, positions: list[int],
    found: dict[int, tuple[tuple, Candidate]], others: Sequence[Candidate],
    floor: float | None = None,
) -> list[Candidate] | None:  # fmt: skip
    """Evaluate the deferred programs at ``positions`` that their bounds cannot
    rule out (:class:`bounds.Pending`), into ``found``, one (W, D, device)
    group at a time, until the bounds rule out the rest; then the undominated
    candidates of ``found`` (None: every one was evaluated)."""
    entries = [entry for _, entry, _ in layout.competing]
    pending = Pending(
        layout.shapes, positions, table.columns(layout.ceilings), layout.groups,
        [e.estimate_ns / 1e6 for e in entries], ctx.decode_age_slope, ctx.active_age_price,
        floor,
    )  # fmt: skip
    rest = summary(others)
    competing = layout.competing
    while pending.left:
        kept = _undominated([found[position] for position in sorted(found)])
        batch = pending.next_batch(kept, rest)
        if not batch:
            return kept
        found.update(_evaluate(ctx, table, competing, batch, 0, {}))
    return None


def wide_mixed_candidates(
    ctx: SelectionContext,
    out: list[Candidate],
    survival: SurvivalFn,
    alpha: float,
    fixed_width: int = 0,
    table: LaneTable | None = None,
) -> None:
    """Per mixed program of width W > 1: its best decode-only cohort, and per
    prompt row the row plus the best B - 1 decoders, every decoder on its
    complete prefix (host allocation within P)."""
    entries = [e for e in ctx.catalog.entries(GraphKind.MIXED) if e.descriptor.token_capacity > 1]
    prompts = ctx.prefill + ctx.imaged if ctx.imaged else ctx.prefill
    if not entries or not (ctx.decode or prompts):
        return
    if table is None:
        table = LaneTable(ctx, survival, alpha, _deepest(entries, fixed_width), None)
    found: list[tuple[tuple, Candidate]] = []
    for index, entry in enumerate(ctx.catalog.entries(GraphKind.MIXED)):
        desc = entry.descriptor
        b, w, d, p, c = (desc.batch_capacity, desc.token_capacity, desc.proposal_depth,
                         desc.target_capacity, desc.prompt_capacity)  # fmt: skip
        if w == 1 or (fixed_width and w != fixed_width):
            continue
        lanes = list(table.lanes(w, d, False))
        lanes.sort(key=lambda x: (-x.full, x.view.lru, x.view.request.handle.id))
        decoders = _fit(lanes[:b], p)
        if decoders:
            found.append(_mixed(entry, index, ctx, None, 0, 0.0, decoders))
        for view in prompts:
            tokens = fit_tokens(view, min(c, view.available))  # (image spans whole)
            if tokens <= 0:
                continue
            others = _fit([x for x in lanes if x.view is not view][: b - 1], p)
            value = prompt_lane_value(view, tokens, ctx.beta)
            found.append(_mixed(entry, index, ctx, view, tokens, value, others))
    out.extend(_undominated(found))


def round_candidates(
    ctx: SelectionContext,
    out: list[Candidate],
    survival: SurvivalFn,
    alpha: float,
    fixed_width: int = 0,
    forecast: SurvivalFn | None = None,
) -> None:
    """Speculative and wide mixed candidates from one read of the decoders'
    estimates (each request's survival and forecast once per decision)."""
    catalog = ctx.catalog

    def deepest() -> int | None:  # None: no round program
        entries = [
            *catalog.entries(GraphKind.SPECULATIVE),
            *(e for e in catalog.entries(GraphKind.MIXED) if e.descriptor.token_capacity > 1),
        ]
        return _deepest(entries, fixed_width) if entries else None

    depth = catalog.derived(f"rounds-depth:{fixed_width}", deepest, per_version=False)
    if depth is None:
        return
    table = LaneTable(ctx, survival, alpha, depth, forecast)
    speculative_candidates(ctx, out, survival, alpha, fixed_width, forecast, table, bound=True)
    wide_mixed_candidates(ctx, out, survival, alpha, fixed_width, table)


def _fit(cohort: list[Lane], rows: int) -> list[Lane]:
    """The lanes of ``cohort``, best first, whose complete prefixes fit ``rows``."""
    kept, used = [], 0
    for lane in cohort:
        if used + lane.limit <= rows:
            kept.append(lane)
            used += lane.limit
    return kept


def _mixed(
    entry, index: int, ctx: SelectionContext, prompt: LaneView | None, tokens: int,
    value: float, cohort: list[Lane],
) -> tuple[tuple, Candidate]:  # fmt: skip
    """A wide mixed candidate (prompt row first, if any) and its dominance key."""
    desc = entry.descriptor
    views = ([prompt] if prompt is not None else []) + [x.view for x in cohort]
    queries = ([0] if prompt is not None else []) + [x.limit for x in cohort]
    total = value + sum(x.full for x in cohort)
    padding = (desc.prompt_capacity - tokens) + (desc.batch_capacity - len(views))
    cand = Candidate(
        entry, index, views, total, ctx.decode_age_slope * len(cohort), padding,
        max((v.lru for v in views), default=-1), tokens, ctx, 0 if prompt is not None else -1,
    )  # fmt: skip
    cand.queries = queries
    ids = tuple(v.request.handle.id for v in views)
    return (ids, tuple(queries), desc.proposal_depth, tokens), cand


def _undominated(found: list[tuple[tuple, Candidate]]) -> list[Candidate]:
    """Drop a shape when another with the same work is no larger in every capacity."""
    groups: dict[tuple, list[tuple[int, int, int, int]]] = {}
    for key, cand in found:
        groups.setdefault(key, []).append(_extents(cand))
    kept = []
    for key, cand in found:
        mine = _extents(cand)
        if not any(
            other != mine and all(a >= o for a, o in zip(mine, other)) for other in groups[key]
        ):
            kept.append(cand)
    return kept


def _extents(cand: Candidate) -> tuple[int, int, int, int]:
    desc = cand.entry.descriptor
    return desc.batch_capacity, desc.token_capacity, desc.target_capacity, desc.prompt_capacity


def expected_tokens(survival: Sequence[float], queries: int) -> float:
    """E(q) = 1 + sum_{i<q} s_i with the plain means (projections, limits)."""
    return 1.0 + sum(survival[: max(0, queries - 1)])


def device_allocation(
    joint: Sequence[Sequence[float]], ceilings: Sequence[int], slots: Sequence[int], rows: int
) -> list[int]:
    """The rows a device-allocated program gives each lane: every lane its pending
    row, then, while rows are left, the best immediate causal frontier by joint
    prefix probability (``joint[i][d - 1]`` for lane i's prefix of d proposals),
    ties to the shorter prefix, then the lower slot; never past a lane's ceiling,
    and never a zero-probability prefix (a certain rejection).
    The host recomputes it from the program's confidence sidecar to know what
    each lane offered."""
    queries = [1] * len(ceilings)
    left = rows - len(ceilings)
    while left > 0:
        best, best_key = -1, None
        for i, q in enumerate(queries):
            if q >= ceilings[i] or q - 1 >= len(joint[i]) or joint[i][q - 1] <= 0.0:
                continue  # at its ceiling, out of proposals, or a certain rejection
            key = (joint[i][q - 1], -q, -slots[i])
            if best_key is None or key > best_key:
                best, best_key = i, key
        if best < 0:
            break
        queries[best] += 1
        left -= 1
    return queries
