"""The ``flare`` command line.

``flare run`` starts the coordinator and N rank processes on this machine for a
model directory (default: the embedded model, created on first use, no
download).  With ``--prompt`` it generates one completion, prints it and the
run's figures, and exits; without, it reads one prompt per line from standard
input until end of input.  The OpenAI-compatible HTTP frontend comes with the
serving issue.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from runtime.coordinator.config import PRESETS, ConfigError, PolicyConfig
from runtime.local import DeploymentConfig, LocalDeployment
from runtime.transport.schema import SamplingParams


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flare", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start the coordinator and ranks on this machine")
    run.add_argument("--model", help="Hugging Face style model directory (default: embedded)")
    run.add_argument("--tensor-parallel-size", type=_positive("--tensor-parallel-size"), default=1)
    run.add_argument("--max-concurrency", type=_positive("--max-concurrency"), default=8)
    run.add_argument("--max-prefill-tokens", type=_positive("--max-prefill-tokens"), default=512)
    run.add_argument("--num-pages", type=_positive("--num-pages"), default=1024)
    run.add_argument("--page-size", type=_positive("--page-size"), default=16)
    run.add_argument(
        "--max-model-len",
        type=_positive("--max-model-len"),
        help="context limit (default: the model's max_position_embeddings)",
    )
    run.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    run.add_argument("--no-cuda-graphs", action="store_true")
    run.add_argument("--scheduler-policy", choices=sorted(PRESETS), default="balanced")
    run.add_argument("--scheduler-terminal-value", type=float)
    run.add_argument("--scheduler-terminal-age-price", type=float)
    run.add_argument("--prompt", help="generate one completion for this text, then exit")
    run.add_argument("--max-tokens", type=_positive("--max-tokens"), default=32)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=-1)
    run.add_argument("--seed", type=int, default=0)
    return parser


def _sampling(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SamplingParams:
    try:
        return SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as exc:
        parser.error(f"sampling flags: {exc}")
        raise  # unreachable


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.ranks.model import default_model_dir, load_tokenizer

    try:
        policy = PolicyConfig.preset(
            args.scheduler_policy,
            terminal_value=args.scheduler_terminal_value,
            terminal_age_price=args.scheduler_terminal_age_price,
        )
    except ConfigError as exc:
        parser.error(f"--scheduler-*: {exc}")
    sampling = _sampling(args, parser)
    model_dir = args.model or str(default_model_dir())
    tokenizer = load_tokenizer(model_dir)
    config = DeploymentConfig(
        model=model_dir,
        tensor_parallel_size=args.tensor_parallel_size,
        max_concurrency=args.max_concurrency,
        max_prefill_tokens=args.max_prefill_tokens,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_model_len=args.max_model_len,
        device=args.device,
        policy=policy,
        cuda_graphs=not args.no_cuda_graphs,
    )
    started = time.monotonic()
    with LocalDeployment(config) as deployment:
        engine = deployment.engine
        facts = engine.facts
        print(
            f"serving {facts.model_name} with TP={args.tensor_parallel_size}, "
            f"{len(facts.descriptors)} prepared programs, coordinator at "
            f"{engine.endpoints.frames} (ready in {time.monotonic() - started:.1f} s)",
            file=sys.stderr,
        )
        prompts = (
            [args.prompt] if args.prompt is not None else (line.rstrip("\n") for line in sys.stdin)
        )
        for text in prompts:
            ids = tokenizer.encode(text).ids
            if not ids:
                print("(empty prompt skipped)", file=sys.stderr)
                continue
            t0 = time.monotonic()
            stream = engine.submit(ids, args.max_tokens, sampling)
            out: list[int] = []
            for event in stream:
                out += event.token_ids
            seconds = time.monotonic() - t0
            print(text + tokenizer.decode(out))
            print(
                f"[{len(ids)} prompt + {len(out)} generated tokens in {seconds * 1e3:.0f} ms, "
                f"finish: {stream.finish_reason}]",
                file=sys.stderr,
            )
        summary = engine.stats.summary()
    print(json.dumps({k: summary[k] for k in sorted(summary)}), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return cmd_run(args, parser)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
