"""Acceptance and confidence estimates (spec, "Completed confidence and acceptance",
"Funded acceptance learning"; docs/design.md, "Estimates, worked").

Depths are 1-based draft positions.  ``s_d`` is the probability that the first
``d`` proposed tokens all survive verification; a lane of width ``W`` (target
rows, pending token included) is expected to commit ``1 + s_1 + ... + s_(W-1)``.

Choices made here:

* ``PrefixEstimate`` is one depth's weighted mean.  An observation ``x`` in
  [0, 1] gives ``mean = (w * mean + x) / (w + 1)`` and ``w = min(128, w + 1)``.
  Aging by ``n`` generated tokens gives ``w *= 2 ** (-n / 128)``; the mean is
  unchanged ("unobserved suffixes retain their means").  The optimistic bound,
  for funded acceptance learning only, is ``min(1, mean + sqrt(ln 20 / (2 w)))``
  (1 at weight zero).
* ``PopulationPrior`` is one vector of means, starting at ``0.5 ** d`` and moved
  by ``(x - mean) / 64`` toward every completed observation at depth ``d``.  A
  model holds one per proposal source for acceptance ("draft": learned
  proposals, "copy": copy proposals) and a separate one for confidence
  forecasts.  A new request's estimates start at the prior's current means with
  weight 2, so before any observation acceptance starts at ``0.5 ** d`` too.
* Reads are monotone-safe: survival cannot grow with depth, so ``means`` and
  ``optimistic`` clamp each value to [0, 1] and to at most the previous depth's
  value.  Stored means are not altered by the clamp.
* ``PrefixSurvival.observe_round``: depths ``1..accepted`` observe 1; without
  termination, depths ``accepted+1..offered`` observe 0 (a rejection is zero for
  every longer offered prefix); with termination (stop token or output limit
  inside the accepted run) those depths are censored.  ``offered == 0`` (a
  width-one round) observes nothing.  Optional ``survival`` rows (the program's
  ``completion_speculative_survival``) replace the binary value at each depth
  the round observes; they never add depths the round censors.
* ``ConfidenceForecast.observe(values, ceiling)``: ``ceiling`` is the lane's
  frozen ``min(D + 1, W)`` target-row ceiling, so draft depth ``d`` is observed
  iff ``d <= ceiling - 1`` and ``d <= len(values)``.
* Every observation is also forwarded to the attached population prior.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

INITIAL_WEIGHT = 2.0
WEIGHT_CAP = 128.0
HALF_LIFE_TOKENS = 128.0
PRIOR_WEIGHT = 1.0 / 64.0
OPTIMISM_LOG = math.log(20.0)

SOURCES = ("draft", "copy")


@dataclass(frozen=True)
class Observation:
    """One value averaged into one depth's estimate."""

    depth: int
    value: float


def _check_count(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value!r}")
    return value


def _check_probabilities(name: str, values: Sequence[float], monotone: bool) -> list[float]:
    rows = [float(v) for v in values]
    for i, v in enumerate(rows):
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ValueError(f"{name}[{i}] must be a probability in [0, 1], got {v!r}")
        if monotone and i and v > rows[i - 1]:
            raise ValueError(f"{name}[{i}] = {v!r} exceeds {name}[{i - 1}] = {rows[i - 1]!r}")
    return rows


def _monotone(values: Sequence[float]) -> list[float]:
    out: list[float] = []
    previous = 1.0
    for v in values:
        previous = min(previous, max(0.0, min(1.0, v)))
        out.append(previous)
    return out


class PrefixEstimate:
    """One depth's mean and aged weight (spec: start at weight two, cap at 128,
    half-life of 128 generated tokens)."""

    __slots__ = ("mean", "weight")

    def __init__(self, mean: float, weight: float = INITIAL_WEIGHT) -> None:
        self.mean = mean
        self.weight = weight

    def observe(self, x: float) -> None:
        self.mean = (self.weight * self.mean + x) / (self.weight + 1.0)
        self.weight = min(WEIGHT_CAP, self.weight + 1.0)

    def age(self, tokens: int) -> None:
        self.weight *= 2.0 ** (-tokens / HALF_LIFE_TOKENS)

    def optimistic(self) -> float:
        """min(1, mean + sqrt(ln(20) / (2 * aged_weight))), for learning only."""
        if self.weight <= 0.0:
            return 1.0
        return min(1.0, self.mean + math.sqrt(OPTIMISM_LOG / (2.0 * self.weight)))


class PopulationPrior:
    """Population means per depth: 0.5^d, moving toward each completed
    observation with weight one sixty-fourth."""

    __slots__ = ("_means", "depth_cap")

    def __init__(self, depth_cap: int) -> None:
        self.depth_cap = _check_count("depth_cap", depth_cap, 1)
        self._means = [0.5**d for d in range(1, depth_cap + 1)]

    def means(self) -> list[float]:
        """Stored means for depths 1..depth_cap (unclamped)."""
        return list(self._means)

    def observe(self, depth: int, x: float) -> None:
        _check_count("depth", depth, 1, self.depth_cap)
        self._means[depth - 1] += (x - self._means[depth - 1]) * PRIOR_WEIGHT

    def preseed(self, means: Sequence[float]) -> None:
        """Replace the means of depths 1..len(means); deeper depths keep theirs."""
        rows = _check_probabilities("means", means, monotone=False)
        if len(rows) > self.depth_cap:
            raise ValueError(f"means has {len(rows)} depths, depth_cap is {self.depth_cap}")
        self._means[: len(rows)] = rows


class _PrefixEstimates:
    """Per-depth estimates of one request, started from a population prior."""

    __slots__ = ("_clamped", "_estimates", "depth_cap", "population")

    def __init__(self, prior: PopulationPrior, population: PopulationPrior | None = None) -> None:
        self.depth_cap = prior.depth_cap
        self._estimates = [PrefixEstimate(m) for m in prior.means()]
        self.population = population
        self._clamped: tuple[float, ...] | None = None  # means(depth_cap), until an observation

    def _depths(self, n: int) -> list[PrefixEstimate]:
        return self._estimates[: _check_count("n", n, 0, self.depth_cap)]

    def means(self, n: int) -> list[float]:
        """Historical means s_1..s_n, clamped to [0, 1] and non-increasing (read
        once per observation: only observations move means; ageing moves weights)."""
        _check_count("n", n, 0, self.depth_cap)
        if self._clamped is None:
            self._clamped = tuple(_monotone([e.mean for e in self._estimates]))
        return list(self._clamped[:n])

    def optimistic(self, n: int) -> list[float]:
        """Optimistic bounds for depths 1..n, clamped to [0, 1] and non-increasing
        (``PrefixEstimate.optimistic`` then ``_monotone``, the same arithmetic in
        one pass: every plan with learning credit reads it for every decoder)."""
        out: list[float] = []
        previous = 1.0
        for e in self._depths(n):
            w = e.weight
            v = 1.0 if w <= 0.0 else min(1.0, e.mean + math.sqrt(OPTIMISM_LOG / (2.0 * w)))
            previous = min(previous, max(0.0, min(1.0, v)))
            out.append(previous)
        return out

    def weight(self, depth: int) -> float:
        return self._estimates[_check_count("depth", depth, 1, self.depth_cap) - 1].weight

    def age(self, tokens: int) -> None:
        """Age every depth's weight by ``tokens`` generated tokens (one factor for
        every depth: the same product ``PrefixEstimate.age`` forms)."""
        _check_count("tokens", tokens, 0)
        factor = 2.0 ** (-tokens / HALF_LIFE_TOKENS)
        for e in self._estimates:
            e.weight *= factor

    def _apply(self, observations: list[Observation]) -> list[Observation]:
        self._clamped = None
        estimates, population = self._estimates, self.population
        for o in observations:
            estimates[o.depth - 1].observe(o.value)
            if population is not None:
                population.observe(o.depth, o.value)
        return observations


class PrefixSurvival(_PrefixEstimates):
    """A request's prefix-survival estimates for one proposal source."""

    __slots__ = ()

    def observe_round(
        self, offered: int, accepted: int, terminated: bool, survival: Sequence[float] = ()
    ) -> list[Observation]:
        """Observe a completed round that offered ``offered`` draft tokens.

        Accepted prefixes observe 1, longer offered prefixes 0 unless termination
        censored them; ``survival`` rows replace the binary value at their depths.
        """
        _check_count("offered", offered, 0, self.depth_cap)
        _check_count("accepted", accepted, 0, offered)
        rows = _check_probabilities("survival", survival, monotone=True)
        if len(rows) > offered:
            raise ValueError(f"survival has {len(rows)} rows for {offered} offered tokens")
        last = accepted if terminated else offered
        obs = []
        for d in range(1, last + 1):
            x = rows[d - 1] if d <= len(rows) else (1.0 if d <= accepted else 0.0)
            obs.append(Observation(d, x))
        return self._apply(obs)

    def observe_survival(self, rows: Sequence[float]) -> list[Observation]:
        """Observe cumulative survival probabilities: ``rows[i]`` at depth ``i + 1``."""
        values = _check_probabilities("rows", rows, monotone=True)
        if len(values) > self.depth_cap:
            raise ValueError(f"rows has {len(values)} depths, depth_cap is {self.depth_cap}")
        return self._apply([Observation(i + 1, x) for i, x in enumerate(values)])


class ConfidenceForecast(_PrefixEstimates):
    """A request's forecast of joint-prefix probability per draft depth."""

    __slots__ = ()

    def observe(
        self, joint_prefix_probabilities: Sequence[float], ceiling: int
    ) -> list[Observation]:
        """Average in completed joint-prefix probabilities for depths 1..ceiling-1.

        ``ceiling`` is the lane's frozen min(D + 1, W) target-row ceiling.
        """
        values = _check_probabilities(
            "joint_prefix_probabilities", joint_prefix_probabilities, monotone=False
        )
        _check_count("ceiling", ceiling, 1)
        last = min(ceiling - 1, len(values))
        if last > self.depth_cap:
            raise ValueError(f"forecast observes {last} depths, depth_cap is {self.depth_cap}")
        return self._apply([Observation(d, values[d - 1]) for d in range(1, last + 1)])


def expected_output(
    survival: Sequence[float], width: int, alpha: float = 1.0, limit: int | None = None
) -> float:
    """1 + sum(s_i ** alpha for i in 1..W-1) with W = min(width, limit).

    ``limit`` bounds the width by remaining output, context or proposal work;
    ``alpha`` (adaptive_verification_alpha) is for selection scores only.
    """
    _check_count("width", width, 1)
    if limit is not None:
        width = min(width, _check_count("limit", limit, 1))
    if not (math.isfinite(alpha) and alpha > 0.0):
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    if len(survival) < width - 1:
        raise ValueError(f"survival has {len(survival)} depths, width {width} needs {width - 1}")
    return 1.0 + sum(float(s) ** alpha for s in survival[: width - 1])


class SpeculationState:
    """One request's acceptance estimates per source and its confidence forecast."""

    __slots__ = ("_acceptance", "forecast", "model")

    def __init__(self, model: SpeculationModel) -> None:
        self.model = model
        self._acceptance: dict[str, PrefixSurvival] = {}
        prior = model.forecast_prior
        self.forecast = ConfidenceForecast(prior, population=prior)

    def acceptance(self, source: str) -> PrefixSurvival:
        """The source's estimates, started from its population prior on first use."""
        survival = self._acceptance.get(source)
        if survival is None:
            prior = self.model.prior(source)
            survival = self._acceptance[source] = PrefixSurvival(prior, population=prior)
        return survival

    def age(self, tokens: int) -> None:
        """Age forecast and every started source's estimates by generated tokens."""
        self.forecast.age(tokens)
        for survival in self._acceptance.values():
            survival.age(tokens)


class SpeculationModel:
    """Population priors shared by requests: one per source, one for forecasts."""

    __slots__ = ("acceptance_priors", "depth_cap", "forecast_prior")

    def __init__(self, depth_cap: int) -> None:
        self.depth_cap = _check_count("depth_cap", depth_cap, 1)
        self.acceptance_priors = {s: PopulationPrior(depth_cap) for s in SOURCES}
        self.forecast_prior = PopulationPrior(depth_cap)

    def prior(self, source: str) -> PopulationPrior:
        if source not in self.acceptance_priors:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        return self.acceptance_priors[source]

    def preseed(self, source: str, means: Sequence[float]) -> None:
        """Start ``source``'s acceptance prior from ``means`` (new requests only)."""
        self.prior(source).preseed(means)

    def new_request(self) -> SpeculationState:
        return SpeculationState(self)
