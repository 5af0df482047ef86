"""Policy preferences and scheduler resources (frozen; validated on construction)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from runtime.image_spans import VisionStorage

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


# Fields that must be strictly positive; every other numeric field must be
# finite and non-negative (zero disables the corresponding preference).
_POSITIVE = frozenset({"adaptation_ms", "estimate_ttl_ns", "adaptive_verification_alpha"})


@dataclass(frozen=True)
class PolicyConfig:
    """The spec's policy preferences (spec, "Policy preferences").

    Value is measured in prompt-token units: one consumed prompt token is worth 1.
    """

    output_token_value: float = 64.0  # prompt-value units per output token (beta)
    token_fairness: float = 16.0  # f, value/ms
    delivery_fairness: float = 4.0  # g, value/ms
    decode_age_price: float = 0.1  # c, value/ms^2
    terminal_value: float = 256.0  # value per terminal retirement
    terminal_age_price: float = 1.0  # value/ms^2
    adaptation_ms: float = 100.0  # service-price adaptation time (tau)
    estimate_ttl_ns: int = 30_000_000_000  # timing freshness interval
    adaptive_verification_alpha: float = 1.0  # exponent on prefix-survival estimates

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{f.name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(f"{f.name} must be finite, got {value!r}")
            if f.name in _POSITIVE:
                if value <= 0:
                    raise ConfigError(f"{f.name} must be > 0, got {value!r}")
            elif value < 0:
                raise ConfigError(f"{f.name} must be >= 0, got {value!r}")
        if not isinstance(self.estimate_ttl_ns, int):
            if float(self.estimate_ttl_ns).is_integer():
                object.__setattr__(self, "estimate_ttl_ns", int(self.estimate_ttl_ns))
            else:
                raise ConfigError(
                    f"estimate_ttl_ns must be a whole number of ns, got {self.estimate_ttl_ns!r}"
                )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> PolicyConfig:
        """A named preset, then overrides (e.g. terminal coefficients) on top."""
        try:
            base = PRESETS[name]
        except KeyError:
            raise ConfigError(
                f"scheduler_policy must be one of {sorted(PRESETS)}, got {name!r}"
            ) from None
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown policy field(s): {sorted(unknown)}")
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def from_toml(cls, path: str | Path) -> PolicyConfig:
        """``[scheduler] preset = ...`` then ``[scheduler.policy]`` overrides."""
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        section = data.get("scheduler", {})
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: [scheduler] must be a table")
        unknown = set(section) - {"preset", "policy"}
        if unknown:
            raise ConfigError(f"{path}: unknown [scheduler] key(s) {sorted(unknown)}")
        overrides = section.get("policy", {})
        if not isinstance(overrides, dict):
            raise ConfigError(f"{path}: [scheduler.policy] must be a table")
        return cls.preset(section.get("preset", "balanced"), **overrides)


# Presets are data, not branches.  `throughput` keeps token fairness and the
# output-token value and drops delivery fairness and the output-age price.
PRESETS: dict[str, PolicyConfig] = {
    "balanced": PolicyConfig(),
    "throughput": PolicyConfig(delivery_fairness=0.0, decode_age_price=0.0),
}


@dataclass(frozen=True)
class SchedulerConfig:
    """Resources the coordinator owns.

    ``max_slots`` resident request slots (selection is bounded to 64), and a KV
    page pool of ``num_pages`` pages of ``page_size`` tokens, allocated on
    demand with preemption (runtime.coordinator.residency).
    ``enable_prefix_caching``: completed pages are published by content and
    reused (runtime.coordinator.kvcache).  ``debug_page_accounting``: check the
    page-accounting invariant after every completion.

    Speculation (spec, "Speculative graph coverage"):
    ``fixed_speculative_width`` 0 is adaptive selection: every loaded width
    competes in every decision.  A width w >= 1 is fixed-width execution: only
    decode rounds at width w run (w = 1: ordinary decode), host-allocated, and
    acceptance is never probed.  ``proposer``: the proposal source whose
    acceptance the requests track, "draft" (learned proposals) or "copy"
    (proposals copied from the context).  ``speculative_token_capacity`` R > 0
    is the envelope of wider programs: the scheduler drops, at load, any whose
    target rows exceed it (B x W when rectangular, P when ragged); 0: none.
    """

    max_slots: int = 64
    page_size: int = 16
    num_pages: int = 65536
    fixed_speculative_width: int = 0
    proposer: str = "draft"
    speculative_token_capacity: int = 0
    enable_prefix_caching: bool = True
    debug_page_accounting: bool = False
    # The prepared image-feature storage (runtime.image_spans.VisionStorage);
    # None: no image windows (requests with images are refused).
    vision: VisionStorage | None = None

    def __post_init__(self) -> None:
        if self.vision is not None and not isinstance(self.vision, VisionStorage):
            raise ConfigError(f"vision must be a VisionStorage or None, got {self.vision!r}")
        for name in ("max_slots", "page_size", "num_pages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        width = self.fixed_speculative_width
        if isinstance(width, bool) or not isinstance(width, int) or not 0 <= width <= 64:
            raise ConfigError(
                f"fixed_speculative_width must be an integer in [0, 64], got {width!r}"
            )
        envelope = self.speculative_token_capacity
        if isinstance(envelope, bool) or not isinstance(envelope, int) or envelope < 0:
            raise ConfigError(
                f"speculative_token_capacity must be a non-negative integer, got {envelope!r}"
            )
        for name in ("enable_prefix_caching", "debug_page_accounting"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.proposer not in ("draft", "copy"):
            raise ConfigError(f"proposer must be 'draft' or 'copy', got {self.proposer!r}")
        if self.max_slots > 64:
            raise ConfigError(f"max_slots must be <= 64 (selection bound), got {self.max_slots}")
