"""Command line: ``python -m scripts.scheduling_sim [options]``.

Prints a readable report; the last line is one JSON object with every figure.

Speculation: ``--speculative-widths 2,4,8`` adds rectangular speculative
programs (D = W - 1) at every decode batch; ``--acceptance`` labels the
requests (high 0.9, low 0.1, drifting 0.9 -> 0.1 per draft; mixed: one third
each); ``--proposer copy`` makes the programs cost no draft passes;
``--fixed-speculative-width W`` fixes flare's width (0: adaptive) or sets the
``fixed-width`` baseline's.  E.g.

    python -m scripts.scheduling_sim --requests 48 --output-len 256 \
        --speculative-widths 2,4,8 --acceptance mixed
    python -m scripts.scheduling_sim --scheduler table --speculative-widths 2,4

What-if replay (docs/replay.md): ``--from-trace FILE`` replays a recorded
deployment's traffic (a ``flare run --trace`` file) on its own measured costs
and host under ``--scheduler`` (default flare) and ``--policy`` (default: the
recorded one); ``--host-model`` timeline (default), mean or none.  The
workload, profile and catalog options do not apply to it.  It prints the
recorded and replayed figures side by side, then the JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from runtime.coordinator.config import PRESETS
from runtime.trace.files import TraceFileError
from scripts.scheduling_sim.catalogs import PROFILES, PROPOSERS
from scripts.scheduling_sim.metrics import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
from scripts.scheduling_sim.replay import HOST_MODELS, CostError, RecordingError, render, replay
from scripts.scheduling_sim.runner import (
    PREFILL_BUCKETS,
    SCHEDULERS,
    SPECULATIVE_SCHEDULERS,
    RunConfig,
    simulate,
)
from scripts.scheduling_sim.workload import (
    ACCEPTANCE_CHOICES,
    DEFAULT_ACCEPTANCE,
    Arrival,
    WorkloadConfig,
    make_workload,
)


def _pair(text: str) -> tuple[int, int]:
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-trace", metavar="FILE", help="replay a recorded deployment's trace")
    p.add_argument(
        "--host-model",
        choices=list(HOST_MODELS),
        default="timeline",
        help="--from-trace: the host around the device (timeline: as recorded, moment by "
        "moment; mean: its averages; none: the simulator's)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.scheduling_sim", description=__doc__)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", choices=sorted(PROFILES), default="llama1b-h100")
    p.add_argument(
        "--scheduler",
        choices=[*SCHEDULERS, *SPECULATIVE_SCHEDULERS],
        default="flare",
        help="the production scheduler, or a baseline over the same catalog and slots "
        "(fixed-width, table, global-adaptive: speculative decoding rules)",
    )
    p.add_argument(
        "--mixed-prefill",
        action="store_true",
        help="add the mixed prefill/decode shapes (mixed_shapes) to the catalog",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="baselines' token budget (default: vllm/vtc 8192, sarathi 512, sglang 8192)",
    )
    p.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="sglang: running decoders ride along in prefill batches",
    )
    p.add_argument("--goodput-ttft-ms", type=float, default=DEFAULT_TTFT_SLO_MS)
    p.add_argument("--goodput-tpot-ms", type=float, default=DEFAULT_TPOT_SLO_MS)
    p.add_argument(
        "--scheduler-policy",
        "--policy",
        dest="scheduler_policy",
        choices=sorted(PRESETS),
        default=None,
        help="the policy preset (default: balanced; with --from-trace, the recorded policy)",
    )
    _replay_arguments(p)
    p.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals per second (0: all at t=0)",
    )
    p.add_argument("--prompt-len", type=_pair, default=(64, 64), help="N or LO:HI")
    p.add_argument("--output-len", type=_pair, default=(128, 128), help="N or LO:HI")
    p.add_argument("--messages", type=_pair, default=(1, 1), help="messages per prompt")
    p.add_argument("--prefill-buckets", type=_ints, default=PREFILL_BUCKETS)
    p.add_argument(
        "--decode-batches",
        type=_ints,
        default=None,
        help="default: powers of two through the padded --max-slots, as the ranks capture",
    )
    p.add_argument(
        "--speculative-widths",
        type=_ints,
        default=(),
        help="widths W of the speculative programs (D = W - 1), e.g. 2,4,8 (default: none)",
    )
    p.add_argument(
        "--proposer",
        choices=list(PROPOSERS),
        default="draft",
        help="proposal source: draft (learned, D draft passes) or copy (no draft cost)",
    )
    p.add_argument(
        "--acceptance",
        choices=list(ACCEPTANCE_CHOICES),
        default=DEFAULT_ACCEPTANCE,
        help="per-draft acceptance: high 0.9, low 0.1, drifting 0.9 -> 0.1 along the "
        "output, mixed one third each",
    )
    p.add_argument(
        "--fixed-speculative-width",
        type=int,
        default=0,
        help="flare: 0 adaptive, W fixed width (1: ordinary decode); the fixed-width "
        "baseline's width",
    )
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--jitter", type=float, default=0.0, help="uniform relative cost noise")
    p.add_argument("--max-seconds", type=float, default=600.0, help="simulated time limit")
    p.add_argument("--trace", help="write the plan trace as JSON lines to this file")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be >= 1")
    if not 0.0 <= args.jitter < 1.0:
        p.error("--jitter must be in [0, 1)")
    if args.tp < 1:
        p.error("--tp must be >= 1")
    if not 1 <= args.max_slots <= 64:
        p.error("--max-slots must lie in 1..64")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        p.error("--max-num-batched-tokens must be >= 1")
    if args.enable_mixed_chunk and args.scheduler != "sglang":
        p.error("--enable-mixed-chunk is an sglang option")
    if any(w < 1 for w in args.speculative_widths):
        p.error("--speculative-widths must be >= 1")
    if not 0 <= args.fixed_speculative_width <= 64:
        p.error("--fixed-speculative-width must lie in 0..64")
    if args.scheduler == "fixed-width" and args.fixed_speculative_width < 1:
        p.error("--scheduler fixed-width needs --fixed-speculative-width >= 1")
    if args.fixed_speculative_width and args.scheduler not in ("flare", "fixed-width"):
        p.error("--fixed-speculative-width applies to flare and fixed-width")
    return args


def config_from_args(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        scheduler=args.scheduler,
        profile=args.profile,
        policy=args.scheduler_policy or "balanced",
        mixed_prefill=args.mixed_prefill,
        max_slots=args.max_slots,
        prefill_buckets=args.prefill_buckets,
        decode_batches=args.decode_batches,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_mixed_chunk=args.enable_mixed_chunk,
        ttft_slo_ms=args.goodput_ttft_ms,
        tpot_slo_ms=args.goodput_tpot_ms,
        tp=args.tp,
        jitter=args.jitter,
        seed=args.seed,
        max_seconds=args.max_seconds,
        speculative_widths=args.speculative_widths,
        proposer=args.proposer,
        fixed_speculative_width=args.fixed_speculative_width,
    )


def workload_from_args(args: argparse.Namespace) -> list[Arrival]:
    return make_workload(
        WorkloadConfig(
            requests=args.requests,
            arrival_rate_per_s=args.arrival_rate,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            messages=args.messages,
            seed=args.seed,
            acceptance=args.acceptance,
        )
    )


def run(args: argparse.Namespace) -> dict:
    cfg = config_from_args(args)
    workload = workload_from_args(args)
    report, sim = simulate(cfg, workload)
    if args.trace:
        with open(args.trace, "w", encoding="utf-8") as fh:
            for record in sim.trace:
                fh.write(json.dumps(record) + "\n")
        report["trace_records"] = len(sim.trace)
    return report


def replay_main(args: argparse.Namespace) -> int:
    """``--from-trace``: the replay's table, then its JSON object (2: the trace cannot
    be replayed, the reason on stderr)."""
    try:
        report = replay(
            args.from_trace, args.scheduler, args.scheduler_policy, args.host_model,
            seed=args.seed, ttft_slo_ms=args.goodput_ttft_ms, tpot_slo_ms=args.goodput_tpot_ms,
        )  # fmt: skip
    except (RecordingError, TraceFileError, CostError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(report))
    print(json.dumps(report, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_trace:
        return replay_main(args)
    report = run(args)
    width = max(len(k) for k in report)
    for key, value in report.items():
        if key != "frames_by_graph":
            print(f"{key:<{width}}  {value}")
    print("frames by graph:")
    for name, count in report["frames_by_graph"].items():
        print(f"  {name:<24} {count}")
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
