"""The differential test of selection (issue 25): ``Scheduler.plan()`` chooses
exactly what the reference selection (``tests/support/reference``) chooses: the
same graph, cohort, lane order, query lengths or ceilings, prompt row and
reason, with the score equal to 1e-9 relative.

States come from three sources, at least 20,000 in all:

* the random explorer (``tests/support/differential.py``): every program kind
  (prefill, decode, width-one and wide mixed, rectangular, ragged and
  device-allocated speculative, restore and snapshot pairs), queued frames,
  stale entries, refresh and probe credit, both policy presets, fixed width;
* hypothesis, drawing the explorer's settings and seeds;
* the scheduling simulator (``scripts/scheduling_sim``) on the benchmark's
  192-descriptor catalog (``scripts/bench_scheduler.py``), up to 32 active
  requests.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.differential import Explorer
from tests.support.reference.planning import plan_differences, reference_plan

EXPLORER_SEEDS = 100  # x STATES_PER_SEED: 20,000 states
STATES_PER_SEED = 200
CHUNKS = 10


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_states_choose_what_the_reference_chooses(chunk):
    seeds = range(chunk * EXPLORER_SEEDS // CHUNKS, (chunk + 1) * EXPLORER_SEEDS // CHUNKS)
    compared = 0
    for seed in seeds:
        explorer = Explorer(seed)
        explorer.run(STATES_PER_SEED)
        assert not explorer.differences, "\n".join(explorer.differences[:10])
        compared += explorer.compared
    assert compared == STATES_PER_SEED * len(seeds)


def test_long_runs_reach_refresh_probes_and_restores():
    """Longer runs, where timing refresh, acceptance probes, restores and packed
    prefills happen: they are compared too (and the explorer does reach them)."""
    from runtime.catalog import GraphKind
    from runtime.coordinator.plan import SelectionReason

    seen_reasons, seen_kinds, packed_rows = set(), set(), set()
    for seed in range(1000, 1012):
        explorer = Explorer(seed)
        original = explorer.compare

        def compare(original=original):
            plan = original()
            if plan is not None:
                seen_reasons.add(plan.reason)
                seen_kinds.add(plan.graph.kind)
                if plan.graph.kind is GraphKind.PREFILL and plan.graph.batch_capacity > 1:
                    packed_rows.add(len(plan.lanes))
            return plan

        explorer.compare = compare
        explorer.run(1500)
        assert not explorer.differences, "\n".join(explorer.differences[:10])
    assert {SelectionReason.TIMING_REFRESH, SelectionReason.ACCEPTANCE_LEARNING} <= seen_reasons
    assert {GraphKind.RESTORE, GraphKind.SNAPSHOT, GraphKind.MIXED} <= seen_kinds
    assert max(packed_rows, default=0) >= 2  # packed prefills of several rows are compared


@settings(
    max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
@given(
    seed=st.integers(0, 2**32 - 1),
    speculation=st.booleans(),
    states=st.booleans(),
    comparisons=st.integers(1, 120),
)
def test_hypothesis_states_choose_what_the_reference_chooses(
    seed, speculation, states, comparisons
):
    explorer = Explorer(seed, speculation=speculation, states=states)
    explorer.run(comparisons)
    assert not explorer.differences, "\n".join(explorer.differences[:10])


@pytest.mark.parametrize("population", [8, 32])
def test_simulator_states_on_the_benchmark_catalog(population):
    """The bench's catalog and workload (every graph measured, arrivals at 400/s),
    each plan the simulator asks for compared until the run has served a while."""
    from runtime.coordinator.config import SchedulerConfig
    from runtime.coordinator.scheduler import Scheduler
    from scripts.bench_scheduler import bench_catalog
    from scripts.scheduling_sim.catalogs import PROFILES
    from scripts.scheduling_sim.engine import Simulation
    from scripts.scheduling_sim.workload import WorkloadConfig, make_workload

    profile = PROFILES["llama1b-h100"]
    sched = Scheduler(bench_catalog(), SchedulerConfig(max_slots=64))
    sched.advance_to(1)
    for desc in sched.catalog.descriptors:
        sched.catalog.observe(desc, profile.duration_ns(desc), 1)
    workload = make_workload(
        WorkloadConfig(requests=population, arrival_rate_per_s=400.0, prompt_len=(64, 1024),
                       output_len=(16, 256), seed=population)
    )  # fmt: skip
    differences: list[str] = []
    compared = [0]
    fast_plan = sched.plan

    def plan():
        fast = fast_plan()
        compared[0] += 1
        differences.extend(plan_differences(fast, reference_plan(sched)))
        return fast

    sched.plan = plan  # type: ignore[method-assign]
    sim = Simulation(sched, profile.duration_ns, workload, seed=population)
    limit = 150  # packed prefills: the 8-request run has about 180 plans
    sim.run(stop=lambda s: compared[0] >= limit)
    assert not differences, "\n".join(differences[:10])
    assert compared[0] >= limit
