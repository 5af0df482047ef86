"""Benchmark: the least per-lane work any ``plan()`` does, in CPython, on this machine.

Usage: ``python scripts/bench_plan_floor.py [--repeat N]``

Issue 25's goals (``scripts/bench_scheduler.py``) ask ``plan()`` for at most
100 us at 64 active requests and 50 us at 8.  This script measures what no
selection algorithm can skip, on the same states (``bench_scheduler``'s
simulator-driven scheduler, every graph measured), with the simplest code
that does it: no candidate is built, no program is priced, nothing is
sorted but what the spec's cohort rule needs.

Every completion moves every participant's prices (service history: an
unselected participant is starved, ``docs/scheduling-utility.md``) and every
decoder's output age, so every lane's value is new at every decision:

1. ``values``: each runnable request's token and delivery prices and its
   decode lane value (the age value included), from its stored rates;
2. ``means``: each decoder's prefix-survival means at the deepest depth a
   speculative program offers;
3. ``gains``: each decoder's scored row gains and their prefix sums (the
   value of each query length);
4. ``ranks``: per ceiling min(D + 1, W) of the catalog, the decoders'
   complete-prefix values sorted with their prefix sums (the value of the
   best B lanes, for every B; the spec's "the best cohort contains its
   highest additive lane values");
5. ``rows``: the winning plan's lane rows (one frozen row per lane; the
   spec's plan "freezes ... logical lane work").

``numpy`` does 1-4 on arrays kept between decisions (as if the scheduler
stored its lanes' rates and means as arrays), for comparison.

Prints a table (median of ``--repeat`` timings, microseconds, one pinned core)
and, last, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from itertools import accumulate
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_scheduler import measured_scheduler

POPULATIONS = (8, 64)
GOALS_US = {8: 50, 64: 100}


def _time(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)


def floor_steps(population: int, seed: int):
    """The five steps as closures over one measured scheduler's state."""
    s = measured_scheduler(population, seed)
    policy = s.policy
    f, g, beta = policy.token_fairness, policy.delivery_fairness, policy.output_token_value
    runnable = [r for r in s._resident.values() if r.runnable]
    decoders = [r for r in runnable if r.decoding]
    start = s.now_ns
    slope = 0.5
    source = s.config.proposer
    depth = max(d.proposal_depth for d in s.catalog.descriptors)
    ceilings = sorted({min(d.proposal_depth + 1, d.token_capacity) for d in s.catalog.descriptors})
    plan = s.plan()
    assert plan is not None

    def values():
        out = []
        for r in runnable:
            x = r.token_rate or 1.0
            z = r.delivery_rate or 1.0
            seen = r.last_visible_ns if r.last_visible_ns is not None else start
            out.append((beta + f / x) + g / z + slope * max(0, start - seen) / 1e6)
        return out

    bases = values()[: len(decoders)]

    def means():
        return [r.speculation.acceptance(source).means(depth) for r in decoders]

    survival = means()

    def gains():
        out = []
        for r, row in zip(decoders, survival):
            price = beta + f / (r.token_rate or 1.0)
            out.append([0.0, *accumulate([s * price for s in row])])
        return out

    prefix = gains()

    def ranks():
        out = []
        for top in ceilings:
            fulls = [base + p[min(top, len(p)) - 1] for base, p in zip(bases, prefix)]
            fulls.sort(reverse=True)
            out.append([0.0, *accumulate(fulls)])
        return out

    lane_type = type(plan.lanes[0])

    def rows():
        return tuple(
            lane_type(
                lane.handle, lane.slot, lane.generation, lane.phase, lane.prompt_start,
                lane.prompt_tokens, lane.output_start, lane.max_tokens, lane.expected_tokens,
                lane.expected_deliveries, lane.value,
            )
            for lane in plan.lanes
        )  # fmt: skip

    # numpy: the same quantities from arrays the scheduler would keep.
    x = np.array([r.token_rate or 1.0 for r in runnable])
    z = np.array([r.delivery_rate or 1.0 for r in runnable])
    seen = np.array([r.last_visible_ns or start for r in runnable], dtype=np.float64)
    is_decoder = np.array([r.decoding for r in runnable])
    stored_means = np.array(survival) if survival and depth else np.zeros((len(decoders), 1))
    tops = np.array(ceilings)

    def arrays():
        price = beta + f / x
        base = (price + g / z + slope * np.maximum(0.0, start - seen) / 1e6)[is_decoder]
        row = stored_means * price[is_decoder][:, None]
        cum = np.zeros((row.shape[0], row.shape[1] + 1))
        np.cumsum(row, axis=1, out=cum[:, 1:])
        at = np.minimum(tops, cum.shape[1]) - 1
        fulls = -np.sort(-(base[:, None] + cum[:, at]), axis=0)
        return np.cumsum(fulls, axis=0)

    steps = {"values": values, "means": means, "gains": gains, "ranks": ranks, "rows": rows}
    counts = {"runnable": len(runnable), "decoders": len(decoders), "rows": len(plan.lanes),
              "ceilings": len(ceilings)}  # fmt: skip
    return steps, arrays, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    result: dict = {"repeat": args.repeat}
    print(f"{'active':>6}  {'step':<8} {'median us':>9}")
    for population in POPULATIONS:
        steps, arrays, counts = floor_steps(population, args.seed)
        total = 0.0
        for name, fn in steps.items():
            for _ in range(50):
                fn()  # warm-up
            us = _time(fn, args.repeat)
            total += us
            result[f"floor_{name}_us_{population}"] = round(us, 1)
            print(f"{population:>6}  {name:<8} {us:>9.1f}")
        numpy_us = _time(arrays, args.repeat)
        print(f"{population:>6}  {'sum':<8} {total:>9.1f}   goal for all of plan(): "
              f"{GOALS_US[population]} us; numpy steps 1-4: {numpy_us:.1f} us")  # fmt: skip
        result[f"floor_us_{population}"] = round(total, 1)
        result[f"floor_numpy_values_to_ranks_us_{population}"] = round(numpy_us, 1)
        result[f"goal_plan_us_{population}"] = GOALS_US[population]
        result.update({f"{k}_{population}": v for k, v in counts.items()})
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
