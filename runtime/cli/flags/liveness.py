"""Liveness and hang-detection flags of ``flare run`` (and the heartbeat flags of
``python -m runtime.ranks``), in the deployment family.

* ``--heartbeat-interval`` / ``--heartbeat-timeout``: heartbeats both ways
  between the coordinator and every rank (runtime/transport/liveness.py).  A
  rank that hears nothing from the coordinator for the timeout exits; the
  coordinator fails its requests and exits non-zero when a rank falls silent
  (counted from the later of its last heartbeat and the in-flight frame's
  expected end) or, on this machine, when its process exits.
* ``--frame-watchdog-multiple`` / ``--frame-watchdog-margin`` /
  ``--frame-watchdog-floor``: the coordinator's per-frame watchdog
  (``EngineConfig.frame_watchdog_*``): a frame unanswered for multiple x its
  expected duration + margin (for a program whose cost is still unknown:
  max(floor, margin)) fails the deployment, naming the ranks and the fence.
  The defaults are looser than the ranks' own ``--frame-timeout-*``, so a hung
  rank's report, which says where it is stuck, normally arrives first.
"""

from __future__ import annotations

import argparse
import os

from runtime.cli.converters import expected_positive_float
from runtime.cli.flags.families import flag_group
from runtime.coordinator.engine.config import (
    DEFAULT_WATCHDOG_FLOOR_S,
    DEFAULT_WATCHDOG_MARGIN_S,
    DEFAULT_WATCHDOG_MULTIPLE,
)
from runtime.transport.liveness import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S

HEARTBEAT_ENDPOINT_ENV = "FLARE_HEARTBEAT_ENDPOINT"


def add_heartbeat_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--heartbeat-interval`` and ``--heartbeat-timeout`` (dests ``heartbeat_interval``,
    ``heartbeat_timeout``), on ``flare run`` and on ``python -m runtime.ranks``."""
    parser.add_argument(
        "--heartbeat-interval",
        metavar="SECONDS",
        type=expected_positive_float,
        default=HEARTBEAT_INTERVAL_S,
        help="seconds between heartbeats, coordinator to ranks and back",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        metavar="SECONDS",
        type=expected_positive_float,
        default=HEARTBEAT_TIMEOUT_S,
        help="a peer silent this long is gone: a rank exits, the coordinator fails its "
        "requests and exits non-zero (must exceed --heartbeat-interval)",
    )


def add_heartbeat_endpoint_flag(parser: argparse.ArgumentParser) -> None:
    """``--heartbeat-endpoint`` of ``python -m runtime.ranks`` (env FLARE_HEARTBEAT_ENDPOINT)."""
    parser.add_argument(
        "--heartbeat-endpoint",
        default=os.environ.get(HEARTBEAT_ENDPOINT_ENV),
        help="the coordinator's heartbeat endpoint (env FLARE_HEARTBEAT_ENDPOINT); without "
        "it this rank cannot notice a coordinator that is gone",
    )


def check_heartbeat_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.heartbeat_timeout <= args.heartbeat_interval:
        parser.error(
            f"--heartbeat-timeout ({args.heartbeat_timeout:g} s) must exceed "
            f"--heartbeat-interval ({args.heartbeat_interval:g} s)"
        )


def add_liveness_flags(run: argparse.ArgumentParser) -> None:
    # Heartbeats both ways and the coordinator's per-frame watchdog (docs/runtime.md).
    group = flag_group(run, "deployment")  # every flag below
    add_heartbeat_flags(group)
    group.add_argument(
        "--frame-watchdog-multiple",
        metavar="X",
        type=expected_positive_float,
        default=DEFAULT_WATCHDOG_MULTIPLE,
        help="the coordinator fails a frame unanswered for X times its expected duration "
        "+ --frame-watchdog-margin",
    )
    group.add_argument(
        "--frame-watchdog-margin",
        metavar="SECONDS",
        type=expected_positive_float,
        default=DEFAULT_WATCHDOG_MARGIN_S,
        help="seconds added to every frame's watchdog limit",
    )
    group.add_argument(
        "--frame-watchdog-floor",
        metavar="SECONDS",
        type=expected_positive_float,
        default=DEFAULT_WATCHDOG_FLOOR_S,
        help="the watchdog limit, in seconds, of a frame whose program's cost is still unknown "
        "(at least the margin)",
    )


def liveness_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> dict[str, float]:
    """The DeploymentConfig fields of these flags; with ``parser``, a bad
    combination fails there naming the flags."""
    if parser is not None:
        check_heartbeat_args(args, parser)
    return {
        "heartbeat_interval_s": args.heartbeat_interval,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "frame_watchdog_multiple": args.frame_watchdog_multiple,
        "frame_watchdog_margin_s": args.frame_watchdog_margin,
        "frame_watchdog_floor_s": args.frame_watchdog_floor,
    }
