"""runtime.coordinator.bounds: the value bound of a causally allocated program
is at least the value of every cohort and row allocation it could run, and the
score bound at least the score; against brute force on small random lanes."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from runtime.coordinator.bounds import score_bound, value_bounds
from runtime.coordinator.utility import value_rate


@dataclass
class Lane:
    """A lane for brute force: a base and the gains of rows 2.. (its ceiling
    is 1 + len(gains))."""

    base: float
    gains: list[float]

    @property
    def full(self) -> float:
        return self.base + sum(self.gains)


def columns(lanes: list[Lane]) -> tuple[list[float], list[float], list[float]]:
    """The lanes as value_bounds reads them: bases, every row gain, complete values."""
    return [x.base for x in lanes], [g for x in lanes for g in x.gains], [x.full for x in lanes]


def best_allocation(lanes: list[Lane], batch: int, target: int) -> float:
    """The largest value of any cohort of at most min(batch, target) lanes with
    any split of the target's remaining rows (each lane at most its ceiling)."""
    best = float("-inf")
    for n in range(1, min(batch, len(lanes), target) + 1):
        for cohort in itertools.combinations(lanes, n):
            spare = target - n
            ranges = [range(len(x.gains) + 1) for x in cohort]
            for extra in itertools.product(*ranges):
                if sum(extra) <= spare:
                    value = sum(x.base + sum(x.gains[:k]) for x, k in zip(cohort, extra))
                    best = max(best, value)
    return best


def random_lanes(rng: random.Random, count: int, width: int) -> list[Lane]:
    out = []
    for _ in range(count):
        gains, p = [], rng.random()
        for _ in range(rng.randint(0, width - 1)):
            gains.append(rng.random() * p)
            p *= rng.random()
        out.append(Lane(rng.uniform(0.0, 2.0), gains))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_value_bound_is_at_least_every_allocation(seed):
    rng = random.Random(seed)
    width = rng.randint(2, 4)
    lanes = random_lanes(rng, rng.randint(1, 5), width)
    programs = [(b, p) for b in range(1, 5) for p in range(b, b * width + 1)]
    bounds = value_bounds(*columns(lanes), programs)
    tight = 0
    for (batch, target), bound in zip(programs, bounds):
        actual = best_allocation(lanes, batch, target)
        assert bound >= actual, (batch, target, bound, actual)
        tight += bound <= actual * (1 + 1e-6)
    # Not vacuous: the bound is the exact best for many shapes (every lane
    # fits, or rows are scarce and bases dominate).
    assert tight >= len(programs) // 4


def test_value_bound_without_a_bound_or_a_fit():
    lanes = [Lane(1.0, [0.5, -0.1]), Lane(1.0, [0.2])]
    assert value_bounds(*columns(lanes), [(2, 4)]) == [float("inf")]  # a negative gain: no bound
    assert value_bounds(*columns([Lane(-0.5, [])]), [(1, 1)]) == [float("inf")]  # a negative base
    assert value_bounds(*columns([]), [(2, 4)]) == [float("-inf")]  # no lane fits


@pytest.mark.parametrize("slope", [0.3, 0.0, -0.2])
def test_score_bound_is_at_least_the_score(slope):
    rng = random.Random(7)
    for _ in range(200):
        value, t_ms, price = rng.uniform(0, 5), rng.uniform(0.5, 20), rng.uniform(0, 0.1)
        size = rng.randint(1, 8)
        for n in range(1, size + 1):
            score = value_rate(value * rng.random(), slope * n, t_ms, price)
            assert score_bound(value, t_ms, slope, size, price) >= score
