"""Simulator metrics (goodput, slowdown fairness, tenants), tenants in the engine and
the solo latency."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.requests import RequestHandle, RequestSpec
from runtime.coordinator.scheduler import Scheduler
from scripts.scheduling_sim.baselines import FcfsScheduler
from scripts.scheduling_sim.catalogs import PROFILES, build_catalog
from scripts.scheduling_sim.engine import (
    RequestStats,
    Simulation,
    solo_frames,
    solo_latency_ns,
)
from scripts.scheduling_sim.metrics import jain, summarize
from scripts.scheduling_sim.workload import Arrival, two_tenants

MS = 1_000_000


def stats(
    i: int,
    *,
    arrival_ms: float = 0.0,
    ttft_ms: float,
    e2e_ms: float | None,
    tokens: int,
    tenant: int = 0,
) -> RequestStats:
    """A request whose outputs are evenly spaced from TTFT to e2e."""
    arrival = int(arrival_ms * MS)
    first = arrival + int(ttft_ms * MS)
    if e2e_ms is None:
        pubs = [first]
        finished = None
    else:
        last = arrival + int(e2e_ms * MS)
        step = (last - first) // max(1, tokens - 1)
        pubs = [first + k * step for k in range(tokens - 1)] + [last]
        finished = last
    return RequestStats(
        RequestHandle(i),
        arrival,
        prompt_len=64,
        output_target=tokens,
        publications_ns=pubs,
        output_tokens=len(pubs) if finished is None else tokens,
        finished_ns=finished,
        tenant=tenant,
    )


def fake_sim(requests: list[RequestStats], now_ms: float | None = None) -> SimpleNamespace:
    end = max((r.finished_ns or 0 for r in requests), default=0)
    return SimpleNamespace(
        requests={r.handle.id: r for r in requests},
        now_ns=int(now_ms * MS) if now_ms is not None else end,
        frames=0,
        busy_ns=0,
        frames_by_graph={},
        catalog=None,
    )


def test_jain():
    assert jain([2.0, 2.0, 2.0]) == 1.0
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain([]) == 1.0


def test_goodput_counts_requests_under_both_thresholds():
    reqs = [
        stats(0, ttft_ms=100, e2e_ms=100 + 9 * 20, tokens=10),  # TTFT ok, TPOT 20: good
        stats(1, ttft_ms=600, e2e_ms=600 + 9 * 20, tokens=10),  # TTFT too late
        stats(2, ttft_ms=100, e2e_ms=100 + 9 * 60, tokens=10),  # TPOT 60: too slow
        stats(3, ttft_ms=500, e2e_ms=500 + 9 * 50, tokens=10),  # both exactly at the limit
        stats(4, ttft_ms=200, e2e_ms=200, tokens=1),  # one token: TPOT 0
        stats(5, ttft_ms=100, e2e_ms=None, tokens=10),  # unfinished
    ]
    sim = fake_sim(reqs, now_ms=2000)
    report = summarize(sim, ttft_slo_ms=500, tpot_slo_ms=50, solo_ns=lambda s: 100 * MS)
    assert report["goodput_ttft_slo_ms"] == 500 and report["goodput_tpot_slo_ms"] == 50
    assert report["goodput_fraction"] == pytest.approx(3 / 6, abs=1e-4)
    # Over the span: first arrival (0) to the last finish, or now (2 s) while unfinished.
    assert report["sim_seconds"] == 2.0 and report["goodput_req_per_s"] == 1.5
    finished = summarize(fake_sim(reqs[:5]), ttft_slo_ms=500, tpot_slo_ms=50)
    assert finished["goodput_req_per_s"] == pytest.approx(3 / 0.95, abs=1e-3)
    strict = summarize(sim, ttft_slo_ms=150, tpot_slo_ms=50, solo_ns=lambda s: 100 * MS)
    assert strict["goodput_fraction"] == pytest.approx(1 / 6, abs=1e-4)
    assert reqs[0].tpot_ns == pytest.approx(20 * MS)


def test_fairness_is_jain_over_slowdown():
    # Different sizes, the same slowdown: perfectly fair.
    reqs = [
        stats(0, ttft_ms=10, e2e_ms=200, tokens=10),
        stats(1, ttft_ms=10, e2e_ms=2000, tokens=100),
    ]
    solo = {0: 100 * MS, 1: 1000 * MS}
    report = summarize(fake_sim(reqs), solo_ns=lambda s: solo[s.handle.id])
    assert report["fairness_jain"] == 1.0
    assert report["slowdown_p50"] == report["slowdown_p99"] == 2.0
    assert "jain_fairness" not in report
    # Slowdowns 1 and 3: Jain (4^2) / (2 * 10) = 0.8.
    reqs[1] = stats(1, ttft_ms=10, e2e_ms=3000, tokens=100)
    solo[0] = 200 * MS
    report = summarize(fake_sim(reqs), solo_ns=lambda s: solo[s.handle.id])
    assert report["fairness_jain"] == 0.8
    assert report["slowdown_p50"] == 1.0 and report["slowdown_p99"] == 3.0
    # Single tenant: no per-tenant keys.
    assert "tenant_slowdown_mean" not in report and "fairness_jain_tenants" not in report


def test_unfinished_requests_count_their_residence():
    reqs = [
        stats(0, ttft_ms=10, e2e_ms=100, tokens=5),
        stats(1, ttft_ms=10, e2e_ms=None, tokens=5),
    ]
    report = summarize(fake_sim(reqs, now_ms=400), solo_ns=lambda s: 100 * MS)
    assert report["slowdown_p99"] == 4.0 and report["finished"] == 1


def test_per_tenant_metrics():
    reqs = [
        stats(0, ttft_ms=10, e2e_ms=100, tokens=5, tenant=0),
        stats(1, ttft_ms=30, e2e_ms=300, tokens=5, tenant=0),
        stats(2, ttft_ms=50, e2e_ms=100, tokens=5, tenant=1),
        stats(3, ttft_ms=70, e2e_ms=100, tokens=5, tenant=1),
    ]
    report = summarize(fake_sim(reqs), solo_ns=lambda s: 100 * MS)
    assert report["tenant_slowdown_mean"] == {"0": 2.0, "1": 1.0}
    assert report["fairness_jain_tenants"] == round(jain([2.0, 1.0]), 4) == 0.9
    assert report["tenant_ttft_ms_p99"] == {"0": 30.0, "1": 70.0}
    assert report["fairness_jain"] == round(jain([1.0, 3.0, 1.0, 1.0]), 4)


def test_without_catalog_fairness_is_unknown():
    reqs = [stats(0, ttft_ms=10, e2e_ms=100, tokens=5)]
    report = summarize(fake_sim(reqs))
    assert report["fairness_jain"] is None and report["ttft_ms_p50"] == 10.0


# -- the engine: tenants and the solo latency --------------------------------------------

CATALOG = build_catalog((64, 128, 256, 512, 1024), (1, 2, 4, 8))


@pytest.mark.parametrize("profile", ["llama1b-h100", "llama8b-h100-additive"])
@pytest.mark.parametrize(
    ("prompt", "output"),
    [(1, 1), (64, 1), (65, 7), (1024, 3), (1025, 2), (2048, 5), (3000, 40), (700, 128)],
)
def test_solo_latency_equals_fcfs_simulation_alone(profile, prompt, output):
    duration = PROFILES[profile].duration_ns
    spec = RequestSpec(prompt, output)
    sim = Simulation(FcfsScheduler(CATALOG), duration, [Arrival(3 * MS, spec)])
    sim.run()
    (only,) = sim.requests.values()
    expected = solo_latency_ns(spec, CATALOG, duration, sim.host_delay_ns)
    assert only.e2e_ns == expected
    assert sim.frames == len(solo_frames(spec, CATALOG))
    assert Simulation(object(), duration, [], catalog=CATALOG).solo_ns(only) == expected


def test_solo_frames_chunks_then_decodes():
    frames = solo_frames(RequestSpec(2100, 3), CATALOG)
    assert [f.describe() for f in frames] == [
        "prefill B=1 C=1024",
        "prefill B=1 C=1024",
        "prefill B=1 C=64",
        "decode B=1",
        "decode B=1",
    ]
    host = 50_000
    assert solo_latency_ns(RequestSpec(64, 1), CATALOG, lambda d: 7, host) == 7 + host


def test_simulation_finds_the_production_catalog():
    sched = Scheduler(CATALOG, SchedulerConfig(max_slots=8))
    sim = Simulation(sched, PROFILES["llama1b-h100"].duration_ns, [])
    assert sim.catalog == tuple(CATALOG)


class _TenantAware(FcfsScheduler):
    tenant_aware = True

    def __init__(self, catalog):
        super().__init__(catalog)
        self.tenants: list[int] = []

    def admit(self, spec, tenant=0):
        self.tenants.append(tenant)
        return super().admit(spec)


class _Plain(FcfsScheduler):
    def admit(self, spec):  # no tenant argument: must not be passed one
        return super().admit(spec)


def test_tenants_reach_tenant_aware_schedulers_and_stats():
    arrivals = [a for a in two_tenants(200.0, flood_requests=6, steady_requests=3)]
    arrivals = [
        Arrival(a.at_ns, RequestSpec(min(a.spec.prompt_len, 256), 4), a.tenant) for a in arrivals
    ]
    duration = PROFILES["llama1b-h100"].duration_ns
    aware = _TenantAware(CATALOG)
    sim = Simulation(aware, duration, arrivals, catalog=CATALOG).run()
    by_time = sorted(arrivals, key=lambda a: a.at_ns)
    assert aware.tenants == [a.tenant for a in by_time]
    assert sorted(s.tenant for s in sim.requests.values()) == sorted(a.tenant for a in arrivals)
    report = summarize(sim)
    assert set(report["tenant_slowdown_mean"]) == {"0", "1"}
    assert 0 < report["fairness_jain_tenants"] <= 1
    plain = Simulation(_Plain(CATALOG), duration, arrivals, catalog=CATALOG).run()
    assert plain.done and {s.tenant for s in plain.requests.values()} == {0, 1}
