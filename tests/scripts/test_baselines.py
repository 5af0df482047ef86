"""Baseline schedulers reproduce their published policies on hand-checked traces."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.errors import CommitError, CompletionError
from runtime.coordinator.plan import LanePhase
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from scripts.scheduling_sim.baselines import (
    BASELINE_NAMES,
    FcfsScheduler,
    ShapeLadder,
    make_baseline,
)
from scripts.scheduling_sim.catalogs import PROFILES, build_catalog
from scripts.scheduling_sim.engine import Simulation
from scripts.scheduling_sim.workload import Arrival, WorkloadConfig, make_workload, two_tenants

PROFILE = PROFILES["llama1b-h100"]
BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
CATALOG = build_catalog(prefill_buckets=BUCKETS, decode_batches=(1, 2, 4, 8, 16))
TIMING = ExecutionTiming((1_000_000,))


def mixed(b: int, c: int, w: int = 1) -> GraphDescriptor:
    return GraphDescriptor(
        GraphKind.MIXED, b, token_capacity=w, proposal_depth=w - 1, prompt_capacity=c
    )


class Driver:
    """Plans, commits and completes one step at a time, like the simulator."""

    def __init__(self, scheduler) -> None:
        self.s = scheduler
        self.fence = 0
        self.plans = []

    def admit(self, prompt: int, output: int, tenant: int | None = None) -> int:
        spec = RequestSpec(prompt, output)
        h = self.s.admit(spec) if tenant is None else self.s.admit(spec, tenant=tenant)
        return h.id

    def step(self):
        """Run one step; return its rows as (request, 'P'|'D', prompt tokens)."""
        plan = self.s.plan()
        assert plan is not None
        self.s.commit(plan, self.fence)
        assert self.s.plan() is None  # one frame at a time
        records = [
            CompletionRecord(lane.slot, lane.generation, (7,) * lane.max_tokens)
            for lane in plan.lanes
        ]
        self.s.complete(self.fence, records, TIMING)
        self.fence += 1
        self.plans.append(plan)
        return rows(plan)


def rows(plan):
    return [
        (lane.handle.id, "P" if lane.phase is LanePhase.PREFILL else "D", lane.prompt_tokens)
        for lane in plan.lanes
    ]


def step_tokens(plan) -> int:
    """Tokens a step batches: prompt tokens plus one per decode row."""
    return sum(lane.prompt_tokens or 1 for lane in plan.lanes)


# --------------------------------------------------------------------- shapes
def test_shapes_pick_smallest_covering_catalog_shape():
    ladder = ShapeLadder([*CATALOG, mixed(4, 128), mixed(4, 512), mixed(8, 128), mixed(4, 128, 2)])
    assert ladder.select([], 3) == GraphDescriptor(GraphKind.DECODE, 4)
    assert ladder.select([], 16) == GraphDescriptor(GraphKind.DECODE, 16)
    assert ladder.select([100], 0) == GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=128)
    assert ladder.select([64], 0) == GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
    # A chunk with decoders: the smallest width-one mixed shape (prompt capacity, then B).
    assert ladder.select([100], 2) == mixed(4, 128)
    assert ladder.select([200], 2) == mixed(4, 512)
    assert ladder.select([100], 5) == mixed(8, 128)
    for d in (ladder.select([100], 2), ladder.select([200], 3)):
        assert ladder.in_catalog(d) and d.token_capacity == 1


def test_shapes_synthesize_beyond_the_catalog():
    ladder = ShapeLadder(CATALOG)  # no mixed shapes; decode up to 16, prefill up to 4096
    # Decode beyond the largest batch: the next power of two.
    assert ladder.select([], 20) == GraphDescriptor(GraphKind.DECODE, 32)
    assert ladder.select([], 33) == GraphDescriptor(GraphKind.DECODE, 64)
    # One chunk beyond the ladder: PREFILL, C rounded up to 64.
    assert ladder.select([5000], 0) == GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=5056)
    # A chunk with a decoder and no mixed shapes: MIXED, B >= max(2, rows).
    assert ladder.select([100], 1) == mixed(2, 128)
    # Several chunks: one MIXED over the sum, at the smallest covering bucket.
    assert ladder.select([30, 50, 20], 0) == mixed(4, 128)
    assert ladder.select([30, 50, 20], 2) == mixed(8, 128)
    assert ladder.select([600, 500], 0) == mixed(2, 2048)
    # Beyond the largest bucket: the sum rounded up to 64.
    assert ladder.select([3000, 2000], 0) == mixed(2, 5056)
    assert ladder.select([10], 40) == mixed(64, 64)
    for d in (ladder.select([], 20), ladder.select([5000], 0), ladder.select([30, 50], 0)):
        assert not ladder.in_catalog(d)
    # Several chunks never take a catalog mixed shape; a too-small one is not used either.
    ladder = ShapeLadder([*CATALOG, mixed(4, 512)])
    assert ladder.select([30, 50], 1) == mixed(4, 128)
    assert ladder.select([100], 7) == mixed(8, 128)
    # Mixed capacities count as prompt buckets too.
    ladder = ShapeLadder([*build_catalog((64, 128), (1, 2)), mixed(2, 512)])
    assert ladder.select([100, 100], 1) == mixed(4, 512)


def test_plans_carry_the_chosen_shape_and_count_synthesized_frames():
    d = Driver(make_baseline("vllm", CATALOG))
    d.admit(100, 2)
    assert d.step() == [(0, "P", 100)]
    assert d.plans[-1].graph == GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=128)
    d.admit(30, 1)
    d.admit(50, 1)
    assert d.step() == [(0, "D", 0), (1, "P", 30), (2, "P", 50)]
    assert d.plans[-1].graph == mixed(4, 128)
    assert (d.s.frames, d.s.synthesized_frames) == (2, 1)


# --------------------------------------------------------------------- vllm
def test_vllm_running_first_fcfs_admission_and_chunks_the_last_admitted():
    d = Driver(make_baseline("vllm", CATALOG, max_num_batched_tokens=100))
    a, b, c = d.admit(30, 3), d.admit(50, 3), d.admit(60, 3)
    # Step 1: FCFS admissions fill the budget; the last admitted is chunked.
    assert d.step() == [(a, "P", 30), (b, "P", 50), (c, "P", 20)]
    assert [lane.max_tokens for lane in d.plans[-1].lanes] == [1, 1, 0]
    x = d.admit(200, 2)
    # Step 2: running first (decoders, then the partial prefill), then the new one.
    assert d.step() == [(a, "D", 0), (b, "D", 0), (c, "P", 40), (x, "P", 58)]
    lane = d.plans[-1].lanes[2]
    assert (lane.prompt_start, lane.max_tokens) == (20, 1)
    assert d.step() == [(a, "D", 0), (b, "D", 0), (c, "D", 0), (x, "P", 97)]
    # a and b reached 3 outputs; x finishes its prompt.
    assert d.step() == [(c, "D", 0), (x, "P", 45)]
    assert all(step_tokens(p) <= 100 for p in d.plans)
    assert [step_tokens(p) for p in d.plans] == [100, 100, 100, 46]


def test_vllm_partial_prefill_takes_the_budget_before_new_requests():
    d = Driver(make_baseline("vllm", CATALOG, max_num_batched_tokens=100))
    e, f = d.admit(300, 2), d.admit(10, 2)
    assert d.step() == [(e, "P", 100)]  # f is not admitted: no budget left
    assert d.step() == [(e, "P", 100)]
    assert d.step() == [(e, "P", 100)]
    assert d.step() == [(e, "D", 0), (f, "P", 10)]
    assert d.s.plan() is not None


def test_vllm_budget_cuts_the_running_list_and_slots_bound_admission():
    d = Driver(make_baseline("vllm", CATALOG, max_num_batched_tokens=2, max_slots=3))
    a, b, c, x = d.admit(1, 5), d.admit(1, 5), d.admit(1, 5), d.admit(1, 5)
    assert d.step() == [(a, "P", 1), (b, "P", 1)]
    assert d.step() == [(a, "D", 0), (b, "D", 0)]  # c waits: the running use the budget
    d = Driver(make_baseline("vllm", CATALOG, max_slots=3))
    a, b, c, x = d.admit(10, 2), d.admit(10, 2), d.admit(10, 2), d.admit(10, 2)
    assert d.step() == [(a, "P", 10), (b, "P", 10), (c, "P", 10)]  # x: no free slot
    assert d.step() == [(a, "D", 0), (b, "D", 0), (c, "D", 0)]
    assert d.step() == [(x, "P", 10)]  # a, b, c finished and freed their slots
    assert d.plans[-1].lanes[0].slot == 0 and d.plans[-1].lanes[0].generation == 2


# --------------------------------------------------------------------- sglang
def test_sglang_prefills_whenever_a_request_fits_and_decodes_otherwise():
    d = Driver(make_baseline("sglang", CATALOG, max_num_batched_tokens=100))
    a, b, c = d.admit(30, 3), d.admit(50, 3), d.admit(60, 4)
    assert d.step() == [(a, "P", 30), (b, "P", 50), (c, "P", 20)]  # c becomes the chunked req
    # The chunked request's continuation is the next prefill batch; decoders stall.
    assert d.step() == [(c, "P", 40)]
    assert d.plans[-1].graph == GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
    assert d.step() == [(a, "D", 0), (b, "D", 0), (c, "D", 0)]
    x = d.admit(20, 2)
    assert d.step() == [(x, "P", 20)]  # a waiting request fits: prefill first
    assert d.step() == [(a, "D", 0), (b, "D", 0), (c, "D", 0), (x, "D", 0)]
    assert d.step() == [(c, "D", 0)]  # a, b, x finished


def test_sglang_continuation_first_then_new_requests_and_one_chunked_at_a_time():
    d = Driver(make_baseline("sglang", CATALOG, max_num_batched_tokens=100))
    a, b = d.admit(150, 2), d.admit(30, 2)
    assert d.step() == [(a, "P", 100)]  # a is chunked and ends the batch
    assert d.step() == [(a, "P", 50), (b, "P", 30)]
    c, e = d.admit(90, 2), d.admit(90, 2)
    assert d.step() == [(c, "P", 90), (e, "P", 10)]
    assert d.step() == [(e, "P", 80)]  # decoders a and b stall meanwhile
    assert d.step() == [(a, "D", 0), (b, "D", 0), (c, "D", 0), (e, "D", 0)]


def test_sglang_decodes_while_no_slot_is_free():
    d = Driver(make_baseline("sglang", CATALOG, max_slots=2))
    a, b, c = d.admit(30, 5), d.admit(30, 5), d.admit(30, 5)
    assert d.step() == [(a, "P", 30), (b, "P", 30)]
    for _ in range(4):
        assert d.step() == [(a, "D", 0), (b, "D", 0)]
    assert d.step() == [(c, "P", 30)]


def test_sglang_mixed_chunk_decoders_ride_along_and_shrink_the_budget():
    cat = [*CATALOG, mixed(4, 128)]
    d = Driver(make_baseline("sglang", cat, max_num_batched_tokens=100, enable_mixed_chunk=True))
    a, b = d.admit(30, 5), d.admit(50, 5)
    assert d.step() == [(a, "P", 30), (b, "P", 50)]
    c = d.admit(200, 3)
    assert d.step() == [(c, "P", 98), (a, "D", 0), (b, "D", 0)]
    assert d.plans[-1].graph == mixed(4, 128)  # the catalog's mixed shape
    assert d.step() == [(c, "P", 98), (a, "D", 0), (b, "D", 0)]
    assert d.step() == [(c, "P", 4), (a, "D", 0), (b, "D", 0)]
    assert d.step() == [(a, "D", 0), (b, "D", 0), (c, "D", 0)]
    assert all(step_tokens(p) <= 100 for p in d.plans)
    # Without a mixed catalog shape the same step is charged as a synthesized MIXED.
    d = Driver(
        make_baseline("sglang", CATALOG, max_num_batched_tokens=100, enable_mixed_chunk=True)
    )
    d.admit(30, 5)
    d.admit(200, 3)
    assert d.step() == [(0, "P", 30), (1, "P", 70)]
    assert d.step() == [(1, "P", 99), (0, "D", 0)]
    assert d.plans[-1].graph == mixed(2, 128)
    assert not d.s.shapes.in_catalog(d.plans[-1].graph)


# --------------------------------------------------------------------- sarathi
def test_sarathi_every_decoder_every_step_within_512():
    d = Driver(make_baseline("sarathi", CATALOG))
    small = [d.admit(10, 20) for _ in range(5)]
    assert d.step() == [(r, "P", 10) for r in small]
    x = d.admit(2000, 3)
    decoders = [(r, "D", 0) for r in small]
    assert d.step() == [*decoders, (x, "P", 507)]
    y = d.admit(10, 2)
    assert d.step() == [*decoders, (x, "P", 507)]  # the partial prefill before the new one
    assert d.step() == [*decoders, (x, "P", 507)]
    assert d.step() == [*decoders, (x, "P", 479), (y, "P", 10)]
    assert d.step() == [*decoders, (x, "D", 0), (y, "D", 0)]
    for plan in d.plans:
        assert step_tokens(plan) <= 512
    assert [step_tokens(p) for p in d.plans] == [50, 512, 512, 512, 494, 7]


def test_sarathi_budget_must_cover_every_slot():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_baseline("sarathi", CATALOG, max_num_batched_tokens=32)
    assert make_baseline("sarathi", CATALOG, max_num_batched_tokens=32, max_slots=32)


# --------------------------------------------------------------------- vtc
def test_vtc_admits_from_the_smallest_counter_and_counts_1_and_2():
    d = Driver(make_baseline("vtc", CATALOG, max_slots=1))
    a1, a2, a3 = (d.admit(100, 2, tenant=0) for _ in range(3))
    b1, b2 = d.admit(10, 2, tenant=1), d.admit(10, 2, tenant=1)
    assert d.s.counters == {0: 0.0, 1: 0.0}
    assert d.step() == [(a1, "P", 100)]  # tie at 0: the earlier request
    # Prompt charged when scheduled (100), output when delivered (2 per token).
    assert d.s.counters == {0: 102.0, 1: 0.0}
    order = [a1]
    while d.s.plan() is not None:
        order += [h for h, phase, _ in d.step() if phase == "P"]
    assert order == [a1, b1, b2, a2, a3]  # FCFS would be a1, a2, a3, b1, b2
    # One per prompt token, two per output token.
    assert d.s.counters == {0: 3 * 100 + 2 * 2 * 3, 1: 2 * 10 + 2 * 2 * 2}


def test_vtc_weights_divide_the_charges():
    d = Driver(make_baseline("vtc", CATALOG, tenant_weights={1: 2.0}))
    d.admit(100, 3, tenant=0)
    d.admit(100, 3, tenant=1)
    while d.s.plan() is not None:
        d.step()
    assert d.s.counters == {0: 106.0, 1: 53.0}


def test_vtc_picks_again_within_a_step_after_charging_the_chunk():
    d = Driver(make_baseline("vtc", CATALOG))
    a1, a2 = d.admit(100, 2, tenant=0), d.admit(100, 2, tenant=0)
    b1, b2 = d.admit(60, 2, tenant=1), d.admit(60, 2, tenant=1)
    # a1 first (tie, earlier); then b1 (0 < 100), b2 (60 < 100), then a2 (100 < 120).
    assert d.step() == [(a1, "P", 100), (b1, "P", 60), (b2, "P", 60), (a2, "P", 100)]


def test_vtc_lifts_a_returning_tenant_to_the_smallest_waiting_counter():
    d = Driver(make_baseline("vtc", CATALOG, max_slots=1))
    a1, a2, _ = (d.admit(100, 2, tenant=0) for _ in range(3))
    assert d.step() == [(a1, "P", 100)]
    assert d.step() == [(a1, "D", 0)]  # a1 done: tenant 0 has 104 and still waits
    assert d.s.counters[0] == 104.0
    b = d.admit(10, 2, tenant=1)
    assert d.s.counters[1] == 104.0  # lifted from 0: no credit for idle time
    assert d.step() == [(a2, "P", 100)]  # tie at 104: the earlier request
    d.step()
    assert d.step() == [(b, "P", 10)]  # 104 < 208
    # A returning tenant whose own counter is higher keeps it (a max, not a reset).
    d2 = Driver(make_baseline("vtc", CATALOG, max_slots=1))
    b1, _ = d2.admit(10, 1, tenant=1), d2.admit(10, 1, tenant=1)
    a = d2.admit(500, 1, tenant=0)
    assert d2.step() == [(b1, "P", 10)]
    assert d2.step() == [(a, "P", 500)]  # 0 < 12
    assert d2.s.counters == {0: 502.0, 1: 12.0}
    d2.admit(10, 1, tenant=0)  # returns while tenant 1 waits at 12
    assert d2.s.counters == {0: 502.0, 1: 12.0}


def test_vtc_lift_when_nobody_waits_uses_the_last_leaver():
    d = Driver(make_baseline("vtc", CATALOG))
    d.admit(100, 2, tenant=0)
    d.step()
    assert d.s.last_left_counter == 100.0  # tenant 0 left the queue right after its chunk
    assert d.s.counters[0] == 102.0
    d.admit(10, 2, tenant=1)  # no tenant waits: lifted to the last leaver's counter
    assert d.s.counters[1] == 100.0
    d.admit(10, 2, tenant=2)  # tenant 1 waits now: lifted to its counter
    assert d.s.counters[2] == 100.0


def test_vtc_is_the_vllm_step_for_one_tenant():
    wl = make_workload(
        WorkloadConfig(
            requests=24, arrival_rate_per_s=40, prompt_len=(64, 3000), output_len=(4, 40), seed=3
        )
    )
    runs = {}
    for name in ("vllm", "vtc"):
        s = make_baseline(name, CATALOG, max_slots=8, max_num_batched_tokens=1024)
        sim = Simulation(s, PROFILE.duration_ns, wl)
        sim.run()
        runs[name] = (sim.frames_by_graph, [r.publications_ns for r in sim.requests.values()])
    assert runs["vllm"] == runs["vtc"]


def test_vtc_shields_the_steady_tenant_from_a_flood_in_the_simulator():
    """two_tenants: tenant 0 floods at 4x capacity, tenant 1 sends steadily."""
    catalog = build_catalog(BUCKETS, (1, 2, 4, 8, 16, 32, 64))
    wl = two_tenants(60.0, flood_factor=4.0, flood_requests=128, steady_requests=16, seed=0)
    worst_ttft = {}
    for name in ("vllm", "vtc"):
        sim = Simulation(make_baseline(name, catalog), PROFILE.duration_ns, wl)
        sim.run()
        assert all(r.finished_ns is not None for r in sim.requests.values())
        steady = [r.ttft_ns for r in sim.requests.values() if r.tenant == 1]
        assert len(steady) == 16
        worst_ttft[name] = max(steady)
    # Under vllm tenant 1 queues behind the flood; VTC admits it ahead (counters).
    assert worst_ttft["vtc"] * 4 < worst_ttft["vllm"]


# --------------------------------------------------------------------- fcfs
def test_fcfs_prefills_one_prompt_per_frame_then_decodes_the_oldest():
    d = Driver(FcfsScheduler(build_catalog(BUCKETS, (1, 2))))
    a, b, c = d.admit(100, 3), d.admit(5000, 3), d.admit(20, 3)
    assert d.step() == [(a, "P", 100)]
    assert d.step() == [(b, "P", 4096)]  # chunks of the largest bucket
    assert d.step() == [(b, "P", 904)]
    assert d.step() == [(c, "P", 20)]
    assert d.step() == [(a, "D", 0), (b, "D", 0)]  # the largest decode batch: 2
    assert d.step() == [(a, "D", 0), (b, "D", 0)]
    assert d.step() == [(c, "D", 0)]


# --------------------------------------------------------------------- API
def test_commit_and_complete_validate():
    s = make_baseline("vllm", CATALOG)
    s.admit(RequestSpec(64, 2))
    plan = s.plan()
    assert s.plan() is not plan  # a fresh plan supersedes it
    with pytest.raises(CommitError):
        s.commit(plan, 0)
    plan = s.plan()
    with pytest.raises(CommitError):
        s.commit(plan, -1)
    s.commit(plan, 5)
    assert s.plan() is None
    record = [CompletionRecord(plan.lanes[0].slot, plan.lanes[0].generation, (1,))]
    with pytest.raises(CompletionError, match="expected fence 5"):
        s.complete(4, record, TIMING)
    with pytest.raises(CompletionError):
        s.complete(5, [CompletionRecord(plan.lanes[0].slot, 99, (1,))], TIMING)
    with pytest.raises(CompletionError):
        s.complete(5, [*record, *record], TIMING)
    assert s.requests[0].prompt_done == 0  # refusals change nothing
    (token,) = s.complete(5, record, TIMING)
    assert token.first and not token.finished and s.requests[0].prompt_done == 64
    plan = s.plan()
    with pytest.raises(CommitError, match="not newer"):
        s.commit(plan, 5)
    s.commit(plan, 6)
    with pytest.raises(CompletionError, match="expected fence 6"):
        s.complete(5, record, TIMING)
    (token,) = s.complete(
        6, [CompletionRecord(plan.lanes[0].slot, plan.lanes[0].generation, (2,))], TIMING
    )
    assert token.finished and token.finish_reason == "length"
    assert s.plan() is None and not s.running


def test_make_baseline_rejects_bad_values_naming_the_argument():
    with pytest.raises(ValueError, match="name"):
        make_baseline("orca", CATALOG)
    for bad in (0, 65, True, "8"):
        with pytest.raises(ValueError, match="max_slots"):
            make_baseline("vllm", CATALOG, max_slots=bad)
    for name in ("vllm", "sglang", "sarathi", "vtc"):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            make_baseline(name, CATALOG, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_baseline("fcfs", CATALOG, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="enable_mixed_chunk"):
        make_baseline("vllm", CATALOG, enable_mixed_chunk=True)
    with pytest.raises(ValueError, match="enable_mixed_chunk"):
        make_baseline("sglang", CATALOG, enable_mixed_chunk="yes")
    with pytest.raises(ValueError, match="tenant_weights"):
        make_baseline("sglang", CATALOG, tenant_weights={1: 2.0})
    for weights in ({1: 0.0}, {1: -1.0}, {1: float("inf")}, {"a": 1.0}, [1.0]):
        with pytest.raises(ValueError, match="tenant_weights"):
            make_baseline("vtc", CATALOG, tenant_weights=weights)
    with pytest.raises(ValueError, match="catalog"):
        make_baseline("vllm", [*CATALOG, "decode"])
    defaults = {
        "vllm": 8192,
        "vtc": 8192,
        "sarathi": 512,
    }
    for name, budget in defaults.items():
        s = make_baseline(name, CATALOG)
        assert getattr(s, "max_num_batched_tokens", getattr(s, "token_budget", None)) == budget
    s = make_baseline("sglang", CATALOG)
    assert (s.chunked_prefill_size, s.enable_mixed_chunk) == (8192, False)
    assert make_baseline("vtc", CATALOG).tenant_aware
    assert not any(make_baseline(n, CATALOG).tenant_aware for n in BASELINE_NAMES if n != "vtc")


# --------------------------------------------------------------------- workload
class Recording:
    """Passes the API through, keeping every committed plan with the decoders then."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tenant_aware = inner.tenant_aware
        self.committed = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def commit(self, plan, fence):
        decoders = {r.handle.id for r in self.inner.decoders()}
        self.inner.commit(plan, fence)
        self.committed.append((plan, decoders, len(self.inner.running)))


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [(n, {}) for n in BASELINE_NAMES] + [("sglang", {"enable_mixed_chunk": True})],
    ids=[*BASELINE_NAMES, "sglang-mixed"],
)
def test_every_baseline_finishes_a_random_workload(name, kwargs):
    wl = make_workload(
        WorkloadConfig(
            requests=40,
            arrival_rate_per_s=60,
            prompt_len=(16, 6000),
            output_len=(1, 60),
            seed=11,
        )
    )
    # A few arrivals together, so steps batch several prompts.
    wl = [Arrival(a.at_ns // 4, a.spec) for a in wl]
    rec = Recording(make_baseline(name, CATALOG, max_slots=12, **kwargs))
    sim = Simulation(rec, PROFILE.duration_ns, wl, jitter=0.1, seed=5)
    sim.run()
    assert sim.done
    assert len(sim.requests) == 40
    for stats in sim.requests.values():
        assert stats.finished_ns is not None
        assert stats.output_tokens == stats.output_target
    budget = {"vllm": 8192, "vtc": 8192, "sarathi": 512, "sglang": 8192}.get(name)
    for plan, decoders, resident in rec.committed:
        assert resident <= 12
        assert len(plan.lanes) <= plan.graph.batch_capacity
        assert sum(lane.prompt_tokens for lane in plan.lanes) <= max(plan.graph.prompt_capacity, 0)
        if budget is not None:
            assert step_tokens(plan) <= budget
        if name == "sarathi":
            lanes = {lane.handle.id for lane in plan.lanes if lane.phase is LanePhase.DECODE}
            assert lanes == decoders
    assert rec.inner.synthesized_frames <= rec.inner.frames


# --------------------------------------------------------------------- prefix cache

CACHED = [(n, {}) for n in BASELINE_NAMES] + [
    ("sglang", {"enable_mixed_chunk": True}),
    ("fixed-width", {"speculative_width": 2}),
    ("table", {}),
    ("global-adaptive", {}),
]
CACHED_IDS = [*BASELINE_NAMES, "sglang-mixed", "fixed-width", "table", "global-adaptive"]
SYSTEM = tuple(range(1, 65))  # four pages of 16


def shared(user: int, base: int, system: tuple[int, ...] = SYSTEM, salt: str = "") -> RequestSpec:
    """``system`` then ``user`` ids from ``base`` (distinct bases: distinct messages)."""
    tokens = system + tuple(range(base, base + user))
    return RequestSpec(
        len(tokens), 4, message_endpoints=(len(system),), prompt_tokens=tokens, cache_salt=salt
    )


def first_prefills(d: Driver, ids: list[int], steps: int = 200) -> dict:
    """Step until none of ``ids`` is prefilling; each one's first prefill lane
    and the prompt tokens its lanes computed."""
    lanes: dict = {}
    computed = dict.fromkeys(ids, 0)
    for _ in range(steps):
        if not any(d.s.requests[i].prefilling for i in ids):
            return {i: (lanes[i], computed[i]) for i in ids}
        d.step()
        for lane in d.plans[-1].lanes:
            i = lane.handle.id
            if i in computed and lane.phase is LanePhase.PREFILL:
                lanes.setdefault(i, lane)
                computed[i] += lane.prompt_tokens
    raise AssertionError("prefills did not finish")


@pytest.mark.parametrize(("name", "kwargs"), CACHED, ids=CACHED_IDS)
def test_every_baseline_reuses_a_published_prefix_and_only_that(name, kwargs):
    s = make_baseline(name, CATALOG, max_slots=8, **kwargs)
    d = Driver(s)
    a = s.admit(shared(40, 1000)).id  # 104 tokens: pages 0-3 system, 4-5 its own
    ((lane_a, computed_a),) = first_prefills(d, [a]).values()
    assert lane_a.prompt_start == 0 and computed_a == 104 and s.requests[a].cached == 0
    b = s.admit(shared(30, 2000)).id  # the same system prompt, its own message
    other = s.admit(shared(30, 3000, system=tuple(range(5000, 5064)))).id
    salted = s.admit(shared(30, 4000, salt="tenant-b")).id
    plain = s.admit(RequestSpec(94, 4)).id  # no prompt tokens
    whole = s.admit(shared(0, 0)).id  # exactly the system prompt: 64 tokens, all cached
    got = first_prefills(d, [b, other, salted, plain, whole])
    # The sibling attaches the system prompt's four pages and computes only its message.
    assert got[b][0].prompt_start == 64 and got[b][1] == 30 and s.requests[b].cached == 64
    # Different tokens, a different salt, or no tokens: no reuse, the whole prompt computed.
    for i, n in ((other, 94), (salted, 94), (plain, 94)):
        assert got[i][0].prompt_start == 0 and got[i][1] == n and s.requests[i].cached == 0
    # Never the whole prompt: the last page (and so the last token) is computed.
    assert got[whole][0].prompt_start == 48 and got[whole][1] == 16
    # Requests finish as before, and the cached count rides on their tokens.
    gen = []
    for _ in range(100):
        plan = s.plan()
        if plan is None:
            break
        s.commit(plan, d.fence)
        records = [CompletionRecord(x.slot, x.generation, (7,) * x.max_tokens) for x in plan.lanes]
        gen += s.complete(d.fence, records, TIMING)
        d.fence += 1
    assert all(r.finished for r in s.requests.values())
    cached = {g.handle.id: g.cached_tokens for g in gen}
    assert cached[b] == 64 and cached[whole] == 48 and cached[plain] == 0


def test_a_sibling_attaches_pages_published_while_the_first_still_prefills():
    s = make_baseline("vllm", CATALOG, max_num_batched_tokens=512)
    d = Driver(s)
    system = tuple(range(1, 1025))  # 64 pages
    a = s.admit(shared(100, 10_000, system=system)).id  # 1124 tokens: chunks 512, 512, 100
    assert d.step() == [(a, "P", 512)]
    b = s.admit(shared(50, 20_000, system=system)).id
    assert d.step() == [(a, "P", 512)]  # the running prefill takes the whole budget
    # A's first two chunks are published: b attaches all 1024 system tokens
    # in the step that finishes a.
    assert d.step() == [(a, "P", 100), (b, "P", 50)]
    lane_b = d.plans[-1].lanes[1]
    assert lane_b.prompt_start == 1024 and s.requests[b].cached == 1024
    # Distinct full pages: the system prompt once, then a's 6 and b's 3 own ones.
    assert s.prefix_cache is not None and s.prefix_cache.pages == 64 + 6 + 3


@pytest.mark.parametrize("name", BASELINE_NAMES)
def test_prefix_caching_off_computes_every_prompt(name):
    s = make_baseline(name, CATALOG, prefix_caching=False)
    d = Driver(s)
    a = s.admit(shared(40, 1000)).id
    first_prefills(d, [a])
    b = s.admit(shared(30, 2000)).id
    ((lane, computed),) = first_prefills(d, [b]).values()
    assert lane.prompt_start == 0 and computed == 94 and s.requests[b].cached == 0
    with pytest.raises(ValueError, match="prefix_caching"):
        make_baseline(name, CATALOG, prefix_caching=1)


@pytest.mark.parametrize("name", BASELINE_NAMES)
def test_requests_without_prompt_tokens_run_as_without_the_cache(name):
    wl = make_workload(
        WorkloadConfig(requests=30, arrival_rate_per_s=80, prompt_len=(16, 3000),
                       output_len=(1, 40), seed=2)
    )  # fmt: skip
    runs = []
    for caching in (True, False):
        sim = Simulation(
            make_baseline(name, CATALOG, max_slots=8, prefix_caching=caching),
            PROFILE.duration_ns,
            wl,
        )
        sim.run()
        runs.append(
            (sim.frames_by_graph, [s.publications_ns for s in sim.requests.values()],
             sim.prompt_tokens_computed)
        )  # fmt: skip
    assert runs[0] == runs[1]
    assert runs[0][2] == sum(a.spec.prompt_len for a in wl)
