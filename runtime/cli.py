"""The ``flare`` command line.

``flare run`` serves a model directory (default: the embedded model, created
on first use, no download) over an OpenAI-compatible HTTP API: the frontend
(this process), the coordinator and N rank processes on this machine.  With
``--prompt`` it instead generates one completion in-process, prints it and the
run's figures, and exits.  ``flare bench`` drives an OpenAI-compatible endpoint
with a load generator (``runtime.loadgen``).

``--config FILE`` reads a TOML file: ``[scheduler]`` (a policy, as in
``configs/``) and ``[run]`` (any ``flare run`` flag by its long name, e.g.
``max-concurrency = 16``); flags given on the command line win.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from runtime.coordinator.config import PRESETS, ConfigError, PolicyConfig
from runtime.local import DeploymentConfig, LocalDeployment
from runtime.transport.schema import SamplingParams

# Flags of features that later issues build: refused rather than ignored.
NOT_YET = {
    "mtp_adaptive_verification_alpha": "speculative decoding",
    "speculative_token_capacity": "speculative programs",
}


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


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be an integer, got {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"--port must lie in 1..65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flare", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="serve a model over HTTP (or generate once with --prompt)")
    run.add_argument("--config", help="TOML file with [scheduler] and [run] tables")
    run.add_argument("--model", help="Hugging Face style model directory (default: embedded)")
    run.add_argument(
        "--served-model-name", help="the model id of the API (default: directory name)"
    )
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
    run.add_argument("--scheduler-policy", choices=sorted(PRESETS), default=None,
                     help="balanced (default) or throughput")  # fmt: skip
    run.add_argument("--scheduler-terminal-value", type=float)
    run.add_argument("--scheduler-terminal-age-price", type=float)
    run.add_argument("--mtp-adaptive-verification-alpha", type=float,
                     help="not available yet: needs speculative decoding")  # fmt: skip
    run.add_argument("--speculative-token-capacity", type=int,
                     help="not available yet: needs speculative programs")  # fmt: skip
    run.add_argument("--mixed-prefill", action="store_true",
                     help="also capture mixed prefill/decode programs (one prompt chunk "
                     "beside decode rows in one forward)")  # fmt: skip
    run.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default loopback)")
    run.add_argument("--port", type=_port, default=8000)
    run.add_argument("--api-key", default=os.environ.get("FLARE_API_KEY"),
                     help="require this bearer key on every route but /health")  # fmt: skip
    run.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    run.add_argument("--prompt", help="generate one completion for this text, then exit")
    run.add_argument("--max-tokens", type=_positive("--max-tokens"), default=32)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=-1)
    run.add_argument("--seed", type=int, default=0)
    # Set by the frontend for its coordinator process (python -m runtime.coordinator).
    run.add_argument("--api-requests", help=argparse.SUPPRESS)
    run.add_argument("--api-outputs", help=argparse.SUPPRESS)
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _explicit(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the run flags given on the command line."""
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    given = set()
    for action in run._actions:
        for option in action.option_strings:
            if any(arg == option or arg.startswith(option + "=") for arg in argv):
                given.add(action.dest)
    return given


def _apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser, argv) -> dict:
    """Fill flags not given on the command line from ``--config``'s [run]; its data."""
    if not args.config:
        return {}
    try:
        with open(args.config, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        parser.error(f"--config {args.config}: {exc}")
    unknown = set(data) - {"run", "scheduler"}
    if unknown:
        parser.error(f"--config {args.config}: unknown table(s) {sorted(unknown)}")
    run_parser = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    actions = {a.dest: a for a in run_parser._actions if a.option_strings}
    given = _explicit(parser, argv)
    for key, value in data.get("run", {}).items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None or dest in ("config", "api_requests", "api_outputs", "help"):
            parser.error(f"--config {args.config}: unknown [run] key {key!r}")
        if dest in given:
            continue
        try:
            if action.type is not None:
                value = action.type(str(value))
            elif action.choices is not None and value not in action.choices:
                raise argparse.ArgumentTypeError(f"must be one of {sorted(action.choices)}")
            elif action.nargs == 0 and not isinstance(value, bool):  # a switch
                raise argparse.ArgumentTypeError(f"must be true or false, got {value!r}")
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"--config {args.config}: [run] {key}: {exc}")
        setattr(args, dest, value)
    return data


def _policy(args: argparse.Namespace, parser: argparse.ArgumentParser, data: dict) -> PolicyConfig:
    terminal = {
        "terminal_value": args.scheduler_terminal_value,
        "terminal_age_price": args.scheduler_terminal_age_price,
    }
    terminal = {k: v for k, v in terminal.items() if v is not None}
    try:
        if args.scheduler_policy is None and "scheduler" in data:
            base = PolicyConfig.from_toml(args.config)
            return dataclasses.replace(base, **terminal)  # validates again
        return PolicyConfig.preset(args.scheduler_policy or "balanced", **terminal)
    except (ConfigError, TypeError) as exc:
        parser.error(f"--scheduler-* / --config: {exc}")
        raise  # unreachable


def deployment_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> DeploymentConfig:
    """The deployment ``flare run`` asks for; fails fast naming the bad flag."""
    data = _apply_config_file(args, parser, argv or [])
    for dest, feature in NOT_YET.items():
        if getattr(args, dest) is not None:
            flag = "--" + dest.replace("_", "-")
            parser.error(f"{flag}: {feature} are not available in this build yet")
    policy = _policy(args, parser, data)
    if not 0 < args.startup_timeout < float("inf"):
        parser.error("--startup-timeout must be a finite number of seconds > 0")
    from runtime.ranks.model import default_model_dir

    model_dir = args.model or str(default_model_dir())
    if not os.path.isdir(model_dir):
        parser.error(f"--model {model_dir}: not a directory")
    if args.max_model_len is not None:
        from runtime.ranks.model.config import ModelConfig

        try:
            limit = ModelConfig.from_dir(model_dir).max_position_embeddings
        except (OSError, ValueError) as exc:
            parser.error(f"--model {model_dir}: {exc}")
        if args.max_model_len > limit:
            parser.error(f"--max-model-len {args.max_model_len} exceeds the model's {limit}")
    try:
        return DeploymentConfig(
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
            mixed_prefill=bool(args.mixed_prefill),
            startup_timeout_s=args.startup_timeout,
        )
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable


def _sampling(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SamplingParams:
    try:
        return SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as exc:
        parser.error(f"sampling flags: {exc}")
        raise  # unreachable


def generate_once(args: argparse.Namespace, config: DeploymentConfig, sampling) -> int:
    """``--prompt``: one completion in this process, printed with the run's figures."""
    from runtime.ranks.model import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        print("flare: --prompt encodes to no tokens", file=sys.stderr)
        return 2
    started = time.monotonic()
    with LocalDeployment(config) as deployment:
        engine = deployment.engine
        facts = engine.facts
        print(
            f"serving {facts.model_name} with TP={config.tensor_parallel_size}, "
            f"{len(facts.descriptors)} prepared programs, coordinator at "
            f"{engine.endpoints.frames} (ready in {time.monotonic() - started:.1f} s)",
            file=sys.stderr,
        )
        t0 = time.monotonic()
        stream = engine.submit(ids, args.max_tokens, sampling)
        out: list[int] = []
        for event in stream:
            out += event.token_ids
        seconds = time.monotonic() - t0
        print(args.prompt + tokenizer.decode(out))
        print(
            f"[{len(ids)} prompt + {len(out)} generated tokens in {seconds * 1e3:.0f} ms, "
            f"finish: {stream.finish_reason}]",
            file=sys.stderr,
        )
        summary = engine.stats.summary()
    print(json.dumps({k: summary[k] for k in sorted(summary)}), file=sys.stderr)
    return 0


def _without_secrets(argv: list[str]) -> tuple[str, ...]:
    """``argv`` minus ``--api-key``: the coordinator does not need it, and a child's
    command line is visible to every local user."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--api-key":
            skip = True
        elif not arg.startswith("--api-key="):
            out.append(arg)
    return tuple(out)


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    config = deployment_config(args, parser, argv)
    sampling = _sampling(args, parser)
    if args.prompt is not None:
        return generate_once(args, config, sampling)
    from runtime.frontend.serve import ServeOptions, serve

    return serve(
        ServeOptions(
            model_dir=config.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            startup_timeout_s=args.startup_timeout,
            coordinator_args=_without_secrets(argv),
        )
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["bench"]:
        from runtime.loadgen.cli import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "run":
        return cmd_run(args, parser, argv[1:])
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
