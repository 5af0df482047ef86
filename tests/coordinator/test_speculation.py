"""Acceptance and confidence estimates (spec, "Completed confidence and acceptance",
"Funded acceptance learning"; docs/design.md, "Estimates, worked")."""

from __future__ import annotations

import math

import pytest

from runtime.coordinator.speculation import (
    ConfidenceForecast,
    Observation,
    PopulationPrior,
    PrefixEstimate,
    PrefixSurvival,
    SpeculationModel,
    expected_output,
)

approx = pytest.approx


def survival(depth_cap: int = 3, population: PopulationPrior | None = None) -> PrefixSurvival:
    return PrefixSurvival(PopulationPrior(depth_cap), population=population)


def stored(s: PrefixSurvival) -> list[float]:
    return [e.mean for e in s._estimates]


def test_initial_means_are_half_powers_with_weight_two():
    s = survival()
    # 0.5^1, 0.5^2, 0.5^3
    assert s.means(3) == [0.5, 0.25, 0.125]
    assert [s.weight(d) for d in (1, 2, 3)] == [2.0, 2.0, 2.0]
    assert s.means(0) == []


def test_one_accepted_observation():
    s = survival()
    obs = s.observe_round(offered=1, accepted=1, terminated=False)
    assert obs == [Observation(1, 1.0)]
    # (2 * 0.5 + 1) / 3 = 2/3; weight 2 + 1 = 3
    assert s.means(1) == approx([2 / 3])
    assert s.weight(1) == 3.0
    assert s.weight(2) == 2.0


def test_rejection_gives_zero_to_longer_offered_prefixes():
    s = survival()
    s.observe_round(offered=3, accepted=1, terminated=False)
    # depth 1: (2*.5 + 1)/3 = 2/3; depth 2: (2*.25 + 0)/3 = 1/6; depth 3: (2*.125 + 0)/3 = 1/12
    assert s.means(3) == approx([2 / 3, 1 / 6, 1 / 12])
    assert [s.weight(d) for d in (1, 2, 3)] == [3.0, 3.0, 3.0]


def test_rejection_stops_at_offered_depth():
    s = survival()
    s.observe_round(offered=2, accepted=0, terminated=False)
    # depth 1: (2*.5)/3 = 1/3; depth 2: (2*.25)/3 = 1/6; depth 3 not offered: 0.125
    assert s.means(3) == approx([1 / 3, 1 / 6, 0.125])
    assert s.weight(3) == 2.0


def test_termination_censors_the_suffix():
    s = survival()
    obs = s.observe_round(offered=3, accepted=1, terminated=True)
    assert obs == [Observation(1, 1.0)]
    # depth 1: 2/3; depths 2..3 unchanged (0.25, 0.125), weights still 2
    assert s.means(3) == approx([2 / 3, 0.25, 0.125])
    assert [s.weight(d) for d in (1, 2, 3)] == [3.0, 2.0, 2.0]


def test_width_one_round_observes_nothing():
    pop = PopulationPrior(3)
    s = survival(population=pop)
    assert s.observe_round(offered=0, accepted=0, terminated=False) == []
    assert s.means(3) == [0.5, 0.25, 0.125]
    assert [s.weight(d) for d in (1, 2, 3)] == [2.0, 2.0, 2.0]
    assert pop.means() == [0.5, 0.25, 0.125]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"offered": 4, "accepted": 0}, "offered"),
        ({"offered": -1, "accepted": 0}, "offered"),
        ({"offered": 2, "accepted": 3}, "accepted"),
        ({"offered": 2, "accepted": -1}, "accepted"),
        ({"offered": True, "accepted": 0}, "offered"),
    ],
)
def test_round_validation_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        survival().observe_round(terminated=False, **kwargs)


def test_weight_caps_at_128():
    s = survival(1)
    for _ in range(200):
        s.observe_round(offered=1, accepted=1, terminated=False)
    # 2 + 200 observations, capped at 128
    assert s.weight(1) == 128.0


def test_aging_halves_per_128_tokens_and_keeps_means():
    s = survival(1)
    for _ in range(126):
        s.observe_round(offered=1, accepted=1, terminated=False)
    assert s.weight(1) == 128.0
    mean = s.means(1)
    s.age(128)
    assert s.weight(1) == approx(64.0)  # 128 * 2^-1
    s.age(128)
    assert s.weight(1) == approx(32.0)  # 128 * 2^-2
    assert s.means(1) == mean
    e = PrefixEstimate(0.5, 128.0)
    e.age(256)
    assert e.weight == approx(32.0)  # 128 / 4
    e.age(64)
    assert e.weight == approx(32.0 / math.sqrt(2.0))  # 2^(-64/128)


def test_optimistic_bound():
    # weight 2: sqrt(ln 20 / 4) = sqrt(2.9957323/4) = sqrt(0.7489331) = 0.8654092
    assert PrefixEstimate(0.1, 2.0).optimistic() == approx(0.1 + 0.8654092)
    assert PrefixEstimate(0.5, 2.0).optimistic() == 1.0  # 0.5 + 0.865 capped at 1
    # weight 128: sqrt(ln 20 / 256) = sqrt(0.0117021) = 0.1081761
    assert PrefixEstimate(0.5, 128.0).optimistic() == approx(0.5 + 0.1081761)
    assert PrefixEstimate(0.5, 0.0).optimistic() == 1.0


def test_optimistic_vector_is_non_increasing():
    s = survival()
    for _ in range(126):
        s.observe_round(offered=1, accepted=0, terminated=False)
    # depth 1: weight 2 + 126 = 128, mean 2 * 0.5 / 128 = 0.0078125, bound 0.0078125 + 0.1081761;
    # depths 2, 3 (weight 2): 0.25 + 0.865 -> 1, clamped to the depth-1 bound
    assert s.weight(1) == 128.0
    assert s.means(1) == approx([0.0078125])
    opt = s.optimistic(3)
    assert opt[0] == approx(0.0078125 + 0.1081761)
    assert opt == [opt[0], opt[0], opt[0]]


def test_population_prior_moves_by_one_sixty_fourth():
    pop = PopulationPrior(3)
    pop.observe(1, 1.0)
    # 0.5 + (1 - 0.5)/64 = 0.5078125
    assert pop.means() == [0.5 + 0.5 / 64, 0.25, 0.125]
    pop.observe(2, 0.0)
    # 0.25 - 0.25/64 = 0.24609375
    assert pop.means()[1] == 0.25 - 0.25 / 64


def test_request_observations_feed_the_population_prior():
    model = SpeculationModel(3)
    state = model.new_request()
    state.acceptance("draft").observe_round(offered=2, accepted=1, terminated=False)
    # depth 1 moves toward 1: 0.5 + 0.5/64; depth 2 toward 0: 0.25 - 0.25/64
    assert model.prior("draft").means() == [0.5 + 0.5 / 64, 0.25 - 0.25 / 64, 0.125]
    assert model.prior("copy").means() == [0.5, 0.25, 0.125]
    # a later request starts at the moved prior with weight 2
    later = model.new_request().acceptance("draft")
    assert later.means(2) == [0.5 + 0.5 / 64, 0.25 - 0.25 / 64]
    assert later.weight(1) == 2.0
    with pytest.raises(ValueError, match="source"):
        state.acceptance("oracle")


def test_preseed_starts_new_requests_from_given_means():
    model = SpeculationModel(3)
    model.preseed("copy", [0.9, 0.81])
    s = model.new_request().acceptance("copy")
    assert s.means(3) == [0.9, 0.81, 0.125]
    assert model.new_request().acceptance("draft").means(3) == [0.5, 0.25, 0.125]
    with pytest.raises(ValueError, match="means"):
        model.preseed("copy", [1.5])


def test_survival_rows_replace_binary_observations():
    s = survival()
    s.observe_survival([0.8, 0.4])
    # depth 1: (2*.5 + .8)/3 = 0.6; depth 2: (2*.25 + .4)/3 = 0.3; depth 3 unchanged
    assert s.means(3) == approx([0.6, 0.3, 0.125])
    r = survival()
    r.observe_round(offered=3, accepted=1, terminated=False, survival=[0.8, 0.4])
    # rows at depths 1, 2 replace 1 and 0; depth 3 binary 0: (2*.125)/3 = 1/12
    assert r.means(3) == approx([0.6, 0.3, 1 / 12])
    t = survival()
    t.observe_round(offered=2, accepted=1, terminated=True, survival=[0.8, 0.4])
    # termination censors depth 2 even with a row: depth 1 only
    assert t.means(3) == approx([0.6, 0.25, 0.125])


@pytest.mark.parametrize("rows", [[math.nan], [1.2], [-0.1], [0.3, 0.6], [0.5, 0.4, 0.3, 0.2]])
def test_invalid_survival_rows_raise(rows):
    s = survival()
    with pytest.raises(ValueError, match="rows"):
        s.observe_survival(rows)
    assert s.means(3) == [0.5, 0.25, 0.125]  # nothing applied


def test_invalid_round_survival_rows_raise():
    with pytest.raises(ValueError, match="survival"):
        survival().observe_round(offered=2, accepted=1, terminated=False, survival=[0.2, 0.5])
    with pytest.raises(ValueError, match="survival"):
        survival().observe_round(offered=1, accepted=1, terminated=False, survival=[0.9, 0.8])


def test_forecast_observations_stop_at_the_ceiling():
    prior = PopulationPrior(3)
    f = ConfidenceForecast(prior, population=prior)
    obs = f.observe([0.9, 0.6, 0.3], ceiling=3)
    # ceiling 3 target rows -> draft depths 1, 2
    assert obs == [Observation(1, 0.9), Observation(2, 0.6)]
    # depth 1: (2*.5 + .9)/3 = 1.9/3; depth 2: (2*.25 + .6)/3 = 1.1/3; depth 3 unchanged
    assert f.means(3) == approx([1.9 / 3, 1.1 / 3, 0.125])
    assert f.weight(3) == 2.0
    # prior: 0.5 + (0.9 - 0.5)/64; 0.25 + (0.6 - 0.25)/64
    assert prior.means() == approx([0.5 + 0.4 / 64, 0.25 + 0.35 / 64, 0.125])
    # ceiling 1 (width-one lane) observes nothing; short rows bound the depths
    assert f.observe([0.9, 0.6, 0.3], ceiling=1) == []
    assert f.observe([0.9], ceiling=4) == [Observation(1, 0.9)]


def test_forecast_is_separate_from_acceptance():
    model = SpeculationModel(2)
    state = model.new_request()
    state.forecast.observe([1.0, 1.0], ceiling=3)
    assert state.acceptance("draft").means(2) == [0.5, 0.25]
    assert model.prior("draft").means() == [0.5, 0.25]
    state.age(128)
    assert state.forecast.weight(1) == approx(1.5)  # (2 + 1) / 2
    assert state.acceptance("draft").weight(1) == approx(1.0)  # 2 / 2


@pytest.mark.parametrize("values", [[math.nan], [1.01], [-0.5], [math.inf]])
def test_invalid_forecast_probabilities_raise(values):
    f = ConfidenceForecast(PopulationPrior(3))
    with pytest.raises(ValueError, match="joint_prefix_probabilities"):
        f.observe(values, ceiling=2)


def test_expected_output():
    s = (0.9, 0.81, 0.729)
    assert expected_output(s, 4) == approx(1 + 0.9 + 0.81 + 0.729)  # 3.439
    assert expected_output(s, 4, alpha=2.0) == approx(1 + 0.81 + 0.6561 + 0.531441)  # 2.997541
    assert expected_output(s, 4, limit=2) == approx(1 + 0.9)
    assert expected_output(s, 1) == 1.0
    with pytest.raises(ValueError, match="width"):
        expected_output(s, 0)
    with pytest.raises(ValueError, match="survival"):
        expected_output(s, 5)
    with pytest.raises(ValueError, match="limit"):
        expected_output(s, 4, limit=0)


def test_means_are_clamped_non_increasing():
    s = survival()
    for _ in range(4):
        s.observe_survival([0.9, 0.9, 0.9])
    s.observe_round(offered=1, accepted=0, terminated=False)
    # depth 1 stored: after 4 x 0.9 from (0.5, w2): (2*.5+3.6)/6 = 4.6/6, then 0 -> 4.6/7
    # depth 2 stored: (2*.25+3.6)/6 = 4.1/6 > 4.6/7, so the read clamps it to 4.6/7
    assert stored(s)[:2] == approx([4.6 / 7, 4.1 / 6])
    assert s.means(3) == approx([4.6 / 7, 4.6 / 7, (2 * 0.125 + 3.6) / 6])
    pop = PopulationPrior(2)
    pop.preseed([0.2, 0.7])
    # the prior stores 0.7 at depth 2; a request reads min(0.7, 0.2)
    assert PrefixSurvival(pop).means(2) == [0.2, 0.2]
