"""``flare replay DIR``: replay a frame recording (``flare run --record-frames
DIR``) on rank processes, without a coordinator (:mod:`runtime.replay`)."""

from __future__ import annotations

import argparse

from runtime.replay import ReplayError, replay


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
