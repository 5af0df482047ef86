"""PolicyConfig defaults, presets, overrides and validation; SchedulerConfig bounds."""

from __future__ import annotations

import dataclasses
import math

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PRESETS, ConfigError, PolicyConfig, SchedulerConfig
from runtime.coordinator.scheduler import Scheduler

# The spec's "Policy preferences" table.
SPEC_DEFAULTS = {
    "output_token_value": 64,
    "token_fairness": 16,
    "delivery_fairness": 4,
    "decode_age_price": 0.1,
    "terminal_value": 256,
    "terminal_age_price": 1,
    "adaptation_ms": 100,
    "estimate_ttl_ns": 30_000_000_000,
    "adaptive_verification_alpha": 1,
}
POSITIVE_FIELDS = ("adaptation_ms", "estimate_ttl_ns", "adaptive_verification_alpha")
NONNEGATIVE_FIELDS = tuple(name for name in SPEC_DEFAULTS if name not in POSITIVE_FIELDS)


def test_defaults_equal_spec_table():
    policy = PolicyConfig()
    assert {f.name for f in dataclasses.fields(policy)} == set(SPEC_DEFAULTS)
    for name, value in SPEC_DEFAULTS.items():
        assert getattr(policy, name) == value, name
    assert isinstance(policy.estimate_ttl_ns, int)


def test_policy_is_frozen():
    policy = PolicyConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.token_fairness = 1.0  # type: ignore[misc]


def test_balanced_preset_is_the_defaults():
    assert PolicyConfig.preset("balanced") == PolicyConfig()


def test_throughput_preset_drops_delivery_fairness_and_age_price_only():
    throughput = PolicyConfig.preset("throughput")
    assert throughput.delivery_fairness == 0
    assert throughput.decode_age_price == 0
    assert throughput.token_fairness == 16
    assert throughput.output_token_value == 64
    # Terminal value and urgency apply under both policies.
    assert throughput.terminal_value == 256
    assert throughput.terminal_age_price == 1
    for name in ("adaptation_ms", "estimate_ttl_ns", "adaptive_verification_alpha"):
        assert getattr(throughput, name) == SPEC_DEFAULTS[name]


@pytest.mark.parametrize("name", ["balanced", "throughput"])
def test_terminal_overrides_apply_after_preset(name):
    base = PolicyConfig.preset(name)
    policy = PolicyConfig.preset(name, terminal_value=10.0, terminal_age_price=0.0)
    assert policy.terminal_value == 10.0
    assert policy.terminal_age_price == 0.0
    # Everything else is the preset's.
    assert dataclasses.replace(policy, terminal_value=256.0, terminal_age_price=1.0) == base


def test_disabling_both_terminal_coefficients_under_throughput():
    policy = PolicyConfig.preset("throughput", terminal_value=0, terminal_age_price=0)
    assert policy.terminal_value == 0
    assert policy.terminal_age_price == 0
    assert policy.delivery_fairness == 0
    assert policy.token_fairness == 16


def test_none_override_keeps_preset_value():
    policy = PolicyConfig.preset("throughput", terminal_value=None, terminal_age_price=2.0)
    assert policy.terminal_value == 256
    assert policy.terminal_age_price == 2.0


def test_overrides_do_not_mutate_presets():
    PolicyConfig.preset("balanced", terminal_value=1.0, token_fairness=3.0)
    assert PRESETS["balanced"] == PolicyConfig()
    assert PolicyConfig.preset("balanced").terminal_value == 256


def test_overrides_are_validated():
    with pytest.raises(ConfigError, match="terminal_value"):
        PolicyConfig.preset("throughput", terminal_value=-1.0)
    with pytest.raises(ConfigError, match="terminal_age_price"):
        PolicyConfig.preset("balanced", terminal_age_price=math.inf)


def test_unknown_override_field_rejected():
    with pytest.raises(ConfigError, match="terminal_bonus"):
        PolicyConfig.preset("balanced", terminal_bonus=1.0)


@pytest.mark.parametrize("name", ["fast", "", "Balanced", "latency"])
def test_unknown_preset_name_rejected(name):
    with pytest.raises(ConfigError, match="scheduler_policy"):
        PolicyConfig.preset(name)


@pytest.mark.parametrize("field", list(SPEC_DEFAULTS))
@pytest.mark.parametrize(
    "bad", [math.nan, math.inf, -math.inf, -1.0, -1e-12], ids=["nan", "inf", "-inf", "-1", "-tiny"]
)
def test_non_finite_and_negative_values_rejected_naming_field(field, bad):
    with pytest.raises(ConfigError, match=field):
        PolicyConfig(**{field: bad})


@pytest.mark.parametrize("field", list(SPEC_DEFAULTS))
@pytest.mark.parametrize("bad", ["1", None, True], ids=["str", "none", "bool"])
def test_non_numbers_rejected_naming_field(field, bad):
    with pytest.raises(ConfigError, match=field):
        PolicyConfig(**{field: bad})


@pytest.mark.parametrize("field", POSITIVE_FIELDS)
def test_positive_fields_reject_zero(field):
    with pytest.raises(ConfigError, match=f"{field} must be > 0"):
        PolicyConfig(**{field: 0})


@pytest.mark.parametrize("field", POSITIVE_FIELDS)
def test_positive_fields_accept_small_positive(field):
    value = 1 if field == "estimate_ttl_ns" else 1e-6
    assert getattr(PolicyConfig(**{field: value}), field) == value


@pytest.mark.parametrize("field", NONNEGATIVE_FIELDS)
def test_zero_disables_a_preference(field):
    assert getattr(PolicyConfig(**{field: 0}), field) == 0


def test_estimate_ttl_must_be_whole_nanoseconds():
    assert PolicyConfig(estimate_ttl_ns=5e9).estimate_ttl_ns == 5_000_000_000
    assert isinstance(PolicyConfig(estimate_ttl_ns=5e9).estimate_ttl_ns, int)
    with pytest.raises(ConfigError, match="estimate_ttl_ns"):
        PolicyConfig(estimate_ttl_ns=1.5)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------- SchedulerConfig


def test_scheduler_config_defaults():
    config = SchedulerConfig()
    assert config.max_slots == 64
    assert config.page_size > 0
    assert config.num_pages > 0


def test_max_slots_above_64_rejected():
    with pytest.raises(ConfigError, match="max_slots"):
        SchedulerConfig(max_slots=65)
    assert SchedulerConfig(max_slots=64).max_slots == 64


@pytest.mark.parametrize("field", ["max_slots", "page_size", "num_pages"])
@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "8"])
def test_scheduler_config_fields_must_be_positive_integers(field, bad):
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**{field: bad})


def test_scheduler_uses_supplied_policy_ttl():
    policy = PolicyConfig(estimate_ttl_ns=1_000)
    scheduler = Scheduler([GraphDescriptor(GraphKind.DECODE, 1)], policy=policy)
    assert scheduler.policy is policy
    assert scheduler.catalog.ttl_ns == 1_000
