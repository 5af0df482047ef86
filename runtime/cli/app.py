"""``flare``: the top-level parser and its commands.

``flare run [MODEL_DIR]`` (``flare serve``) serves a model or, with ``--prompt``,
generates one completion (commands/run.py); ``flare bench`` load-tests an
OpenAI-compatible endpoint (commands/bench.py); ``flare trace summary|timeline
FILE`` reads a trace written by ``flare run --trace FILE`` (commands/trace.py);
``flare replay``, ``flare ranks status`` and ``flare keys`` help debug and secure
a deployment.
"""

from __future__ import annotations

import argparse
import sys

from runtime.cli.commands.keys import add_keys_command, cmd_keys
from runtime.cli.commands.ranks import add_ranks_command, cmd_ranks
from runtime.cli.commands.replay import add_replay_command, cmd_replay
from runtime.cli.commands.run import add_run_command, cmd_run
from runtime.cli.commands.trace import add_trace_command, cmd_trace
from runtime.cli.parsing import HelpFormatter, Parser

# The top-level --help (the module docstring is for readers of the code).
DESCRIPTION = (
    "flare: a tensor-parallel LLM serving runtime. `flare run` serves a model over an "
    "OpenAI-compatible HTTP API, or generates one completion with --prompt; `flare bench` "
    "load-tests a server."
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="flare",
        description=DESCRIPTION,
        epilog="`flare COMMAND --help` lists a command's flags.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, metavar="COMMAND", title="commands"
    )
    add_run_command(sub)
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    add_trace_command(sub, Parser, HelpFormatter)
    add_replay_command(sub, Parser, HelpFormatter)
    add_ranks_command(sub, Parser, HelpFormatter)
    add_keys_command(sub, Parser, HelpFormatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["bench"]:
        from runtime.cli.commands.bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command in ("run", "serve"):
        return cmd_run(args, parser, argv[1:])
    if args.command == "trace":
        return cmd_trace(args)
    if args.command == "replay":
        return cmd_replay(args)
    if args.command == "keys":
        return cmd_keys(args)
    if args.command == "ranks":
        return cmd_ranks(args)
    parser.error(f"unknown command {args.command!r}")
    return 2
