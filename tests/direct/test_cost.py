"""The 7/8 moving average, its reversion to unmeasured after 30 s, and the cost sample."""

from __future__ import annotations

import pytest

from runtime.coordinator.errors import SchedulerError
from runtime.coordinator.records import ExecutionTiming
from runtime.direct import DirectConfig, cost_sample_ns
from runtime.direct.cost import DirectCatalog
from tests.support.direct_rig import MS, Rig, S, catalog, decode, prefill, timing

TTL = 30 * S


def fresh() -> DirectCatalog:
    return DirectCatalog(catalog(), 1 / 8, TTL)


def test_first_sample_sets_then_each_moves_an_eighth() -> None:
    c = fresh()
    d = decode(4)
    assert c.entry(d).estimate_ns == 0 and not c.entry(d).measured
    assert c.observe(d, 8 * MS, 0)
    assert c.entry(d).estimate_ns == 8 * MS
    c.observe(d, 16 * MS, 1)
    assert c.entry(d).estimate_ns == 9 * MS  # 7/8 * 8 + 1/8 * 16
    c.observe(d, 1 * MS, 2)
    assert c.entry(d).mean_ns == pytest.approx(7 / 8 * 9 * MS + 1 / 8 * MS)
    estimate = 8.0
    c2 = fresh()
    c2.observe(d, 8 * MS, 0)
    for sample in (16, 1, 4, 4, 30):
        c2.observe(d, sample * MS, 0)
        estimate = 7 / 8 * estimate + 1 / 8 * sample
    assert c2.entry(d).estimate_ns == round(estimate * MS)
    assert c2.estimates()["decode B=4"] == round(estimate * MS)
    assert c2.estimates()["prefill B=1 C=64"] == 0


def test_non_positive_samples_are_not_measurements() -> None:
    c = fresh()
    d = decode(2)
    assert not c.observe(d, 0, 5)
    assert not c.entry(d).measured and c.entry(d).last_sample_ns is None
    c.observe(d, 4 * MS, 5)
    assert not c.observe(d, 0, 6)
    assert c.entry(d).estimate_ns == 4 * MS and c.entry(d).last_sample_ns == 5


def test_an_estimate_reverts_to_unmeasured_after_30_s_without_a_sample() -> None:
    c = fresh()
    d, p = decode(1), prefill(64)
    c.observe(d, 2 * MS, 0)
    c.observe(p, 3 * MS, 10 * S)
    assert c.expire(TTL - 1) == []
    assert c.entry(d).estimate_ns == 2 * MS
    assert c.expire(TTL) == [d]  # 30 s since its last sample
    assert not c.entry(d).measured and c.entry(d).estimate_ns == 0
    assert c.entry(p).estimate_ns == 3 * MS
    c.observe(d, 6 * MS, TTL + 1)  # starts afresh: no memory of the 2 ms
    assert c.entry(d).estimate_ns == 6 * MS
    assert c.expire(40 * S) == [p]


def test_a_sample_keeps_an_estimate_fresh() -> None:
    c = fresh()
    d = decode(8)
    for t in range(0, 300 * S, 20 * S):  # a sample every 20 s: never 30 s without one
        c.observe(d, 5 * MS, t)
        assert c.expire(t + 19 * S) == []
    assert c.entry(d).estimate_ns == 5 * MS


def test_reversion_runs_on_advance_to() -> None:
    rig = Rig()
    rig.measure_all()
    assert all(rig.s.catalog.estimates().values())
    rig.tick(TTL - 1)
    assert all(rig.s.catalog.estimates().values())
    rig.tick(1)
    assert not any(rig.s.catalog.estimates().values())


def test_a_shorter_ttl_comes_from_the_config() -> None:
    rig = Rig(direct=DirectConfig(estimate_ttl_ns=5 * S))
    rig.measure_all()
    rig.tick(5 * S)
    assert not any(rig.s.catalog.estimates().values())
    with pytest.raises(SchedulerError, match="estimate_ttl_ns"):
        DirectConfig(estimate_ttl_ns=0)
    with pytest.raises(SchedulerError, match="sample_weight"):
        DirectConfig(sample_weight=0)


def test_the_cost_sample_is_the_largest_interval_less_its_launch_wait() -> None:
    assert cost_sample_ns(timing(5 * MS)) == 5 * MS
    two = ExecutionTiming((5 * MS, 7 * MS), rank_launch_wait_ns=(0, 4 * MS))
    assert cost_sample_ns(two) == 5 * MS  # max(5 - 0, 7 - 4)
    assert cost_sample_ns(ExecutionTiming((3 * MS, 2 * MS))) == 3 * MS  # no waits reported
    assert cost_sample_ns(ExecutionTiming((3 * MS,), rank_launch_wait_ns=(3 * MS,))) == 0
    assert cost_sample_ns(ExecutionTiming((0, 0))) == 0
    # The readiness delay is not subtracted (direct mode's rule).
    assert cost_sample_ns(ExecutionTiming((4 * MS,), readiness_delay_ns=MS)) == 4 * MS
