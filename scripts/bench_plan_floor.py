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

    # 6. programs: every program of the catalog scored once from those sums, the
    # cheapest form any candidate takes (a lookup and the value rate), decode and
    # speculative programs by their cohort size, prefill ones by their capacity.
    programs = []
    for entry in s.catalog._entries.values():
        d = entry.descriptor
        group = ceilings.index(min(d.proposal_depth + 1, d.token_capacity))
        programs.append((entry.estimate_ns / 1e6, group, d.batch_capacity, d.prompt_capacity))
    sums = ranks()
    prompt_price = 1.0 + f / 1.0
    lanes = len(decoders)
    price = policy.decode_age_price * lanes

    def scores():
        best = float("-inf")
        for t, group, batch, capacity in programs:
            if capacity:
                value = capacity * prompt_price
                n = 0
            else:
                n = batch if batch < lanes else lanes
                value = sums[group][n]
            score = (value + slope * n * t) / t - 0.5 * t * price
            if score > best:
                best = score
        return best

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
        out = np.zeros((fulls.shape[0] + 1, fulls.shape[1]))
        np.cumsum(fulls, axis=0, out=out[1:])
        return out

    table = arrays()
    kinds = [(t, group, batch, capacity) for t, group, batch, capacity in programs]
    t_ms = np.array([k[0] for k in kinds])
    group_of = np.array([k[1] for k in kinds])
    batch_of = np.array([k[2] for k in kinds])
    is_prompt = np.array([k[3] > 0 for k in kinds])
    capacity_of = np.array([float(k[3]) for k in kinds])[is_prompt]
    prompt_t = t_ms[is_prompt]
    prompts = [r for r in runnable if not r.decoding]
    left = np.array([float(r.prefill_target - r.consumed_prompt) for r in prompts])
    prompt_rate = np.array([r.token_rate or 1.0 for r in prompts])

    def array_scores():
        n = np.minimum(batch_of, len(decoders))
        value = table[n, group_of]
        score = (value + slope * n * t_ms) / t_ms - 0.5 * t_ms * price
        tokens = np.minimum(capacity_of[None, :], left[:, None])
        chunk = tokens * (1.0 + f / prompt_rate)[:, None] + np.where(
            tokens >= left[:, None], (beta + f / prompt_rate)[:, None], 0.0
        )
        prompt = chunk / prompt_t - 0.5 * prompt_t * price
        return max(score[~is_prompt].max(), prompt.max() if prompts else -np.inf)

    steps = {"values": values, "means": means, "gains": gains, "ranks": ranks,
             "scores": scores, "rows": rows}  # fmt: skip
    counts = {"runnable": len(runnable), "decoders": len(decoders), "rows": len(plan.lanes),
              "ceilings": len(ceilings)}  # fmt: skip
    return steps, {"lanes": arrays, "scores": array_scores}, counts


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
        print(f"{population:>6}  {'sum':<8} {total:>9.1f}   (goal for all of plan(): "
              f"{GOALS_US[population]} us)")  # fmt: skip
        numpy_total = 0.0
        for name, fn in arrays.items():
            us = _time(fn, args.repeat)
            numpy_total += us
            result[f"floor_numpy_{name}_us_{population}"] = round(us, 1)
            print(f"{population:>6}  {'np ' + name:<8} {us:>9.1f}")
        print(f"{population:>6}  {'np sum':<8} {numpy_total:>9.1f}   (steps 1-4 and 6 on arrays)")
        result[f"floor_us_{population}"] = round(total, 1)
        result[f"floor_numpy_us_{population}"] = round(numpy_total, 1)
        result[f"goal_plan_us_{population}"] = GOALS_US[population]
        result.update({f"{k}_{population}": v for k, v in counts.items()})
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
