"""Every scheduler over the whole workload suite, under both cost profiles.

    python scripts/bench_schedulers.py            # the suite (a few minutes)
    python scripts/bench_schedulers.py --quick    # small counts, one profile (a smoke run)

The schedulers: ``flare`` (the production scheduler, balanced preset) and the
baselines of ``scripts/scheduling_sim/baselines`` (``fcfs``, ``vllm``,
``sglang``, ``sarathi``, ``vtc``), all over the same prepared catalog (with
``--mixed-prefill``, the default here, the mixed shapes of ``mixed_shapes``
for every scheduler), the same slot count and the same costs.  ``flare-nomixed``
is flare over the catalog without mixed shapes and ``flare-warm`` is flare whose
catalog was measured before the run (every estimate known at t = 0, so no
discovery frames), both for reference; they take no part in the goals.

The workloads (``scripts/scheduling_sim/workload.py``), per cost profile:

* ``burst``: 64 chat-shaped requests at t = 0.  Flare's output tokens/s here,
  divided by the burst's mean output length, defines capacity (requests/s).
* ``chat50``, ``chat80``, ``chat95``: log-normal chat lengths, Poisson arrivals
  at 50 %, 80 % and 95 % of capacity.
* ``contention``: 12 streams decoding while prompts of 2k-8k tokens arrive.
* ``tenants``: tenant 0 floods at 4x capacity, tenant 1 sends steadily at 0.25x.
* ``issue_a``, ``issue_b``: the two commands of the mixed-programs issue
  (``--requests 100 --prompt-len 128:1024 --output-len 64:512 --arrival-rate 8``
  and ``--requests 64 --prompt-len 64:4096 --output-len 16:512 --arrival-rate 20``).
* ``chat_shared``: chat behind shared system prompts (issue 26): 200 requests,
  each one of 6 system prompts (512-2000 tokens, whole 16-token pages, picked
  Zipf-like) then a chat-shaped user message and output, Poisson at a fixed 70
  requests/s (near but below saturation on the roofline profile; the rate is
  not a share of capacity).  The prompts name their token ids, so every
  scheduler's prefix cache reuses the system prompts: flare's own, and the one
  model all baselines share (``baselines/_base.py``: full pages published as
  prefill chunks complete, the longest published prefix attached when a request
  is first scheduled, never its last token, unbounded).  Below its table a line
  gives each scheduler's cache hit rate (cached / prompt tokens); its JSON
  entries add ``prompt_tokens``, ``prompt_tokens_cached``,
  ``prompt_tokens_computed`` and ``cache_hit_rate``.
* ``long``: long prompts (issue 26): 60 requests of 1.5k-6k-token prompts and
  64-512 output tokens, Poisson at 2 requests/s, always under the 8B roofline
  profile (``llama8b-h100``) whatever ``--profiles`` says (its rate is fixed,
  not a share of capacity).

The profiles: ``llama1b-h100`` (roofline: overhead + max(memory, compute)) and
``llama1b-h100-additive`` (compute added on top of the weight-streaming floor).

Goals, checked per profile and workload and printed after the tables: flare is
not Pareto-dominated by any baseline on (TTFT p99, gap p99, tokens/s; tokens/s
within 0.5% count as equal); flare's goodput at both SLO pairs (500/50 ms and
the tight 200/20 ms) is at least every baseline's; against ``vllm``: TTFT p99
no worse, gap p99 at most 0.7x, tokens/s at least 0.98x.

Prints one table per workload; the last line is one JSON object holding every
figure (``ttft_ms_p50``/``p99``, ``gap_ms_p50``/``p99``/``max``,
``output_tokens_per_s``, ``goodput_req_per_s``, ``fairness_jain``, ...).

``--speculation``: the same suite with speculative programs in every catalog
(``--speculative-widths``, default 2..8, D = W - 1) and every request labelled
with an acceptance profile (``--acceptance``, default ``mixed``: one third each
high 0.9, low 0.1, drifting 0.9 -> 0.1).  Flare selects widths adaptively
(``fixed_speculative_width=0``); the baselines above keep ordinary decode, and
the speculative baselines join them: ``spec-w2`` and ``spec-w4`` (prefill-first
continuous batching at a fixed width, ``--spec-fixed-widths``), ``table``
(TensorRT-LLM ``draft_len_schedule`` style) and ``global-adaptive``.  The goals
are checked against all of them; the output format is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.scheduling_sim.metrics import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
from scripts.scheduling_sim.runner import SCHEDULERS, RunConfig, simulate
from scripts.scheduling_sim.workload import (
    ACCEPTANCE_CHOICES,
    WorkloadConfig,
    assign_acceptance,
    burst,
    chat,
    chat_shared,
    long_prompt_contention,
    make_workload,
    two_tenants,
)

PROFILES = ("llama1b-h100", "llama1b-h100-additive")
BASELINES = tuple(s for s in SCHEDULERS if s != "flare")
REFERENCES = ("flare-nomixed", "flare-warm")
CHAT_LOADS = {"chat50": 0.5, "chat80": 0.8, "chat95": 0.95}
WORKLOADS = (
    "burst", *CHAT_LOADS, "contention", "tenants", "issue_a", "issue_b", "chat_shared", "long",
)  # fmt: skip
FIXED_RATE = ("burst", "chat_shared", "long")  # workloads whose rate is not a share of capacity
LONG_PROFILE = "llama8b-h100"  # the long-prompt workload's profile, whatever --profiles says
EQUAL_TPS = 0.005  # tokens/s within 0.5% count as equal in the dominance test
VLLM_GAP_RATIO = 0.7
VLLM_TPS_RATIO = 0.98
SPECULATIVE_WIDTHS = tuple(range(2, 9))  # --speculation's catalog widths
SPEC_FIXED_WIDTHS = (2, 4)  # --speculation: the fixed-width baseline at each
SPEC_RULES = ("table", "global-adaptive")  # --speculation: the width-rule baselines


def workload(name: str, capacity_req_per_s: float, quick: bool, acceptance: str | None = None):
    """The arrivals of ``name`` (fixed request counts; ``quick`` shrinks them),
    labelled with ``acceptance`` (see ``assign_acceptance``) when given."""
    arrivals = _workload(name, capacity_req_per_s, quick)
    if acceptance is not None:
        arrivals = assign_acceptance(arrivals, acceptance, seed=0)
    return arrivals


def _workload(name: str, capacity_req_per_s: float, quick: bool):
    scale = 4 if quick else 1
    if name == "burst":
        return burst(requests=64 // scale)
    if name in CHAT_LOADS:
        return chat(CHAT_LOADS[name] * capacity_req_per_s, 200 // scale)
    if name == "contention":
        return long_prompt_contention(long_prompts=6 // (2 if quick else 1))
    if name == "tenants":
        return two_tenants(
            capacity_req_per_s, flood_requests=96 // scale, steady_requests=16 // scale
        )
    if name == "issue_a":
        return make_workload(
            WorkloadConfig(100 // scale, 8.0, prompt_len=(128, 1024), output_len=(64, 512))
        )
    if name == "issue_b":
        return make_workload(
            WorkloadConfig(64 // scale, 20.0, prompt_len=(64, 4096), output_len=(16, 512))
        )
    if name == "chat_shared":  # a fixed rate (ChatSharedConfig.rate_per_s)
        return chat_shared(n=200 // scale)
    if name == "long":
        return make_workload(
            WorkloadConfig(60 // scale, 2.0, prompt_len=(1536, 6144), output_len=(64, 512))
        )
    raise ValueError(f"unknown workload {name!r}")


def capacity(
    flare: RunConfig, quick: bool = False, acceptance: str | None = None
) -> tuple[float, dict]:
    """Capacity in requests/s: flare's output tokens/s on the burst over its mean output."""
    arrivals = workload("burst", 1.0, quick, acceptance)
    report, _ = simulate(flare, arrivals)
    mean_output = sum(a.spec.max_output_tokens for a in arrivals) / len(arrivals)
    return report["output_tokens_per_s"] / mean_output, report


def _run(job: tuple[RunConfig, str, float, bool, str | None]) -> dict:
    cfg, name, capacity, quick, acceptance = job
    if name == "long":
        cfg = replace(cfg, profile=LONG_PROFILE)
    report, _ = simulate(cfg, workload(name, capacity, quick, acceptance))
    return report


def configs(
    base: RunConfig,
    profile: str,
    spec_fixed_widths: tuple[int, ...] = SPEC_FIXED_WIDTHS,
) -> dict[str, RunConfig]:
    """Every scheduler's run; with speculative widths in ``base``'s catalog also
    the speculative baselines (``spec-w<W>`` for each of ``spec_fixed_widths``,
    then :data:`SPEC_RULES`)."""
    out = {"flare": replace(base, profile=profile, scheduler="flare")}
    out.update({b: replace(base, profile=profile, scheduler=b) for b in BASELINES})
    if base.speculative_widths:
        for w in spec_fixed_widths:
            out[f"spec-w{w}"] = replace(
                base, profile=profile, scheduler="fixed-width", fixed_speculative_width=w
            )
        out.update({b: replace(base, profile=profile, scheduler=b) for b in SPEC_RULES})
    out["flare-nomixed"] = replace(base, profile=profile, scheduler="flare", mixed_prefill=False)
    out["flare-warm"] = replace(base, profile=profile, scheduler="flare", warm=True)
    return out


def dominated(mine: dict, other: dict) -> bool:
    """``other`` is at least as good on (TTFT p99, gap p99, tokens/s) and better on
    one; tokens/s within :data:`EQUAL_TPS` (relative) count as equal."""
    tps, other_tps = mine["output_tokens_per_s"], other["output_tokens_per_s"]
    if abs(other_tps - tps) <= EQUAL_TPS * max(tps, other_tps):
        other_tps = tps
    m = (mine["ttft_ms_p99"], mine["gap_ms_p99"], -tps)
    o = (other["ttft_ms_p99"], other["gap_ms_p99"], -other_tps)
    return all(b <= a for a, b in zip(m, o)) and any(b < a for a, b in zip(m, o))


def goals(results: dict[str, dict]) -> dict:
    """Flare against every baseline in ``results`` (the references excluded)."""
    flare, vllm = results["flare"], results["vllm"]
    rivals = [s for s in results if s != "flare" and s not in REFERENCES]
    by = [b for b in rivals if dominated(flare, results[b])]
    goodput = {
        key: [b for b in rivals if results[b].get(key, 0.0) > flare.get(key, 0.0)]
        for key in ("goodput_req_per_s", "goodput_tight_req_per_s")
    }
    return {
        "pareto_ok": not by,
        "dominated_by": by,
        "goodput_ok": not goodput["goodput_req_per_s"],
        "goodput_beaten_by": goodput["goodput_req_per_s"],
        "goodput_tight_ok": not goodput["goodput_tight_req_per_s"],
        "goodput_tight_beaten_by": goodput["goodput_tight_req_per_s"],
        "ttft_p99_vs_vllm": round(flare["ttft_ms_p99"] / max(1e-9, vllm["ttft_ms_p99"]), 3),
        "gap_p99_vs_vllm": round(flare["gap_ms_p99"] / max(1e-9, vllm["gap_ms_p99"]), 3),
        "tokens_per_s_vs_vllm": round(
            flare["output_tokens_per_s"] / max(1e-9, vllm["output_tokens_per_s"]), 3
        ),
        "ttft_ok": flare["ttft_ms_p99"] <= vllm["ttft_ms_p99"],
        "gap_ok": flare["gap_ms_p99"] <= VLLM_GAP_RATIO * vllm["gap_ms_p99"],
        "tokens_per_s_ok": flare["output_tokens_per_s"]
        >= VLLM_TPS_RATIO * vllm["output_tokens_per_s"],
    }


COLUMNS = (
    ("tok/s", "output_tokens_per_s", "{:.0f}"),
    ("TTFT p50", "ttft_ms_p50", "{:.1f}"),
    ("TTFT p99", "ttft_ms_p99", "{:.1f}"),
    ("gap p50", "gap_ms_p50", "{:.2f}"),
    ("gap p99", "gap_ms_p99", "{:.2f}"),
    ("gap max", "gap_ms_max", "{:.1f}"),
    ("goodput/s", "goodput_req_per_s", "{:.2f}"),
    ("good %", "goodput_fraction", "{:.0%}"),
    ("fairness", "fairness_jain", "{:.3f}"),
)


def print_table(title: str, results: dict[str, dict]) -> None:
    print(f"\n## {title}")
    first = max(14, 1 + max(map(len, results), default=0))
    header = f"{'scheduler':<{first}}" + "".join(f"{name:>10}" for name, _, _ in COLUMNS)
    print(header)
    print("-" * len(header))
    for scheduler, report in results.items():
        cells = []
        for _, key, fmt in COLUMNS:
            value = report.get(key)
            cells.append(f"{'-' if value is None else fmt.format(value):>10}")
        print(f"{scheduler:<{first}}" + "".join(cells))
    tenants = results["flare"].get("tenant_slowdown_mean")
    if tenants:
        print("mean slowdown per tenant: " + "; ".join(
            f"{s} " + ", ".join(f"t{t}={v:.2f}" for t, v in r["tenant_slowdown_mean"].items())
            for s, r in results.items() if r.get("tenant_slowdown_mean")
        ))  # fmt: skip


def print_cache_line(results: dict[str, dict]) -> None:
    """Each scheduler's prefix cache hit rate, for a workload whose requests name
    their prompt tokens (nothing otherwise)."""
    if "cache_hit_rate" not in results["flare"]:
        return
    print("prefix cache hit rate (cached / prompt tokens): " + ", ".join(
        f"{s} {r['cache_hit_rate']:.2%}" for s, r in results.items() if "cache_hit_rate" in r
    ))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated cost profiles")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads")
    p.add_argument("--no-mixed-prefill", action="store_true", help="catalogs without mixed shapes")
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--ttft-slo-ms", type=float, default=DEFAULT_TTFT_SLO_MS)
    p.add_argument("--tpot-slo-ms", type=float, default=DEFAULT_TPOT_SLO_MS)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="small request counts (a smoke run)")
    p.add_argument(
        "--speculation",
        action="store_true",
        help="speculative programs in the catalogs, acceptance-labelled requests, "
        "speculative baselines",
    )
    p.add_argument(
        "--speculative-widths",
        default=",".join(map(str, SPECULATIVE_WIDTHS)),
        help="--speculation: catalog widths W (D = W - 1)",
    )
    p.add_argument(
        "--spec-fixed-widths",
        default=",".join(map(str, SPEC_FIXED_WIDTHS)),
        help="--speculation: widths of the fixed-width baseline runs (spec-w<W>)",
    )
    p.add_argument(
        "--acceptance",
        choices=list(ACCEPTANCE_CHOICES),
        default="mixed",
        help="--speculation: the requests' acceptance profile",
    )
    args = p.parse_args(argv)
    profiles = [x for x in args.profiles.split(",") if x]
    names = [x for x in args.workloads.split(",") if x]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"--workloads: unknown {unknown}; choose from {list(WORKLOADS)}")
    try:
        spec_widths = tuple(int(x) for x in args.speculative_widths.split(",") if x)
        fixed_widths = tuple(int(x) for x in args.spec_fixed_widths.split(",") if x)
    except ValueError:
        p.error("--speculative-widths and --spec-fixed-widths take comma-separated integers")
    if args.speculation and (not spec_widths or min(spec_widths + fixed_widths, default=1) < 1):
        p.error("--speculation needs widths >= 1")
    acceptance = args.acceptance if args.speculation else None
    base = RunConfig(
        mixed_prefill=not args.no_mixed_prefill,
        max_slots=args.max_slots,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        speculative_widths=spec_widths if args.speculation else (),
    )
    out: dict = {"settings": {}, "capacity_req_per_s": {}, "profiles": {}, "goals": {}}
    out["settings"] = {
        "mixed_prefill": base.mixed_prefill,
        "max_slots": base.max_slots,
        "policy": base.policy,
        "ttft_slo_ms": base.ttft_slo_ms,
        "tpot_slo_ms": base.tpot_slo_ms,
        "quick": args.quick,
    }
    if args.speculation:
        out["settings"].update(
            speculation=True,
            speculative_widths=list(spec_widths),
            spec_fixed_widths=list(fixed_widths),
            acceptance=acceptance,
        )
    misses: list[str] = []
    sections = [(profile, [n for n in names if n != "long"]) for profile in profiles]
    if "long" in names:  # its own profile and a fixed rate (no capacity of its own)
        sections.append((LONG_PROFILE, ["long"]))
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for profile, workloads in sections:
            if workloads:
                run_profile(pool, base, profile, workloads, fixed_widths, args, acceptance,
                            out, misses)  # fmt: skip
    title = "flare with mixed programs, balanced preset"
    if args.speculation:
        title += ", adaptive speculation"
    print(f"\n## goals ({title})")
    print(
        f"{'profile / workload':<38}{'pareto':>8}{'goodput':>9}{'tight':>7}"
        f"{'TTFT/vllm':>11}{'gap/vllm':>10}{'tok/vllm':>10}"
    )
    for profile, by_name in out["goals"].items():
        for name, g in by_name.items():
            pareto = "ok" if g["pareto_ok"] else "by " + ",".join(g["dominated_by"])
            print(
                f"{profile + ' / ' + name:<38}{pareto:>8}"
                f"{'ok' if g['goodput_ok'] else 'miss':>9}"
                f"{'ok' if g['goodput_tight_ok'] else 'miss':>7}"
                f"{g['ttft_p99_vs_vllm']:>10.2f}{'' if g['ttft_ok'] else '!'}"
                f"{g['gap_p99_vs_vllm']:>9.2f}{'' if g['gap_ok'] else '!'}"
                f"{g['tokens_per_s_vs_vllm']:>9.3f}{'' if g['tokens_per_s_ok'] else '!'}"
            )
    print(f"misses: {len(misses)}" + ("" if not misses else " (" + "; ".join(misses) + ")"))
    out["misses"] = misses
    print(json.dumps(out, sort_keys=True))
    return 0


def run_profile(
    pool, base: RunConfig, profile: str, names: list[str], fixed_widths: tuple[int, ...],
    args: argparse.Namespace, acceptance: str | None, out: dict, misses: list[str],
) -> None:  # fmt: skip
    """Every scheduler over ``names`` under ``profile``: tables printed, figures,
    capacity and goals into ``out``, missed goals appended to ``misses``."""
    cfgs = configs(base, profile, fixed_widths)
    # Capacity first: flare's output tokens/s on the burst.
    cap, burst_report = capacity(cfgs["flare"], args.quick, acceptance)
    out["capacity_req_per_s"][profile] = round(cap, 3)
    per_profile: dict = {}
    jobs = {
        (name, s): (cfg, name, cap, args.quick, acceptance)
        for name in names
        for s, cfg in cfgs.items()
        if not (name == "burst" and s == "flare")
    }
    futures = {key: pool.submit(_run, job) for key, job in jobs.items()}
    for name in names:
        results = {}
        for s in cfgs:
            if name == "burst" and s == "flare":
                results[s] = burst_report
            else:
                results[s] = futures[(name, s)].result()
        per_profile[name] = results
        title = f"{profile} / {name}"
        if name not in FIXED_RATE:
            title += f" (capacity {cap:.2f} req/s)"
        print_table(title, results)
        print_cache_line(results)
        g = goals(results)
        out["goals"].setdefault(profile, {})[name] = g
        for key in (
            "pareto_ok", "goodput_ok", "goodput_tight_ok", "ttft_ok", "gap_ok", "tokens_per_s_ok",
        ):  # fmt: skip
            if not g[key]:
                misses.append(f"{profile}/{name}: {key}")
    out["profiles"][profile] = {
        name: {
            s: {k: v for k, v in r.items() if k != "frames_by_graph"}
            | {"frames_by_kind": frames_by_kind(r)}
            for s, r in results.items()
        }
        for name, results in per_profile.items()
    }


def frames_by_kind(report: dict) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for graph, count in report.get("frames_by_graph", {}).items():
        kind = graph.split()[0]
        kinds[kind] = kinds.get(kind, 0) + count
    return kinds


if __name__ == "__main__":
    sys.exit(main())
