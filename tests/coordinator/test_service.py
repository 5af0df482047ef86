"""Service prices: the entropy-dual rate update and the catalog normalizers."""

from __future__ import annotations

import itertools
import math

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.cost import CostCatalog
from runtime.coordinator.service import (
    catalog_normalizers,
    update_rate,
)

MS = 1_000_000
TTL = 30_000_000_000

# -------------------------------------------------------------- update_rate

CASES = [
    # (rate, ref, dt_ms, tau_ms)
    (1.0, 1.0, 10.0, 100.0),
    (0.05, 2.0, 3.5, 100.0),
    (4.0, 0.25, 250.0, 100.0),
    (1e-4, 50.0, 0.1, 7.0),
    (123.0, 1e-3, 1e4, 1e3),
]


@pytest.mark.parametrize(("rate", "ref", "dt", "tau"), CASES)
def test_starvation_raises_normalized_price_by_dt_over_tau(rate, ref, dt, tau):
    new = update_rate(rate, ref, dt, 0.0, tau)
    assert new < rate
    assert ref / new - ref / rate == pytest.approx(dt / tau, rel=1e-6)


@pytest.mark.parametrize(("rate", "ref", "dt", "tau"), CASES)
def test_repeated_starvation_is_linear_in_time(rate, ref, dt, tau):
    current = rate
    for _ in range(50):
        current = update_rate(current, ref, dt, 0.0, tau)
    assert ref / current - ref / rate == pytest.approx(50 * dt / tau, rel=1e-6)


@pytest.mark.parametrize(
    ("rate", "ref", "tau", "served"),
    [
        (rate, ref, tau, served)
        for rate, ref, _, tau in CASES
        for served in (0.5, 1.0, 64.0)
        if served / (tau * ref) <= 40  # below the overflow guard
    ],
)
def test_service_only_multiplies_rate(rate, ref, tau, served):
    new = update_rate(rate, ref, 0.0, served, tau)
    assert new == pytest.approx(rate * math.exp(served / (tau * ref)), rel=1e-12)
    assert new > rate


def test_no_time_and_no_service_changes_nothing():
    assert update_rate(0.37, 2.0, 0.0, 0.0, 100.0) == pytest.approx(0.37, rel=1e-15)


def test_combined_step_is_starvation_then_service():
    rate, ref, dt, served, tau = 0.8, 1.5, 12.0, 3.0, 100.0
    starved = update_rate(rate, ref, dt, 0.0, tau)
    expected = update_rate(starved, ref, 0.0, served, tau)
    assert update_rate(rate, ref, dt, served, tau) == pytest.approx(expected, rel=1e-12)


def test_more_service_means_higher_rate_and_lower_price():
    low = update_rate(1.0, 1.0, 10.0, 1.0, 100.0)
    high = update_rate(1.0, 1.0, 10.0, 5.0, 100.0)
    assert high > low


def test_longer_starvation_means_lower_rate():
    short = update_rate(1.0, 1.0, 1.0, 0.0, 100.0)
    long = update_rate(1.0, 1.0, 100.0, 0.0, 100.0)
    assert long < short < 1.0


EXTREME_RATES = [1e-12, 1e-6, 1.0, 1e6, 1e12]
EXTREME_REFS = [1e-9, 1e-3, 1.0, 1e3, 1e9]
EXTREME_DTS = [0.0, 1e-9, 1.0, 1e6, 1e12]
EXTREME_SERVED = [0.0, 1e-9, 1.0, 1e6, 1e12, 1e18]
EXTREME_TAUS = [1e-3, 1.0, 100.0, 1e6]


def test_result_positive_and_finite_for_extreme_inputs():
    bad = []
    for rate, ref, dt, served, tau in itertools.product(
        EXTREME_RATES, EXTREME_REFS, EXTREME_DTS, EXTREME_SERVED, EXTREME_TAUS
    ):
        new = update_rate(rate, ref, dt, served, tau)
        if not (math.isfinite(new) and new > 0):
            bad.append((rate, ref, dt, served, tau, new))
    assert bad == []


@pytest.mark.parametrize(
    ("ref", "dt", "served", "tau"),
    [
        (1e-3, 1e-6, 1e9, 1e-3),  # enormous service in a tiny interval
        (1e3, 1e6, 0.0, 1e-3),  # enormous starvation
        (1e-9, 1e-9, 1e18, 1e6),
        (1.0, 1.0, 1e300, 1.0),
    ],
)
def test_repeated_extreme_updates_stay_positive_and_finite(ref, dt, served, tau):
    rate = 1.0
    for _ in range(2_000):
        rate = update_rate(rate, ref, dt, served, tau)
        assert math.isfinite(rate)
        assert rate > 0


@pytest.mark.parametrize(
    ("served", "dt", "ref", "tau"),
    [
        (1.0, 10.0, 1.0, 100.0),  # one token per 10 ms decode frame
        (64.0, 4.0, 32.0, 100.0),  # a 64-token prefill chunk every 4 ms
        (1.0, 25.0, 0.5, 100.0),
        (3.0, 8.0, 2.0, 250.0),
    ],
)
@pytest.mark.parametrize("start_factor", [1e-3, 1.0, 1e3])
def test_periodic_service_converges_to_its_rate(served, dt, ref, tau, start_factor):
    assert served / (tau * ref) <= 0.03  # the small-step regime
    target = served / dt
    rate = target * start_factor
    for _ in range(4_000):
        rate = update_rate(rate, ref, dt, served, tau)
    assert rate == pytest.approx(target, rel=0.03)
    # And it stays there.
    again = update_rate(rate, ref, dt, served, tau)
    assert again == pytest.approx(rate, rel=1e-6)


# --------------------------------------------------------- catalog normalizers


def _catalog(measured: dict[GraphDescriptor, int], unmeasured=()) -> CostCatalog:
    catalog = CostCatalog([*measured, *unmeasured], TTL)
    for desc, ns in measured.items():
        assert catalog.observe(desc, ns, 0)
    return catalog


def test_normalizers_of_a_small_measured_catalog():
    catalog = _catalog(
        {
            GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64): 2 * MS,
            GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=256): 4 * MS,
            GraphDescriptor(GraphKind.DECODE, 1): 5 * MS,  # 0.2 per ms for its stream
            GraphDescriptor(GraphKind.DECODE, 4): 8 * MS,  # 0.125 per ms per stream
        },
        unmeasured=[
            GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=4096),
            GraphDescriptor(GraphKind.DECODE, 2),  # unmeasured: ignored, not "0 ms"
        ],
    )
    norms = catalog_normalizers(catalog)
    # The best per-stream rate of the fastest measured generation program.
    assert norms.tokens == pytest.approx(0.2)
    assert norms.deliveries == pytest.approx(0.2)


def test_unmeasured_catalog_gives_no_normalizer():
    catalog = _catalog(
        {},
        unmeasured=[
            GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
            GraphDescriptor(GraphKind.DECODE, 1),
        ],
    )
    norms = catalog_normalizers(catalog)
    assert norms.tokens is None
    assert norms.deliveries is None


def test_prefill_measurements_do_not_make_a_stream_normalizer():
    catalog = _catalog(
        {GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=128): 4 * MS},
        unmeasured=[GraphDescriptor(GraphKind.DECODE, 1)],
    )
    norms = catalog_normalizers(catalog)
    assert norms.tokens is None
    assert norms.deliveries is None


def test_normalizers_follow_estimate_changes():
    decode = GraphDescriptor(GraphKind.DECODE, 2)
    catalog = _catalog({decode: 10 * MS})
    assert catalog_normalizers(catalog).deliveries == pytest.approx(0.1)
    # A stale entry's first valid observation replaces the estimate.
    catalog.observe(decode, 5 * MS, TTL + 1)
    assert catalog_normalizers(catalog).deliveries == pytest.approx(0.2)
    assert catalog_normalizers(catalog).tokens == pytest.approx(0.2)
