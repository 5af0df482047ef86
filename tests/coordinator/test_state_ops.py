"""State programs in the scheduler (runtime.coordinator.state_ops): terminal
snapshots retire finished and preempted requests and complete responses
visibly; restores of resumed requests are scored with their following graph
(the prerequisite pair search), and the spec's snapshot-cost check: enabling
a shared decode batch wins only when the whole sequence has enough value per
time."""

from __future__ import annotations

import copy
import random

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PolicyConfig, SchedulerConfig
from runtime.coordinator.plan import LanePhase
from runtime.coordinator.prerequisites import following_contribution, sequence_rate
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler

MS = 1_000_000
CATALOG = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.DECODE, 1),
    GraphDescriptor(GraphKind.DECODE, 4),
    GraphDescriptor(GraphKind.SNAPSHOT, 1),
    GraphDescriptor(GraphKind.SNAPSHOT, 4),
    GraphDescriptor(GraphKind.RESTORE, 1),
)
COST_MS = {
    (GraphKind.PREFILL, 1): 4.0,
    (GraphKind.DECODE, 1): 2.0,
    (GraphKind.DECODE, 4): 3.0,
    (GraphKind.SNAPSHOT, 1): 0.5,
    (GraphKind.SNAPSHOT, 4): 0.6,
    (GraphKind.RESTORE, 1): 1.0,
}


class Sim:
    """Drives the scheduler; each program takes its COST_MS; token k of request h
    is 1000 h + k."""

    def __init__(self, num_pages: int = 256, policy: PolicyConfig | None = None) -> None:
        config = SchedulerConfig(
            max_slots=8, page_size=16, num_pages=num_pages, debug_page_accounting=True
        )
        self.s = Scheduler(list(CATALOG), config, policy)
        self.now = 0
        self.fence = 0
        self.out: dict[int, list[int]] = {}
        self.finished: dict[int, int] = {}  # handle -> fence of the visible finish
        self.kinds: list[GraphKind] = []

    def admit(self, prompt_len: int, max_tokens: int, seed: int) -> int:
        rng = random.Random(seed)
        tokens = tuple(rng.randrange(50_000) for _ in range(prompt_len))
        handle = self.s.admit(RequestSpec(prompt_len, max_tokens, prompt_tokens=tokens))
        self.out[handle.id] = []
        return handle.id

    def step(self) -> object:
        s = self.s
        self.now += MS // 10
        s.advance_to(self.now)
        plan = s.plan()
        if plan is None:
            return None
        self.execute(plan)
        return plan

    def execute(self, plan, cost: int | None = None) -> None:
        """Commit ``plan`` and complete it ``cost`` ns later (default: its COST_MS)."""
        s = self.s
        self.fence += 1
        s.commit(plan, self.fence)
        self.kinds.append(plan.graph.kind)
        records = []
        for lane in plan.lanes:
            h = lane.handle.id
            k = len(self.out[h])
            tokens = tuple(1000 * h + k + j for j in range(lane.max_tokens))
            records.append(CompletionRecord(lane.slot, lane.generation, tokens))
        if cost is None:
            cost = int(COST_MS[(plan.graph.kind, plan.graph.batch_capacity)] * MS)
        self.now += cost
        s.advance_to(self.now)
        timing = ExecutionTiming((cost,), host_wall_ns=cost)
        for g in s.complete(self.fence, records, timing):
            self.out[g.handle.id] += g.tokens
            if g.tokens:
                s.published_output(g.handle, g.fence)
            if g.finished:
                assert g.handle.id not in self.finished
                self.finished[g.handle.id] = self.fence

    def run(self, limit: int = 3000) -> None:
        for _ in range(limit):
            idle = self.step() is None and not self.s.waiting and not self.s.running
            if idle and not self.s._res.resident:  # terminal rows retire too
                return
        raise AssertionError("the run did not finish")


def test_a_finished_response_completes_with_its_terminal_snapshot():
    sim = Sim()
    h = sim.admit(20, 5, seed=1)
    for _ in range(20):
        plan = sim.step()
        if len(sim.out[h]) == 5:
            break
    assert sim.out[h] == [1000 * h + k for k in range(5)]
    assert h not in sim.finished  # tokens out, the response not yet complete
    r = sim.s.request(sim.s._res.resident[h].handle)
    assert r is not None and r.finished and r.resident and r.terminal_since_ns is not None
    plan = sim.step()
    assert plan.graph.kind is GraphKind.SNAPSHOT
    assert [lane.phase for lane in plan.lanes] == [LanePhase.TERMINAL]
    assert sim.finished[h] == sim.fence
    stats = sim.s.memory_stats()
    assert stats["kv_pages_held"] == 0 and stats["kv_pages_cached"] > 0  # published


def test_terminal_value_and_age_through_sigma_of_the_snapshot_family():
    """Two terminal requests; the snapshot plan's useful value is
    sum(terminal_value + p * sigma * (A + T)) with sigma = K * T / min(B, K) over
    the fastest measured snapshot program.  (terminal_value 0 here, so the first
    finished request waits for the second rather than winning at once.)"""
    sim = Sim(policy=PolicyConfig(terminal_value=0.0, terminal_age_price=1.0))
    s = sim.s
    for desc in CATALOG:  # a measured catalog: no discovery
        s.catalog.observe(desc, int(COST_MS[(desc.kind, desc.batch_capacity)] * MS), 0)
    a, b = sim.admit(20, 3, seed=2), sim.admit(20, 3, seed=3)
    while len(sim.out[a]) < 3 or len(sim.out[b]) < 3:
        plan = sim.step()
        assert plan.graph.kind is not GraphKind.SNAPSHOT
    sim.now += 5 * MS
    s.advance_to(sim.now)
    plan = s.plan()
    assert plan.graph.kind is GraphKind.SNAPSHOT
    terminal = [s.request(s._res.resident[h].handle) for h in (a, b)]
    ages = [(sim.now - r.terminal_since_ns) / 1e6 for r in terminal]
    # Fastest per-request interval: B=4 at 0.6 ms serves both: 0.3; B=1: 0.5.
    sigma = 2 * 0.6 / 2
    assert plan.graph.batch_capacity == 4 and len(plan.lanes) == 2
    expected = sum(0.0 + 1.0 * sigma * (age + 0.6) for age in ages)
    assert abs(plan.useful_value - expected) < 1e-6


def drive_to_restore(num_pages: int = 256):
    """Four decoders; the last one is preempted (its snapshot publishes its pages)
    and resumes with everything cached: a decode-ready restore awaits."""
    sim = Sim(num_pages=num_pages)
    handles = [sim.admit(20, 200, seed=10 + i) for i in range(4)]
    while any(len(sim.out[h]) < 4 for h in handles):
        sim.step()
    s = sim.s
    victim = s.request(s._res.resident[handles[-1]].handle)
    while victim.inflight_fences:
        sim.step()
    s._res.preempt(victim)
    victim.terminal_since_ns = sim.now
    for _ in range(50):
        if victim.restore_pending:
            return sim, handles, victim
        sim.step()
    raise AssertionError("the victim never resumed")


def test_a_resumed_decoder_restores_and_continues_exactly():
    sim, handles, victim = drive_to_restore()
    assert victim.consumed_prompt == victim.prefill_target - 1  # decode-ready
    kinds_before = len(sim.kinds)
    sim.run()
    assert GraphKind.RESTORE in sim.kinds[kinds_before:]
    for h in handles:
        assert sim.out[h] == [1000 * h + k for k in range(200)]
        assert h in sim.finished
    assert sim.s.memory_stats()["kv_pages_held"] == 0


def test_enabling_a_shared_decode_batch_wins_only_with_enough_value_per_time():
    """The spec's snapshot-cost check on the scheduler: sweep the restore's
    measured cost T; the restore (followed by a decode batch that the resumed
    request shares with the three ready decoders) is selected exactly when that
    whole sequence's value per time beats the best alternative's; and a selected
    restore does enable that batch: once it completes, the next plan is the
    four-row decode serving the resumed request beside the three others."""
    sim, handles, victim = drive_to_restore()
    chosen = []
    for t_ms in (0.05, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 40.0):
        trial = copy.deepcopy(sim)
        s = trial.s
        restore = next(d for d in CATALOG if d.kind is GraphKind.RESTORE)
        entry = s.catalog.entry(restore)
        assert not entry.known
        s.catalog.observe(restore, int(t_ms * MS), sim.now)
        ctx = s._context()
        cands = s._candidates(ctx)
        others = [c for c in cands if c.entry.descriptor.kind is not GraphKind.RESTORE]
        alternative = max(c.score for c in others)
        # The pair, computed here from the lane values: 3 ready + 1 newly ready
        # decoders in the B=4 decode after the restore.
        f_ms = COST_MS[(GraphKind.DECODE, 4)]
        slope = ctx.decode_age_slope
        values = [v.decode_value for v in ctx.decode] + [
            v.decode_value for v in ctx.states.decode_ready
        ]
        total = sum(following_contribution(v, slope, t_ms, f_ms) for v in values)
        pair = sequence_rate(total, t_ms, f_ms, ctx.active_age_price)
        plan = s.plan()
        wins = plan.graph.kind is GraphKind.RESTORE
        assert wins == (pair > alternative), (t_ms, pair, alternative)
        if wins:
            assert [lane.phase for lane in plan.lanes] == [LanePhase.RESTORE]
            assert plan.lanes[0].handle == victim.handle
            assert plan.estimated_duration_ns == int(t_ms * MS)  # T only: no lookahead time
            trial.execute(plan, int(t_ms * MS))  # the restore runs and takes its T
            following = s.plan()
            assert following is not None and following.graph.kind is GraphKind.DECODE
            assert following.graph.batch_capacity == 4
            assert sorted(lane.handle.id for lane in following.lanes) == sorted(handles)
            assert all(lane.phase is LanePhase.DECODE for lane in following.lanes)
        chosen.append(wins)
    assert True in chosen and False in chosen  # both sides of the crossover were seen
    assert chosen == sorted(chosen, reverse=True)  # cheaper restores win, dearer ones lose


def test_a_restore_can_enable_the_prompt_row_of_a_following_mixed_program():
    """The mixed contract's third case: a prompt-ready restore (the pages hold
    part of its prompt) scored with a following width-one mixed program whose
    prompt row it enables, beside the ready decoders; the restore runs, then
    the mixed program takes the restored prompt row and the decoders."""
    catalog = (
        GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
        GraphDescriptor(GraphKind.DECODE, 2),
        GraphDescriptor(GraphKind.MIXED, 4, prompt_capacity=64),
        GraphDescriptor(GraphKind.SNAPSHOT, 1),
        GraphDescriptor(GraphKind.RESTORE, 1),
    )
    costs = {
        (GraphKind.PREFILL, 1): 4.0, (GraphKind.DECODE, 2): 2.0, (GraphKind.MIXED, 4): 4.5,
        (GraphKind.SNAPSHOT, 1): 0.3, (GraphKind.RESTORE, 1): 0.3,
    }  # fmt: skip
    s = Scheduler(list(catalog), SchedulerConfig(max_slots=4, page_size=16, num_pages=64))
    for desc in catalog:
        s.catalog.observe(desc, int(costs[(desc.kind, desc.batch_capacity)] * MS), 0)
    rng = random.Random(4)
    shared = tuple(rng.randrange(50_000) for _ in range(40))
    now = fence = 0
    out: dict[int, int] = {}

    def run_one():
        nonlocal now, fence
        now += MS
        s.advance_to(now)
        plan = s.plan()
        fence += 1
        s.commit(plan, fence)
        records = [
            CompletionRecord(lane.slot, lane.generation, (7,) * lane.max_tokens)
            for lane in plan.lanes
        ]
        now += int(costs[(plan.graph.kind, plan.graph.batch_capacity)] * MS)
        s.advance_to(now)
        timing = ExecutionTiming((int(costs[(plan.graph.kind, plan.graph.batch_capacity)] * MS),))
        for g in s.complete(fence, records, timing):
            out[g.handle.id] = out.get(g.handle.id, 0) + len(g.tokens)
            if g.tokens:
                s.published_output(g.handle, g.fence)
        return plan

    first = s.admit(RequestSpec(40, 3, prompt_tokens=shared))
    while out.get(first.id, 0) < 3 or s.request(first) is not None:
        run_one()  # computed, finished and snapshotted: its pages are cached
    decoders = [
        s.admit(RequestSpec(20, 50, prompt_tokens=tuple(rng.randrange(50_000) for _ in range(20))))
        for _ in range(2)
    ]
    while any(out.get(h.id, 0) < 2 for h in decoders):
        run_one()
    late = s.admit(RequestSpec(60, 5, prompt_tokens=shared + tuple(range(20))))
    r = s.request(late)
    assert r is not None and r.restore_pending and r.consumed_prompt == 40  # 2 pages + 8 copied
    plan = run_one()
    assert plan.graph.kind is GraphKind.RESTORE
    assert [lane.handle for lane in plan.lanes] == [late]
    following = run_one()
    assert following.graph.kind is GraphKind.MIXED
    assert following.lanes[following.prompt_row].handle == late
    assert {lane.handle for lane in following.lanes} == {late, *decoders}


def _round_program(b: int, w: int, p: int = 0) -> GraphDescriptor:
    return GraphDescriptor(
        GraphKind.SPECULATIVE, b, token_capacity=w, proposal_depth=w - 1, target_capacity=p
    )


def _restore_pair_value(prefill_order: list[tuple[int, int]]) -> float:
    """The best RESTORE candidate's value when the already ready prompt rows (lru,
    available tokens) are resident in ``prefill_order``, beside one decode-ready
    resumed request, with a width-one mixed program as the following shape."""
    from types import SimpleNamespace

    from runtime.coordinator.cost import CostCatalog
    from runtime.coordinator.policy import LaneView, SelectionContext
    from runtime.coordinator.state_ops import StateViews, state_candidates

    descs = [GraphDescriptor(GraphKind.RESTORE, 1),
             GraphDescriptor(GraphKind.MIXED, 2, prompt_capacity=64)]  # fmt: skip
    costs = CostCatalog(descs, ttl_ns=30_000 * MS)
    costs.observe(descs[0], 1 * MS, 0)
    costs.observe(descs[1], 6 * MS, 0)

    def view(slot: int, lru: int, available: int, decode_value: float = 0.0) -> LaneView:
        request = SimpleNamespace(slot=slot, prefill_target=4096, handle=SimpleNamespace(id=slot))
        return LaneView(request, 0.0, 0.0, 0, available, available, 0, decode_value, lru)

    prefill = [view(10 + i, lru, available) for i, (lru, available) in enumerate(prefill_order)]
    resumed = view(1, 0, 0, decode_value=300.0)
    ctx = SelectionContext(0, 0, 64.0, 30_000 * MS, costs, prefill, [], 0.1, 0.1)
    states = StateViews(terminal=[], decode_ready=[resumed], prompt_ready=[], sigma_ms=0.0)
    out: list = []
    state_candidates(ctx, states, PolicyConfig(), out)
    (restore,) = out
    return restore.value


def test_a_restore_pair_takes_the_best_already_ready_prompt_row_not_the_first_resident():
    """Spec: the following graph "can include already ready requests": with a
    one-token prompt row resident before a 64-token one, the restore + mixed pair
    is scored with the 64-token row, whatever the residency order."""
    short, long = (0, 1), (1, 64)
    assert _restore_pair_value([short, long]) == _restore_pair_value([long, short])
    assert _restore_pair_value([short, long]) > _restore_pair_value([short])


def _restore_candidates(descs, round_value=None, fixed_width=0, decode_value=300.0):
    """The RESTORE candidates of a decision with one decode-ready resumed request
    and every program measured (1 ms restore, 6 ms otherwise)."""
    from types import SimpleNamespace

    from runtime.coordinator.cost import CostCatalog
    from runtime.coordinator.policy import LaneView, SelectionContext
    from runtime.coordinator.state_ops import StateViews, state_candidates

    costs = CostCatalog(descs, ttl_ns=30_000 * MS)
    for desc in descs:
        costs.observe(desc, (1 if desc.kind is GraphKind.RESTORE else 6) * MS, 0)
    request = SimpleNamespace(
        slot=1, prefill_target=64, remaining_output=100, inflight_output=0,
        handle=SimpleNamespace(id=1),
    )  # fmt: skip
    resumed = LaneView(request, 0.0, 0.0, 64, 0, 0, 0, decode_value, 0)
    ctx = SelectionContext(0, 0, 64.0, 30_000 * MS, costs, [], [], 0.1, 0.1)
    states = StateViews(terminal=[], decode_ready=[resumed], prompt_ready=[], sigma_ms=0.0)
    out: list = []
    state_candidates(ctx, states, PolicyConfig(), out, round_value, fixed_width)
    return [c for c in out if c.entry.descriptor.kind is GraphKind.RESTORE]


def test_a_restore_may_be_followed_by_a_speculative_round_priced_at_its_complete_prefix():
    """Spec: "compare every pair of prepared prerequisite and following inference
    shapes": a rectangular speculative program follows a restore, its decoder
    worth its complete prefix; ragged and device-allocated ones do not (their
    row budget couples the lanes)."""
    restore = GraphDescriptor(GraphKind.RESTORE, 1)
    rect = _round_program(1, 4)
    ragged = _round_program(2, 4, 6)
    device = GraphDescriptor(GraphKind.SPECULATIVE, 1, token_capacity=4, proposal_depth=3,
                             target_capacity=3, device_allocated=True)  # fmt: skip
    seen = []

    def round_value(view, desc):
        seen.append(desc)
        return view.decode_value + 100.0 * (desc.token_capacity - 1)

    assert _restore_candidates([restore, rect]) == []  # not speculating: nothing follows
    (cand,) = _restore_candidates([restore, rect], round_value)
    assert set(seen) == {rect}
    assert cand.lanes[0].request.slot == 1
    (richer,) = _restore_candidates([restore, rect], round_value, decode_value=400.0)
    assert richer.value > cand.value  # the pair is priced with the round's lane value
    seen.clear()
    assert _restore_candidates([restore, ragged, device], round_value) == []
    assert seen == []


def test_under_fixed_width_only_shapes_that_may_run_follow_a_restore():
    """Fixed width 4: decode never runs, so it is no following shape; the width-4
    program is (with fixed width 0 both compete)."""
    restore = GraphDescriptor(GraphKind.RESTORE, 1)
    decode = GraphDescriptor(GraphKind.DECODE, 1)

    def round_value(view, desc):
        return view.decode_value + 1.0  # barely better than decode at the same cost

    assert _restore_candidates([restore, decode], round_value, fixed_width=4) == []
    (fixed,) = _restore_candidates(
        [restore, decode, _round_program(1, 4)], round_value, fixed_width=4
    )
    (alone,) = _restore_candidates([restore, _round_program(1, 4)], round_value)
    assert fixed.value == alone.value
    (adaptive,) = _restore_candidates([restore, decode], round_value)
    assert adaptive.value < alone.value


def _preempt_until_resumed(sim: Sim, handle: int):
    """Preempt resident ``handle`` (as drive_to_restore does) and step until it
    resumes with a restore pending."""
    s = sim.s
    victim = s.request(s._res.resident[handle].handle)
    while victim.inflight_fences:
        sim.step()
    s._res.preempt(victim)
    victim.terminal_since_ns = sim.now
    for _ in range(50):
        if victim.restore_pending:
            return victim
        sim.step()
    raise AssertionError("the victim never resumed")


def test_a_request_awaiting_its_restore_is_starved_like_any_participant(monkeypatch):
    """A measured restore as long as the decode B=4 frame three decoders share:
    the pair (restore, then decode B=4 with the restored row) earns one more
    lane's round over twice the time, so it loses to the decoders' frame until
    the waiting request's price has grown about threefold.  It grows because a
    request awaiting its restore is a participant: every interval it waits
    starves it (docs/scheduling-utility.md, "Every participant, every
    interval").  When it was not, its price stood still, only its age value
    (c * sigma per ms) grew, and it waited until the decoders had finished: the
    HTTP test tests/server/test_scheduler.py::test_decode_streams_all_progress_together
    when a loaded machine had measured restores slow."""
    monkeypatch.setitem(COST_MS, (GraphKind.RESTORE, 1), COST_MS[(GraphKind.DECODE, 4)])
    sim, handles, first = drive_to_restore()
    while first.restore_pending:  # the first restore measures the restore program
        sim.step()
    victim = _preempt_until_resumed(sim, handles[0])
    rate_before = victim.token_rate
    while victim.restore_pending:
        assert sim.step() is not None
    others = [len(sim.out[h]) for h in handles[1:]]
    assert rate_before is not None and victim.token_rate is not None
    assert victim.token_rate < rate_before / 2  # a lower token rate is a higher price f/x
    assert max(others) < 180, others  # restored while every decoder still had tokens to go
    sim.run()
    for h in handles:
        assert sim.out[h] == [1000 * h + k for k in range(200)]
