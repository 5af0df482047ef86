"""Adaptive speculation against fixed widths and published width rules, in the simulator.

    python scripts/bench_speculation_sim.py            # 8 configurations x 5 seeds x 3 workloads
    python scripts/bench_speculation_sim.py --quick    # a smoke run (small, 2 seeds)

The catalog ``flare run --num-speculative-tokens 7`` captures under adaptive
selection (``SpeculationConfig.widths``; ``runtime/ranks/capacity.py``
``speculative_shapes`` with device allocation): rectangular programs (B, W,
D = W - 1, P = B x W) of widths 2, 3, 4 and 8 (every width through 4, powers of
two beyond, N + 1) and a prefix-limit program per batch B >= 2 at W = 8 with
P = B x W / 2; under them the simulator's prefill buckets 64..4096, packed
prefill (flare) and decode batches 1..64, costs of
``scripts/scheduling_sim/catalogs.py`` (``--profile``, ``--proposer``).  Every
configuration gets this catalog (fixed widths and the baselines leave the
prefix-limit programs alone).  Flare starts cold unless ``--warm``.
:class:`PrefixLimitSimulation` runs the prefix-limit rounds: a calibrated
draft (each proposal's confidence is its request's acceptance probability,
joint p^d), the program's own causal allocation
(``runtime.coordinator.rounds.device_allocation``), acceptance from the
request's common random numbers, completion through ``complete_packed_round``.

Workloads, each over seeds 0-4 (the seed draws acceptance labels and arrival
times; every configuration sees the same arrivals):

* ``closed``: 48 requests of 64 prompt and 256 output tokens at t = 0
  (tokens/s is the makespan throughput, set by the slowest third; ``--rate R``
  spaces them evenly at R/s instead);
* ``open50``, ``open90``: 192 such requests, Poisson at 50 % and 90 % of
  capacity, defined as ``scripts/bench_schedulers.py`` does: flare's (here
  adaptive's median) closed-burst output tokens/s over the mean output length.

Acceptance: one third each ``high`` (each draft accepted with probability
0.9), ``low`` (0.1), ``drifting`` (0.9 falling linearly to 0.1), shuffled by
the seed.  Configurations: ``adaptive`` (flare, every program competes),
``fixed-1`` (ordinary decode), ``fixed-2/3/4/8`` (flare at that width),
``table`` (TensorRT-LLM ``draft_len_schedule`` style) and ``global-adaptive``
(one width from a moving average of accepted length), both on prefill-first
continuous batching.

Per configuration and workload, medians over seeds: output tokens/s, gap p99
and p50 (ms between a request's visible outputs), TTFT p99, TPOT p50, draft
acceptance, tokens per round; per seed, (flare) frames and device ms by
selection reason, the top-1 % gaps by cause (:func:`gap_causes`) and the last
finisher.  Goals: closed, adaptive >= 1.10 x the best fixed width's tokens/s
and gap p99 no worse (``goal_met``); open loop, adaptive >= 1.05 x the best
fixed width and >= 1.0 x ``global-adaptive`` on tokens/s, gap p99 no worse
than the best fixed width's (``open{N}_goal_met``).  The LAST line is one JSON
object: the closed burst's ``adaptive_tokens_per_s``, ``best_fixed``,
``best_fixed_tokens_per_s``, ``adaptive_gap_ms_p99``,
``best_fixed_gap_ms_p99``, ``goal_met``, ``configs``; ``capacity_req_per_s``;
for N = 50 and 90 ``open{N}_adaptive_tokens_per_s``,
``open{N}_best_fixed_tokens_per_s``, ``open{N}_global_adaptive_tokens_per_s``,
``open{N}_adaptive_gap_ms_p99``, ``open{N}_best_fixed_gap_ms_p99``,
``open{N}_best_fixed``, ``open{N}_goals``, ``open{N}_goal_met`` and
``open{N}`` (its rate and configurations).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from bisect import bisect_right
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.plan import LanePhase
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.rounds import device_allocation
from runtime.ranks.capacity import speculative_shapes
from runtime.speculation import SpeculationConfig
from scripts.scheduling_sim.catalogs import PROFILES, PROPOSERS, profile_for
from scripts.scheduling_sim.engine import InFlight, Simulation
from scripts.scheduling_sim.metrics import percentile, summarize
from scripts.scheduling_sim.runner import RunConfig, decode_batches_for, make_scheduler
from scripts.scheduling_sim.workload import ACCEPTANCE, Arrival, assign_acceptance

# What `flare run --num-speculative-tokens 7` prepares under adaptive selection.
WIDTHS = SpeculationConfig(proposer="copy", num_speculative_tokens=7).widths  # (2, 3, 4, 8)
FIXED = (1, *WIDTHS)
CONFIGS = ("adaptive", *(f"fixed-{w}" for w in FIXED), "table", "global-adaptive")
SEEDS = (0, 1, 2, 3, 4)
OPEN_LOADS = {"open50": 0.5, "open90": 0.9}
WORKLOADS = ("closed", *OPEN_LOADS)
GOAL_TOKENS_RATIO = 1.10  # closed burst: adaptive against the best fixed width
OPEN_GOAL_VS_FIXED = 1.05  # open loop: adaptive against the best fixed width
OPEN_GOAL_VS_GLOBAL = 1.0  # open loop: adaptive against global-adaptive


def flare_run_catalog(cfg: RunConfig) -> list[GraphDescriptor]:
    """The simulator's prefill and decode programs of ``cfg`` and the speculative
    programs ``flare run`` captures for ``cfg.speculative_widths`` with device
    allocation on (``runtime.ranks.capacity.speculative_shapes``)."""
    base = replace(cfg, speculative_widths=()).catalog()
    batches = cfg.decode_batches or decode_batches_for(cfg.max_slots)
    return base + speculative_shapes(batches, cfg.speculative_widths, 0, True)


class PrefixLimitSimulation(Simulation):
    """:class:`Simulation` that also completes prefix-limit (device-allocated)
    rounds: a calibrated draft, the program's own causal allocation, the
    request's common random numbers (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Per completed frame: (observed at, reason, prefill?, the request ids).
        self.frame_log: list[tuple[int, str, bool, frozenset[int]]] = []

    def prefix_limit_round(self, plan) -> tuple[list[list[list[float]]], list[int]]:
        """The confidence sidecar [2, B, D] of ``plan`` and each lane's rows."""
        depth = plan.graph.proposal_depth
        conditional, joint = [], []
        for lane in plan.lanes:
            stats = self.requests[lane.handle.id]
            p = ACCEPTANCE[stats.acceptance].probability(stats.output_tokens, stats.output_target)
            conditional.append([p] * depth)
            joint.append([p**d for d in range(1, depth + 1)])
        ceilings = [lane.max_tokens for lane in plan.lanes]
        slots = [lane.slot for lane in plan.lanes]
        rows = device_allocation(joint, ceilings, slots, plan.graph.target_capacity)
        padding = [[0.0] * depth] * (plan.graph.batch_capacity - len(plan.lanes))
        return [conditional + padding, joint + padding], rows

    def _complete(self, frame: InFlight) -> None:
        plan = frame.plan
        ids = frozenset(lane.handle.id for lane in plan.lanes)
        prefill = plan.graph.kind is GraphKind.PREFILL
        self.frame_log.append((self.now_ns, plan.reason.value, prefill, ids))
        if not (plan.graph.kind is GraphKind.SPECULATIVE and plan.graph.device_allocated):
            super()._complete(frame)
            return
        confidence, rows = self.prefix_limit_round(plan)
        records = []
        for lane, q in zip(plan.lanes, rows, strict=True):
            count = lane.max_tokens
            if lane.phase is LanePhase.DECODE and count > 0:
                count = self._speculative_tokens(replace(lane, max_tokens=q))
            tokens = tuple(self.rng.randrange(32000) for _ in range(count))
            records.append(CompletionRecord(lane.slot, lane.generation, tokens))
        wall = self.now_ns - frame.dispatch_ns
        timing = ExecutionTiming(
            (frame.device_ns,) * self.tp, host_wall_ns=wall, queued=frame.queued
        )
        generated = self.scheduler.complete_packed_round(frame.fence, records, timing, confidence)
        self.frames += 1
        for record in self.scheduler.drain_trace():
            self.trace.append(record.to_json())
        for g in generated:
            stats = self.requests[g.handle.id]
            stats.output_tokens += len(g.tokens)
            stats.publications_ns.append(self.now_ns)
            self.scheduler.published_output(g.handle, g.fence, self.now_ns)
            if g.finished:
                stats.finished_ns = self.now_ns


def gap_causes(sim: PrefixLimitSimulation) -> dict[str, int]:
    """The top 1 % of output gaps (what sets gap p99) by the frames observed in
    them: an acceptance probe, else a discovery, else a prefill, else a round
    the request was left out of, else only its own round."""
    times = [entry[0] for entry in sim.frame_log]
    gaps = sorted(
        ((b - a, rid, a, b) for rid, s in sim.requests.items()
         for a, b in pairwise(s.publications_ns)),
        reverse=True,
    )  # fmt: skip
    causes: Counter[str] = Counter()
    for _, rid, a, b in gaps[: len(gaps) // 100]:
        window = sim.frame_log[bisect_right(times, a) : bisect_right(times, b)]
        reasons = {reason for _, reason, _, _ in window}
        if "acceptance-learning" in reasons:
            causes["probe"] += 1
        elif "discovery" in reasons:
            causes["discovery"] += 1
        elif any(prefill for _, _, prefill, _ in window):
            causes["prefill"] += 1
        else:
            causes["left_out" if any(rid not in ids for *_, ids in window) else "round"] += 1
    return dict(causes)


def simulate(cfg: RunConfig, arrivals: list[Arrival]) -> tuple[dict, PrefixLimitSimulation]:
    """``scripts.scheduling_sim.runner.simulate`` on :func:`flare_run_catalog`
    with prefix-limit rounds; the report adds TPOT p50, the top-1 % gaps by
    cause, the last finisher and (flare) frames and device ms by reason."""
    catalog = flare_run_catalog(cfg)
    scheduler = make_scheduler(cfg, catalog)
    duration_ns = profile_for(cfg.profile, cfg.proposer).duration_ns
    if cfg.warm and cfg.scheduler == "flare":
        for desc in catalog:
            scheduler.catalog.observe(desc, duration_ns(desc), 0)
    sim = PrefixLimitSimulation(scheduler, duration_ns, arrivals, seed=cfg.seed, catalog=catalog)
    sim.run(until_ns=int(cfg.max_seconds * 1e9))
    report = summarize(sim, speculation=True)
    tpots = [s.tpot_ns / 1e6 for s in sim.requests.values() if s.tpot_ns is not None]
    report.update(
        seed=cfg.seed,
        tpot_ms_p50=round(percentile(tpots, 50), 3),
        prefix_limit_rounds=sum(
            n for name, n in sim.frames_by_graph.items() if name.endswith("device-allocated")
        ),
    )
    last = max(sim.requests.values(), key=lambda s: s.finished_ns or sim.now_ns)
    report["last_finisher"] = [last.acceptance, round((last.e2e_ns or 0) / 1e6, 1)]
    report["top_gap_causes"] = gap_causes(sim)
    if cfg.scheduler == "flare":
        report["reasons"] = {
            reason.value: [n, round(scheduler.execution_ns[reason] / 1e6, 3)]
            for reason, n in scheduler.executions.items()
            if n
        }
    return report, sim


def population(requests: int, prompt: int, output: int, rate: float, seed: int) -> list[Arrival]:
    """``requests`` identical requests at t = 0 (or every 1/rate s), one third
    each high, low and drifting acceptance (a shuffle seeded by ``seed``)."""
    spacing = 0.0 if rate <= 0 else 1e9 / rate
    arrivals = [Arrival(int(i * spacing), RequestSpec(prompt, output)) for i in range(requests)]
    return assign_acceptance(arrivals, "mixed", seed)


def poisson_population(
    requests: int, prompt: int, output: int, rate: float, seed: int
) -> list[Arrival]:
    """:func:`population` with Poisson arrivals at ``rate`` requests/s (the
    first one gap after t = 0), times from a generator of their own seeded
    by ``seed``."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = random.Random(f"arrivals:{seed}")
    t_ns, arrivals = 0.0, []
    for _ in range(requests):
        t_ns += rng.expovariate(rate) * 1e9
        arrivals.append(Arrival(int(t_ns), RequestSpec(prompt, output)))
    return assign_acceptance(arrivals, "mixed", seed)


def run_config(name: str, base: RunConfig) -> RunConfig:
    """The run of configuration ``name`` (see the module docstring)."""
    if name == "adaptive":
        return replace(base, scheduler="flare", fixed_speculative_width=0)
    if name.startswith("fixed-"):
        return replace(base, scheduler="flare", fixed_speculative_width=int(name.split("-")[1]))
    return replace(base, scheduler=name, fixed_speculative_width=0, warm=False)


def _run(job: tuple[str, str, RunConfig, tuple[int, int, int, float], int]) -> tuple:
    workload, name, base, (requests, prompt, output, rate), seed = job
    make = population if workload == "closed" else poisson_population
    cfg = run_config(name, replace(base, seed=seed))
    report, _ = simulate(cfg, make(requests, prompt, output, rate, seed))
    report.pop("frames_by_graph", None)
    return workload, name, seed, report


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


# Medians over seeds, and what each seed's row keeps.
SUMMARY_KEYS = (
    "output_tokens_per_s", "gap_ms_p99", "gap_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
    "draft_acceptance", "tokens_per_round", "sim_seconds",
)  # fmt: skip
PER_SEED_KEYS = (
    "seed", "output_tokens_per_s", "gap_ms_p99", "ttft_ms_p99", "tpot_ms_p50", "finished",
    "draft_acceptance", "tokens_per_round", "rounds_by_width", "prefix_limit_rounds", "reasons",
    "top_gap_causes", "last_finisher",
)  # fmt: skip


def summarize_config(reports: list[dict]) -> dict:
    out = {key: _median([r.get(key) for r in reports]) for key in SUMMARY_KEYS}
    out["finished_all"] = all(r["finished"] == r["requests"] for r in reports)
    out["per_seed"] = [{k: r.get(k) for k in PER_SEED_KEYS if k in r} for r in reports]
    return out


def _best_fixed(configs: dict[str, dict]) -> str:
    fixed = [name for name in configs if name.startswith("fixed-")]
    return max(fixed, key=lambda n: (configs[n]["output_tokens_per_s"], -int(n.split("-")[1])))


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def headline(configs: dict[str, dict]) -> dict:
    """The closed burst's figures (today's keys)."""
    best = _best_fixed(configs)
    adaptive = configs["adaptive"]
    tps, gap = adaptive["output_tokens_per_s"], adaptive["gap_ms_p99"]
    best_tps, best_gap = configs[best]["output_tokens_per_s"], configs[best]["gap_ms_p99"]
    return {
        "adaptive_tokens_per_s": tps,
        "adaptive_gap_ms_p99": gap,
        "best_fixed": best,
        "best_fixed_tokens_per_s": best_tps,
        "best_fixed_gap_ms_p99": best_gap,
        "adaptive_vs_best_fixed_tokens": _ratio(tps, best_tps),
        "goal_met": bool(tps >= GOAL_TOKENS_RATIO * best_tps and gap <= best_gap),
    }


def open_headline(workload: str, configs: dict[str, dict]) -> dict:
    """An open-loop workload's figures, keys prefixed with ``workload``."""
    best = _best_fixed(configs)
    tps, gap = configs["adaptive"]["output_tokens_per_s"], configs["adaptive"]["gap_ms_p99"]
    best_tps, best_gap = configs[best]["output_tokens_per_s"], configs[best]["gap_ms_p99"]
    global_tps = configs["global-adaptive"]["output_tokens_per_s"]
    goals = {
        "vs_best_fixed": tps >= OPEN_GOAL_VS_FIXED * best_tps,
        "vs_global_adaptive": tps >= OPEN_GOAL_VS_GLOBAL * global_tps,
        "gap": gap <= best_gap,
    }
    figures = {
        "adaptive_tokens_per_s": tps,
        "best_fixed": best,
        "best_fixed_tokens_per_s": best_tps,
        "global_adaptive_tokens_per_s": global_tps,
        "adaptive_gap_ms_p99": gap,
        "best_fixed_gap_ms_p99": best_gap,
        "adaptive_vs_best_fixed_tokens": _ratio(tps, best_tps),
        "adaptive_vs_global_adaptive_tokens": _ratio(tps, global_tps),
        "goals": goals,
        "goal_met": all(goals.values()),
    }
    return {f"{workload}_{key}": value for key, value in figures.items()}


def print_table(title: str, configs: dict[str, dict]) -> None:
    columns = (
        ("tok/s", "output_tokens_per_s", "{:.0f}"),
        ("gap p99", "gap_ms_p99", "{:.2f}"),
        ("gap p50", "gap_ms_p50", "{:.2f}"),
        ("TTFT p99", "ttft_ms_p99", "{:.1f}"),
        ("TPOT p50", "tpot_ms_p50", "{:.3f}"),
        ("accept", "draft_acceptance", "{:.3f}"),
        ("tok/round", "tokens_per_round", "{:.2f}"),
    )
    header = f"{'configuration':<18}" + "".join(f"{c:>11}" for c, _, _ in columns)
    print(f"\n{title}")
    print(header)
    print("-" * len(header))
    for name, row in configs.items():
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append(f"{'-' if value is None else fmt.format(value):>11}")
        flag = "" if row["finished_all"] else "  (unfinished requests)"
        print(f"{name:<18}" + "".join(cells) + flag)


def run_jobs(jobs: list[tuple], n_jobs: int) -> dict[str, dict[str, dict]]:
    """Run ``jobs`` (see :func:`_run`); per workload, per configuration, the summary."""
    if n_jobs > 1:
        with ProcessPoolExecutor(max_workers=n_jobs) as pool:
            done = list(pool.map(_run, jobs))
    else:
        done = [_run(job) for job in jobs]
    reports: dict[str, dict[str, list[dict]]] = {}
    for workload, name, _, report in sorted(
        done, key=lambda d: (WORKLOADS.index(d[0]), CONFIGS.index(d[1]), d[2])
    ):
        reports.setdefault(workload, {}).setdefault(name, []).append(report)
    return {
        workload: {name: summarize_config(rs) for name, rs in by_name.items()}
        for workload, by_name in reports.items()
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="12/24 requests, 64 output tokens, 2 seeds")
    p.add_argument("--requests", type=int, help="closed burst; default 48 (quick: 12)")
    p.add_argument("--open-requests", type=int, help="open loop; default 192 (quick: 24)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, help="default 256 (quick: 64)")
    p.add_argument("--rate", type=float, default=0.0, help="closed: arrivals/s, evenly spaced")
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 5; quick: 2)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="llama1b-h100")
    p.add_argument("--proposer", choices=list(PROPOSERS), default="draft")
    p.add_argument("--warm", action="store_true", help="flare starts with every cost measured")
    p.add_argument("--no-open", action="store_true", help="the closed burst only")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    args.requests = args.requests or (12 if args.quick else 48)
    args.open_requests = args.open_requests or (24 if args.quick else 192)
    args.output_len = args.output_len or (64 if args.quick else 256)
    args.seed_list = (
        tuple(range(args.seeds)) if args.seeds else (SEEDS[:2] if args.quick else SEEDS)
    )
    sizes = (args.requests, args.open_requests, args.output_len, args.prompt_len)
    if min(sizes) < 1 or not args.seed_list:
        p.error("request counts, --output-len, --prompt-len and --seeds must be >= 1")
    return args


def why_line(name: str, row: dict) -> str:
    """What set ``name``'s tails, over all seeds: its top-1 % gaps by cause
    (:func:`gap_causes`) and the acceptance and latency of its last finishers."""
    causes: Counter[str] = Counter()
    for seed in row["per_seed"]:
        causes.update(seed.get("top_gap_causes") or {})
    last = [seed["last_finisher"] for seed in row["per_seed"] if seed.get("last_finisher")]
    finishers = ", ".join(f"{acceptance} {e2e:.0f} ms" for acceptance, e2e in last)
    return (
        f"  {name}: top-1% gaps by cause {dict(causes.most_common())}; last finishers {finishers}"
    )


def report_closed(args: argparse.Namespace, configs: dict[str, dict]) -> dict:
    head = headline(configs)
    closed = "all at t = 0" if args.rate <= 0 else f"every {1 / args.rate:.3f} s"
    print_table(f"closed: {args.requests} requests {closed}", configs)
    print(
        f"adaptive {head['adaptive_tokens_per_s']:.0f} tok/s, gap p99 "
        f"{head['adaptive_gap_ms_p99']:.2f} ms; best fixed {head['best_fixed']} "
        f"{head['best_fixed_tokens_per_s']:.0f} tok/s, gap p99 "
        f"{head['best_fixed_gap_ms_p99']:.2f} ms; ratio {head['adaptive_vs_best_fixed_tokens']}; "
        f"goal (>= {GOAL_TOKENS_RATIO:.2f}x, gap no worse) "
        + ("met" if head["goal_met"] else "not met")
    )
    print(why_line("adaptive", configs["adaptive"]))
    print(why_line(head["best_fixed"], configs[head["best_fixed"]]))
    return head


def report_open(workload: str, rate: float, requests: int, configs: dict[str, dict]) -> dict:
    print_table(f"{workload}: {requests} requests, Poisson at {rate:.2f} req/s", configs)
    f = open_headline(workload, configs)
    print(
        f"adaptive {f[f'{workload}_adaptive_tokens_per_s']:.0f} tok/s "
        f"({f[f'{workload}_adaptive_vs_best_fixed_tokens']}x best fixed "
        f"{f[f'{workload}_best_fixed']}, {f[f'{workload}_adaptive_vs_global_adaptive_tokens']}x "
        f"global-adaptive), gap p99 {f[f'{workload}_adaptive_gap_ms_p99']:.2f} against "
        f"{f[f'{workload}_best_fixed_gap_ms_p99']:.2f} ms; goals "
        + ", ".join(f"{k} {'met' if v else 'missed'}" for k, v in f[f"{workload}_goals"].items())
    )
    for name in ("adaptive", f[f"{workload}_best_fixed"], "global-adaptive"):
        print(why_line(name, configs[name]))
    return {**f, workload: {"rate_per_s": rate, "configs": configs}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seeds, output = args.seed_list, args.output_len
    base = RunConfig(
        profile=args.profile, speculative_widths=WIDTHS, proposer=args.proposer, warm=args.warm
    )
    shape = (args.requests, args.prompt_len, output, args.rate)
    jobs = [("closed", name, base, shape, seed) for name in CONFIGS for seed in seeds]
    results = run_jobs(jobs, args.jobs)
    # Capacity as bench_schedulers defines it: flare's burst throughput over the
    # mean output, in requests/s.
    capacity = results["closed"]["adaptive"]["output_tokens_per_s"] / output
    rates = {w: round(load * capacity, 3) for w, load in OPEN_LOADS.items()}
    if not args.no_open:
        jobs = [
            (w, name, base, (args.open_requests, args.prompt_len, output, rates[w]), seed)
            for w in OPEN_LOADS
            for name in CONFIGS
            for seed in seeds
        ]
        results.update(run_jobs(jobs, args.jobs))
    print(
        f"prompt {args.prompt_len}, output {output}; acceptance 1/3 high, low, drifting; "
        f"profile {args.profile}, proposer {args.proposer}; widths {list(WIDTHS)} + prefix-limit "
        f"W={WIDTHS[-1]} P=B*W/2; flare {'warm' if args.warm else 'cold'}; medians over seeds "
        f"{list(seeds)}; capacity {capacity:.2f} req/s"
    )
    head = report_closed(args, results["closed"])
    out = {"capacity_req_per_s": round(capacity, 3), "configs": results["closed"], **head}
    for w in OPEN_LOADS if not args.no_open else ():
        out.update(report_open(w, rates[w], args.open_requests, results[w]))
    names = ("requests", "open_requests", "prompt_len", "output_len", "profile", "proposer")
    out["settings"] = {name: getattr(args, name) for name in (*names, "warm", "quick")}
    out["settings"].update(
        rate_per_s=args.rate, open_rates_per_s=rates, acceptance="mixed", seeds=list(seeds),
        speculative_widths=list(WIDTHS), prefix_limit=f"W={WIDTHS[-1]}, P=B*W/2, B>=2",
    )  # fmt: skip
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
