"""Duration estimates: cost samples, the nine-sample median, staleness (spec, "Duration
estimates"; docs/design.md, "Estimates, worked")."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.cost import WINDOW, CostCatalog, CostEntry, cost_sample_ns
from runtime.coordinator.plan import SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler

MS = 1_000_000
TTL = 30_000_000_000  # the default 30 s freshness interval
DECODE4 = GraphDescriptor(GraphKind.DECODE, 4)

# -------------------------------------------------------------- cost samples


@pytest.mark.parametrize(
    ("ranks", "delay", "expected"),
    [
        ((5 * MS,), 0, 5 * MS),
        ((5 * MS, 9 * MS, 7 * MS), 0, 9 * MS),  # the maximum rank interval
        ((5 * MS, 9 * MS, 7 * MS), 2 * MS, 7 * MS),  # minus exposed readiness delay
        ((0, 4 * MS), 0, 4 * MS),  # a zero rank does not hide the others
        ((-3 * MS, 4 * MS), MS, 3 * MS),  # only positive intervals count
        ((4 * MS,), -MS, 4 * MS),  # a negative delay adds nothing
        ((4 * MS,), 4 * MS, 0),  # nothing positive left: no observation
        ((4 * MS,), 5 * MS, 0),
        ((0,), 0, 0),
        ((0, 0, 0), MS, 0),
        ((), 0, 0),
        ((-1,), 0, 0),
    ],
)
def test_cost_sample(ranks, delay, expected):
    assert cost_sample_ns(ranks, delay) == expected


def test_cost_sample_default_delay_is_zero():
    assert cost_sample_ns((3 * MS, 2 * MS)) == 3 * MS


# ----------------------------------------------------------------- CostEntry


def fresh_entry() -> CostEntry:
    return CostEntry(DECODE4)


def test_new_entry_is_indeterminate():
    entry = fresh_entry()
    assert entry.estimate_ns == 0
    assert not entry.known
    assert not entry.stale(10 * TTL, TTL)  # never measured: indeterminate, not stale
    assert not entry.fresh(0, TTL)
    assert entry.observation_age_ns(5) is None


def test_entry_ignores_descriptor_estimate():
    entry = CostEntry(GraphDescriptor(GraphKind.DECODE, 4, estimated_duration_ns=9 * MS))
    assert entry.estimate_ns == 0
    assert not entry.known


def test_first_observation_sets_estimate():
    entry = fresh_entry()
    assert entry.observe(7 * MS, 100, TTL) is True
    assert entry.estimate_ns == 7 * MS
    assert entry.known
    assert entry.fresh(100, TTL)
    assert entry.last_valid_ns == 100
    assert entry.observation_age_ns(150) == 50


def test_notes_median_example():
    entry = fresh_entry()
    for t, sample in enumerate((10, 12, 30)):
        entry.observe(sample * MS, t, TTL)
    assert entry.estimate_ns == 12 * MS
    entry.observe(11 * MS, 3, TTL)
    assert entry.estimate_ns == 11_500_000  # (11 + 12) / 2


def test_two_samples_average_the_middle_pair():
    entry = fresh_entry()
    entry.observe(90 * MS, 0, TTL)
    entry.observe(10 * MS, 1, TTL)
    assert entry.estimate_ns == 50 * MS


def test_tenth_observation_drops_the_oldest():
    assert WINDOW == 9
    entry = fresh_entry()
    for t, sample in enumerate((90, 10, 20, 30, 40, 50, 60, 70, 80)):
        entry.observe(sample * MS, t, TTL)
    assert entry.estimate_ns == 50 * MS  # median of nine
    entry.observe(15 * MS, 9, TTL)
    # Window is now 10..80 and 15: the 90 fell out.  Keeping ten would give 45.
    assert entry.estimate_ns == 40 * MS
    assert len(entry.samples) == 9
    assert 90 * MS not in entry.samples


def test_window_slides_over_many_observations():
    entry = fresh_entry()
    for t in range(30):
        entry.observe((t + 1) * MS, t, TTL)
    # Last nine are 22..30 ms.
    assert entry.estimate_ns == 26 * MS


def test_entry_goes_stale_after_ttl_and_keeps_its_cost():
    entry = fresh_entry()
    entry.observe(8 * MS, 1_000, TTL)
    assert entry.fresh(1_000 + TTL - 1, TTL)
    assert not entry.stale(1_000 + TTL - 1, TTL)
    assert entry.stale(1_000 + TTL + 1, TTL)
    assert not entry.fresh(1_000 + TTL + 1, TTL)
    # Elapsed time never makes a measured graph unknown.
    assert entry.known
    assert entry.stale(1_000 + 1_000 * TTL, TTL)
    assert entry.known
    assert entry.estimate_ns == 8 * MS


def test_first_valid_observation_of_stale_entry_replaces_estimate():
    entry = fresh_entry()
    for t, sample in enumerate((10, 12, 30, 11)):
        entry.observe(sample * MS, t, TTL)
    assert entry.estimate_ns == 11_500_000
    later = 3 + TTL + 1
    assert entry.stale(later, TTL)
    entry.observe(100 * MS, later, TTL)
    assert entry.estimate_ns == 100 * MS  # replaced, not folded into the median
    assert entry.fresh(later, TTL)
    assert entry.last_valid_ns == later
    # The window restarted: the next median uses only 100 and 20.
    entry.observe(20 * MS, later + 1, TTL)
    assert entry.estimate_ns == 60 * MS
    assert sorted(entry.samples) == [20 * MS, 100 * MS]


@pytest.mark.parametrize("bad", [0, -1, -5 * MS])
def test_invalid_sample_changes_nothing(bad):
    entry = fresh_entry()
    assert entry.observe(bad, 10, TTL) is False
    assert not entry.known
    assert entry.last_valid_ns is None
    entry.observe(10 * MS, 20, TTL)
    entry.observe(30 * MS, 21, TTL)
    samples = list(entry.samples)
    assert entry.observe(bad, 22, TTL) is False
    assert entry.estimate_ns == 20 * MS
    assert list(entry.samples) == samples
    assert entry.last_valid_ns == 21


def test_invalid_sample_does_not_refresh_freshness():
    entry = fresh_entry()
    entry.observe(10 * MS, 0, TTL)
    assert entry.observe(0, TTL - 1, TTL) is False
    assert entry.stale(TTL + 1, TTL)  # measured from the valid observation at 0
    assert entry.observe(0, TTL + 5, TTL) is False
    assert entry.stale(TTL + 5, TTL)
    assert entry.estimate_ns == 10 * MS
    assert entry.known


def test_catalog_version_bumps_only_on_valid_observation():
    catalog = CostCatalog([DECODE4, GraphDescriptor(GraphKind.DECODE, 1)], TTL)
    v0 = catalog.version
    assert catalog.observe(DECODE4, 0, 0) is False
    assert catalog.version == v0
    assert catalog.observe(DECODE4, 3 * MS, 1) is True
    assert catalog.version == v0 + 1
    assert catalog.estimates() == {"decode B=4": 3 * MS, "decode B=1": 0}


def test_catalog_unknown_graph_raises_key_error():
    catalog = CostCatalog([DECODE4], TTL)
    with pytest.raises(KeyError):
        catalog.entry(GraphDescriptor(GraphKind.DECODE, 8))


# ------------------------------------------------------- through the Scheduler


def _records(plan):
    return [
        CompletionRecord(lane.slot, lane.generation, (1,) * lane.max_tokens) for lane in plan.lanes
    ]


def test_supplied_estimates_start_indeterminate():
    catalog = [
        GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64, estimated_duration_ns=4 * MS),
        GraphDescriptor(GraphKind.DECODE, 1, estimated_duration_ns=2 * MS),
    ]
    scheduler = Scheduler(catalog)
    assert set(scheduler.catalog.estimates().values()) == {0}
    scheduler.admit(RequestSpec(prompt_len=64, max_output_tokens=4))
    plan = scheduler.plan()
    assert plan is not None
    assert plan.reason is SelectionReason.DISCOVERY
    assert plan.estimated_duration_ns == 0
    assert plan.requires_empty_window
    assert plan.graph.kind is GraphKind.PREFILL


def test_zero_device_interval_neither_measures_nor_freshens():
    catalog = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64, estimated_duration_ns=MS)]
    scheduler = Scheduler(catalog)
    scheduler.admit(RequestSpec(prompt_len=256, max_output_tokens=4))
    plan = scheduler.plan()
    scheduler.commit(plan, 1)
    scheduler.complete(1, _records(plan), ExecutionTiming((0, 0), host_wall_ns=3 * MS))
    assert scheduler.catalog.estimates() == {"prefill B=1 C=64": 0}
    plan = scheduler.plan()
    assert plan.reason is SelectionReason.DISCOVERY


def test_scheduler_estimate_is_corrected_max_rank_interval():
    catalog = [GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)]
    scheduler = Scheduler(catalog)
    scheduler.admit(RequestSpec(prompt_len=256, max_output_tokens=4))
    plan = scheduler.plan()
    scheduler.commit(plan, 1)
    timing = ExecutionTiming((3 * MS, 5 * MS), readiness_delay_ns=MS, host_wall_ns=9 * MS)
    scheduler.complete(1, _records(plan), timing)
    # max rank interval minus readiness delay; wall time never enters the cost.
    assert scheduler.catalog.estimates() == {"prefill B=1 C=64": 4 * MS}
    plan = scheduler.plan()
    assert plan.reason is SelectionReason.ORDINARY
    assert plan.estimated_duration_ns == 4 * MS
