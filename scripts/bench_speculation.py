"""Speculative decoding on the real runtime: off, each fixed width, adaptive.

    python scripts/bench_speculation.py                 # concurrency 1, 8, 32; 3 runs each
    python scripts/bench_speculation.py --quick         # a smoke run (1 run, short outputs)

The embedded default model with its trained draft (``--draft-model default``),
one CPU rank (``--tp`` for more; ``--device cuda`` on a GPU machine), greedy
decoding with ``ignore_eos``.  Prompts: paragraphs of the held-out part of
``pydoc_data.topics`` (the topics the models were not trained on,
runtime/ranks/model/weights/TRAINING.md), the text the draft accepts well; at
concurrency c the first c prompts of a rotation, each ``--max-tokens`` long.

Configurations, each its own deployment: ``off`` (no speculation);
``fixed-W`` for W in ``--widths`` (every decode round verifies W - 1 draft
tokens: ``--speculative-selection fixed``); ``adaptive`` (widths 2, 3, 4, plus
prefix-limit programs; the scheduler picks per round, every request's
acceptance estimates starting from the spec's 0.5^d prior);
``adaptive-preseeded`` (the same with ``--speculative-acceptance-prior``
a, a^2, a^3 from the draft's held-out greedy agreement a, ``--prior-agreement``,
0.703 in TRAINING.md: an offline figure, not one measured here).  For each
concurrency, ``--runs`` repetitions after one warm-up (which also lets the
scheduler measure its programs); the figure is the median of the runs' output
tokens/s (all requests' output tokens over the wall time from the first
submission to the last completion).  Acceptance: accepted draft tokens per
offered one in the speculative rounds (fixed widths; adaptive rounds' offers
vary, so it reports tokens per round lane instead).

Prints a table, then as the LAST line one JSON object with every figure,
including ``c{N}_off_tokens_per_s``, ``c{N}_best_fixed_tokens_per_s`` and
``c{N}_adaptive_tokens_per_s`` for each concurrency N, the goal checks
``c{N}_adaptive_vs_best_fixed`` (goal >= 0.97) and ``c1_adaptive_vs_off``
(goal >= 1.2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from runtime.ranks.model import default_model_dir
from runtime.speculation import SpeculationConfig

HELD_OUT = ("typesseq", "typesseq-mutable", "unary", "while", "with", "yield")


def held_out_prompts(tokenizer_dir: Path, tokens: int) -> list[list[int]]:
    """Paragraphs of the held-out topics, each cut to ``tokens`` tokens."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    prompts = []
    for key in HELD_OUT:
        for para in topics.get(key, "").split("\n\n"):
            ids = tok.encode(para.strip()).ids
            if len(ids) >= tokens:
                prompts.append(ids[:tokens])
    if not prompts:
        raise SystemExit("no held-out paragraph is long enough: lower --prompt-tokens")
    return prompts


class Run:
    """Output tokens and per-lane round bursts of one workload."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bursts: list[tuple[int, int]] = []  # (fence, tokens) per event

    def listener(self, stream, event) -> None:
        with self.lock:
            self.bursts.append((event.fence, len(event.token_ids)))


def workload(d: LocalDeployment, prompts, concurrency: int, max_tokens: int) -> dict:
    run = Run()
    chosen = [prompts[i % len(prompts)] for i in range(concurrency)]
    start = time.perf_counter()
    streams = [
        d.engine.submit(p, max_tokens, ignore_eos=True, listener=run.listener) for p in chosen
    ]
    tokens = sum(len(s.result(timeout=3600).token_ids) for s in streams)
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "bursts": run.bursts}


def acceptance(d: LocalDeployment, bursts: list[tuple[int, int]], width: int | None) -> dict:
    """Tokens per speculative round lane, and for a fixed width the acceptance."""
    graphs = {f.fence: f.graph for f in d.engine.stats.frames()}
    sizes = [n for fence, n in bursts if graphs.get(fence, "").startswith("speculative")]
    if not sizes:
        return {"tokens_per_round": 0.0, "acceptance": 0.0, "rounds": 0}
    per = statistics.fmean(sizes)
    out = {"tokens_per_round": per, "rounds": len(sizes)}
    if width:
        out["acceptance"] = (per - 1) / (width - 1)
    return out


def bench(name: str, spec: SpeculationConfig | None, args, prompts) -> dict:
    cfg = DeploymentConfig(
        tensor_parallel_size=args.tp, max_concurrency=max(args.concurrency),
        max_prefill_tokens=args.max_prefill_tokens, device=args.device,
        speculation=spec, startup_timeout_s=600,
    )  # fmt: skip
    width = spec.widest if spec is not None and spec.selection == "fixed" else None
    out: dict = {}
    with LocalDeployment(cfg) as d:
        for c in args.concurrency:
            workload(d, prompts, c, args.max_tokens)  # warm-up: programs measured
            rates, accept = [], []
            for _ in range(args.runs):
                r = workload(d, prompts, c, args.max_tokens)
                rates.append(r["tokens"] / r["wall_s"])
                accept.append(acceptance(d, r["bursts"], width))
            out[c] = {
                "tokens_per_s": statistics.median(rates),
                "runs": rates,
                "tokens_per_round": statistics.median(a["tokens_per_round"] for a in accept),
                "acceptance": statistics.median(a.get("acceptance", 0.0) for a in accept),
            }
            print(
                f"  {name:>9} c={c:<3} {out[c]['tokens_per_s']:8.1f} tok/s "
                f"(runs {', '.join(f'{x:.1f}' for x in rates)}), "
                f"{out[c]['tokens_per_round']:.2f} tokens per round lane",
                file=sys.stderr,
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--widths", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="adaptive: deepest")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--prior-agreement",
        type=float,
        default=0.703,
        help="the draft's held-out greedy agreement (TRAINING.md): adaptive-preseeded's prior",
    )
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-prefill-tokens", type=int, default=512)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--quick", action="store_true", help="1 run, 24 tokens, concurrency 1 and 8")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.max_tokens, args.concurrency = 1, 24, [1, 8]
    prompts = held_out_prompts(default_model_dir(), args.prompt_tokens)
    configs: dict[str, SpeculationConfig | None] = {"off": None}
    for w in args.widths:
        configs[f"fixed-{w}"] = SpeculationConfig(
            "draft", "default", num_speculative_tokens=w - 1, selection="fixed"
        )
    configs["adaptive"] = SpeculationConfig(
        "draft", "default", num_speculative_tokens=args.num_speculative_tokens
    )
    # The same, its acceptance prior preseeded from the draft's held-out greedy
    # agreement a (runtime/ranks/model/weights/TRAINING.md) as s_d = a^d.
    prior = tuple(args.prior_agreement**d for d in range(1, args.num_speculative_tokens + 1))
    configs["adaptive-preseeded"] = SpeculationConfig(
        "draft", "default", num_speculative_tokens=args.num_speculative_tokens,
        acceptance_prior=prior,
    )  # fmt: skip
    results = {}
    for name, spec in configs.items():
        if spec is not None and spec.draft_model == "default":
            from runtime.ranks.model import default_draft_dir

            spec = SpeculationConfig(**{**spec.__dict__, "draft_model": str(default_draft_dir())})
        results[name] = bench(name, spec, args, prompts)

    flat: dict = {"runs": args.runs, "max_tokens": args.max_tokens, "tp": args.tp}
    header = f"{'config':>10} " + " ".join(f"{'c=' + str(c):>22}" for c in args.concurrency)
    print(header)
    for name, per in results.items():
        cells = []
        for c in args.concurrency:
            r = per[c]
            flat[f"c{c}_{name.replace('-', '')}_tokens_per_s"] = round(r["tokens_per_s"], 2)
            if name != "off":
                flat[f"c{c}_{name.replace('-', '')}_tokens_per_round"] = round(
                    r["tokens_per_round"], 3
                )
            if name.startswith("fixed"):
                flat[f"c{c}_{name.replace('-', '')}_acceptance"] = round(r["acceptance"], 3)
            cells.append(f"{r['tokens_per_s']:9.1f} tok/s {r['tokens_per_round']:5.2f}/rd")
        print(f"{name:>10} " + " ".join(f"{cell:>22}" for cell in cells))
    for c in args.concurrency:
        fixed = {n: results[n][c]["tokens_per_s"] for n in results if n.startswith("fixed")}
        best = max(fixed, key=fixed.get)
        flat[f"c{c}_off_tokens_per_s"] = round(results["off"][c]["tokens_per_s"], 2)
        flat[f"c{c}_best_fixed"] = best
        flat[f"c{c}_best_fixed_tokens_per_s"] = round(fixed[best], 2)
        flat[f"c{c}_adaptive_tokens_per_s"] = round(results["adaptive"][c]["tokens_per_s"], 2)
        flat[f"c{c}_adaptive_preseeded_vs_best_fixed"] = round(
            results["adaptive-preseeded"][c]["tokens_per_s"] / fixed[best], 3
        )
        ratio = results["adaptive"][c]["tokens_per_s"] / fixed[best]
        flat[f"c{c}_adaptive_vs_best_fixed"] = round(ratio, 3)
        flat[f"c{c}_adaptive_vs_off"] = round(
            results["adaptive"][c]["tokens_per_s"] / results["off"][c]["tokens_per_s"], 3
        )
        print(
            f"c={c}: adaptive / best fixed ({best}) = {ratio:.3f} (goal >= 0.97); "
            f"adaptive / off = {flat[f'c{c}_adaptive_vs_off']:.3f}"
        )
    if 1 in args.concurrency:
        flat["goal_c1_adaptive_vs_off"] = flat["c1_adaptive_vs_off"] >= 1.2
    flat["goal_adaptive_vs_best_fixed"] = all(
        flat[f"c{c}_adaptive_vs_best_fixed"] >= 0.97 for c in args.concurrency
    )
    print(json.dumps(flat, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
