"""The rank-level debugging flags of ``flare run`` and the ``flare replay`` command
(kept beside runtime/cli.py, which only wires them)."""

from __future__ import annotations

import argparse

from runtime.replay import ReplayError, replay

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_debug_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--check-ranks",
        action="store_true",
        help="every rank reports a CRC of its sampled tokens per frame; a rank that "
        "disagrees fails the server, naming the rank and the fence",
    )
    run.add_argument(
        "--record-frames",
        metavar="DIR",
        default=None,
        help="record every frame from start-up, with rank 0's answers, for `flare replay DIR` "
        "(DIR is created 0700, its files 0600: they hold prompts; default: off)",
    )
    run.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="the rank processes' log level"
    )
    run.add_argument(
        "--log-dir",
        metavar="DIR",
        default=None,
        help="also one log file per rank in DIR (0600; default: stderr only)",
    )


def debug_config(args: argparse.Namespace) -> dict[str, object]:
    """The DeploymentConfig fields of the debugging flags."""
    return {
        "check_ranks": bool(args.check_ranks),
        "record_frames": args.record_frames,
        "log_level": args.log_level,
        "log_dir": args.log_dir,
    }


def add_replay_command(sub, parser_class, formatter_class) -> None:
    replay_parser = sub.add_parser(
        "replay",
        help="replay a frame recording on rank processes, without a coordinator",
        description="Replay the frames `flare run --record-frames DIR` recorded, on the "
        "recorded ranks (or another tensor-parallel size), printing each frame's interval "
        "and tokens and the first divergence from the recording.",
        formatter_class=formatter_class,
    )
    replay_parser.add_argument("directory", metavar="DIR")
    replay_parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=None,
        help="replay at this TP size (a difference is then a numeric divergence)",
    )  # fmt: skip
    replay_parser.add_argument(
        "--rank", type=int, default=None, help="print this rank's intervals (default 0)"
    )


def cmd_replay(args: argparse.Namespace) -> int:
    """0: equal (or only numeric divergence at another TP size); 1: diverged; 2: failed."""
    try:
        report = replay(args.directory, tensor_parallel_size=args.tensor_parallel_size,
                        rank=args.rank)  # fmt: skip
    except (ReplayError, ValueError, OSError) as exc:
        print(f"flare replay: {exc}")
        return 2
    return 0 if report.ok else 1
