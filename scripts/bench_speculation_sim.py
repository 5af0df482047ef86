"""Adaptive speculation against fixed widths and published width rules, in the simulator.

    python scripts/bench_speculation_sim.py            # 11 configurations x 5 seeds
    python scripts/bench_speculation_sim.py --quick    # a smoke run (small, 2 seeds)

The population (fixed; ``--quick`` shrinks it): 48 requests, 64-token prompts,
256 output tokens each, all arriving at t = 0 (a closed burst, so output
tokens/s is the makespan throughput and discriminates between schedulers; a
fixed arrival rate would make it the arrival rate instead).  Acceptance profiles
are one third each of ``high`` (each draft accepted with probability 0.9),
``low`` (0.1) and ``drifting`` (0.9 at the first output token falling linearly
to 0.1 at the last), assigned in a seeded shuffle.  ``--rate R`` spaces the
arrivals evenly at R requests/s instead.

The catalog: prefill buckets 64..4096, decode batches 1..64 (through the padded
64 slots), rectangular speculative programs of widths 2..8 (D = W - 1) at every
decode batch, costs of ``scripts/scheduling_sim/catalogs.py`` unchanged
(``--profile``, default ``llama1b-h100``; ``--proposer copy`` makes the
speculative programs cost no draft passes).  Flare starts cold (every estimate
indeterminate, discovered as it goes) unless ``--warm``.

Configurations, each over seeds 0-4 (the seed labels the requests and draws the
simulated acceptance):

* ``adaptive``: flare, ``fixed_speculative_width=0`` (every width competes);
* ``fixed-1`` .. ``fixed-8``: flare with ``fixed_speculative_width=w``
  (``fixed-1`` is ordinary decode only);
* ``table``: TensorRT-LLM ``draft_len_schedule`` style (W = 4 up to 4 running,
  2 up to 16, 1 beyond), on prefill-first continuous batching;
* ``global-adaptive``: one width for all from a moving average of accepted length.

Reading the burst: every request has the same length, so the makespan is
bounded by the low-acceptance third, which needs about one round per token at
any width (E = 1.11 tokens per round at W = 8); wider rounds pay off only by
finishing the high and drifting requests in fewer frames without slowing the
low ones' rounds.

For each configuration: the median over seeds of output tokens/s and of the p99
gap between a request's visible outputs (ms), with TTFT p99, draft acceptance
and tokens per speculative round for reading.  Prints a table, then as the LAST
line one JSON object with every figure, including ``adaptive_tokens_per_s``,
``best_fixed`` (the fixed width with the highest median tokens/s),
``best_fixed_tokens_per_s``, ``adaptive_gap_ms_p99``, ``best_fixed_gap_ms_p99``
and ``goal_met`` (adaptive >= 1.10 x best fixed tokens/s and adaptive gap p99
<= best fixed gap p99).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.coordinator.requests import RequestSpec
from scripts.scheduling_sim.catalogs import PROFILES, PROPOSERS
from scripts.scheduling_sim.runner import RunConfig, simulate
from scripts.scheduling_sim.workload import Arrival, assign_acceptance

WIDTHS = tuple(range(2, 9))
FIXED = tuple(range(1, 9))
CONFIGS = ("adaptive", *(f"fixed-{w}" for w in FIXED), "table", "global-adaptive")
SEEDS = (0, 1, 2, 3, 4)
GOAL_TOKENS_RATIO = 1.10


def population(requests: int, prompt: int, output: int, rate: float, seed: int) -> list[Arrival]:
    """``requests`` identical requests at t = 0 (or every 1/rate s), one third
    each high, low and drifting acceptance (a shuffle seeded by ``seed``)."""
    spacing = 0.0 if rate <= 0 else 1e9 / rate
    arrivals = [Arrival(int(i * spacing), RequestSpec(prompt, output)) for i in range(requests)]
    return assign_acceptance(arrivals, "mixed", seed)


def run_config(name: str, base: RunConfig) -> RunConfig:
    """The run of configuration ``name`` (see the module docstring)."""
    if name == "adaptive":
        return replace(base, scheduler="flare", fixed_speculative_width=0)
    if name.startswith("fixed-"):
        return replace(base, scheduler="flare", fixed_speculative_width=int(name.split("-")[1]))
    return replace(base, scheduler=name, fixed_speculative_width=0, warm=False)


def _run(job: tuple[str, RunConfig, int, int, int, float, int]) -> tuple[str, int, dict]:
    name, base, requests, prompt, output, rate, seed = job
    cfg = run_config(name, replace(base, seed=seed))
    report, _ = simulate(cfg, population(requests, prompt, output, rate, seed))
    report.pop("frames_by_graph", None)
    return name, seed, report


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def summarize_config(reports: list[dict]) -> dict:
    keys = (
        "output_tokens_per_s",
        "gap_ms_p99",
        "gap_ms_p50",
        "ttft_ms_p99",
        "draft_acceptance",
        "tokens_per_round",
        "sim_seconds",
    )
    out = {key: _median([r.get(key) for r in reports]) for key in keys}
    out["finished_all"] = all(r["finished"] == r["requests"] for r in reports)
    out["per_seed"] = [
        {
            "seed": r["seed"],
            "output_tokens_per_s": r["output_tokens_per_s"],
            "gap_ms_p99": r["gap_ms_p99"],
            "ttft_ms_p99": r["ttft_ms_p99"],
            "finished": r["finished"],
            "draft_acceptance": r.get("draft_acceptance"),
            "tokens_per_round": r.get("tokens_per_round"),
            "rounds_by_width": r.get("rounds_by_width"),
        }
        for r in reports
    ]
    return out


def headline(configs: dict[str, dict]) -> dict:
    fixed = {name: configs[name] for name in configs if name.startswith("fixed-")}
    best = max(fixed, key=lambda n: (fixed[n]["output_tokens_per_s"], -int(n.split("-")[1])))
    adaptive = configs["adaptive"]
    tps, gap = adaptive["output_tokens_per_s"], adaptive["gap_ms_p99"]
    best_tps, best_gap = fixed[best]["output_tokens_per_s"], fixed[best]["gap_ms_p99"]
    return {
        "adaptive_tokens_per_s": tps,
        "adaptive_gap_ms_p99": gap,
        "best_fixed": best,
        "best_fixed_tokens_per_s": best_tps,
        "best_fixed_gap_ms_p99": best_gap,
        "adaptive_vs_best_fixed_tokens": round(tps / best_tps, 4) if best_tps else None,
        "goal_met": bool(tps >= GOAL_TOKENS_RATIO * best_tps and gap <= best_gap),
    }


def print_table(configs: dict[str, dict]) -> None:
    columns = (
        ("tok/s", "output_tokens_per_s", "{:.0f}"),
        ("gap p99", "gap_ms_p99", "{:.2f}"),
        ("gap p50", "gap_ms_p50", "{:.2f}"),
        ("TTFT p99", "ttft_ms_p99", "{:.1f}"),
        ("accept", "draft_acceptance", "{:.3f}"),
        ("tok/round", "tokens_per_round", "{:.2f}"),
    )
    header = f"{'configuration':<18}" + "".join(f"{c:>11}" for c, _, _ in columns)
    print(header)
    print("-" * len(header))
    for name, row in configs.items():
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append(f"{'-' if value is None else fmt.format(value):>11}")
        flag = "" if row["finished_all"] else "  (unfinished requests)"
        print(f"{name:<18}" + "".join(cells) + flag)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="12 requests, 64 output tokens, 2 seeds")
    p.add_argument("--requests", type=int, help="default 48 (quick: 12)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, help="default 256 (quick: 64)")
    p.add_argument("--rate", type=float, default=0.0, help="arrivals/s, evenly spaced (0: t = 0)")
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 5; quick: 2)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="llama1b-h100")
    p.add_argument("--proposer", choices=list(PROPOSERS), default="draft")
    p.add_argument("--warm", action="store_true", help="flare starts with every cost measured")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    requests = args.requests or (12 if args.quick else 48)
    output = args.output_len or (64 if args.quick else 256)
    seeds = tuple(range(args.seeds)) if args.seeds else (SEEDS[:2] if args.quick else SEEDS)
    if requests < 1 or output < 1 or args.prompt_len < 1 or not seeds:
        p.error("--requests, --output-len, --prompt-len and --seeds must be >= 1")
    base = RunConfig(
        profile=args.profile,
        speculative_widths=WIDTHS,
        proposer=args.proposer,
        warm=args.warm,
    )
    jobs = [
        (name, base, requests, args.prompt_len, output, args.rate, seed)
        for name in CONFIGS
        for seed in seeds
    ]
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            done = list(pool.map(_run, jobs))
    else:
        done = [_run(job) for job in jobs]
    for name, _, report in sorted(done, key=lambda d: (CONFIGS.index(d[0]), d[1])):
        results[name].append(report)
    configs = {name: summarize_config(reports) for name, reports in results.items()}
    head = headline(configs)
    print(
        f"{requests} requests, prompt {args.prompt_len}, output {output}, "
        + ("all at t = 0" if args.rate <= 0 else f"every {1 / args.rate:.3f} s")
        + f"; acceptance 1/3 high, low, drifting; profile {args.profile}, proposer "
        f"{args.proposer}, widths {WIDTHS[0]}..{WIDTHS[-1]}; flare "
        f"{'warm' if args.warm else 'cold'}; medians over seeds {list(seeds)}"
    )
    print_table(configs)
    print(
        f"adaptive {head['adaptive_tokens_per_s']:.0f} tok/s, gap p99 "
        f"{head['adaptive_gap_ms_p99']:.2f} ms; best fixed {head['best_fixed']} "
        f"{head['best_fixed_tokens_per_s']:.0f} tok/s, gap p99 "
        f"{head['best_fixed_gap_ms_p99']:.2f} ms; ratio "
        f"{head['adaptive_vs_best_fixed_tokens']}; goal "
        f"(>= {GOAL_TOKENS_RATIO:.2f}x tok/s, gap p99 no worse) "
        f"{'met' if head['goal_met'] else 'not met'}"
    )
    out = {
        "settings": {
            "requests": requests,
            "prompt_len": args.prompt_len,
            "output_len": output,
            "rate_per_s": args.rate,
            "acceptance": "mixed",
            "seeds": list(seeds),
            "profile": args.profile,
            "proposer": args.proposer,
            "speculative_widths": list(WIDTHS),
            "warm": args.warm,
            "quick": args.quick,
        },
        "configs": configs,
        **head,
    }
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
