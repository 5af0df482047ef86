"""The deployment flags of ``flare run``: tensor parallelism, devices, start-up
and hang limits, and where the ranks come from: this machine (the default) or
``--ranks external``, ranks launched elsewhere with ``torchrun`` that connect to
the coordinator over TCP (:class:`runtime.deploy.external.ExternalRanks`,
docs/deploy.md).  The liveness and start-up agreement flags of this family are
flags/liveness.py's and flags/identity.py's."""

from __future__ import annotations

import argparse

from runtime.cli.converters import (
    DEVICE_CHOICES,
    bind_port,
    device,
    expected_positive_seconds,
    int_in,
    positive_float,
)
from runtime.cli.flags.families import flag_group
from runtime.deploy.external import (
    DEFAULT_COMPLETIONS_PORT,
    DEFAULT_EXTERNAL_HANDSHAKE_S,
    DEFAULT_FRAMES_PORT,
    DEFAULT_HEARTBEAT_PORT,
    ExternalRanks,
)


def add_deployment_flags(run: argparse.ArgumentParser) -> None:
    """Ranks, devices, the start-up timeout and the ranks' hung-frame limits."""
    deployment = flag_group(run, "deployment")
    deployment.add_argument(
        "-tp",
        "--tensor-parallel-size",
        metavar="N",
        type=int_in(1, 64),
        default=1,
        help="ranks, one per device",
    )
    deployment.add_argument(
        "--device",
        metavar="{" + ",".join(DEVICE_CHOICES) + "}",
        type=device,
        default="auto",
        help="auto is cuda when available; cuda runs rank r on cuda:r, cuda:N on cuda:N+r",
    )
    deployment.add_argument(
        "--startup-timeout",
        metavar="SECONDS",
        type=positive_float,
        default=600.0,
        help="how long the ranks may take to load, prepare their programs and report",
    )
    deployment.add_argument(
        "--frame-timeout-multiple",
        metavar="X",
        type=positive_float,
        default=20.0,
        help="a rank reports a hung frame after X times its expected duration "
        "+ --frame-timeout-margin",
    )
    deployment.add_argument(
        "--frame-timeout-margin",
        metavar="SECONDS",
        type=positive_float,
        default=60.0,
        help="seconds added to every frame's hang deadline",
    )


def add_external_flags(run: argparse.ArgumentParser) -> None:
    """``--ranks external`` and its settings (docs/deploy.md)."""
    group = flag_group(run, "deployment")  # every flag below
    group.add_argument(
        "--ranks",
        choices=["local", "external"],
        default="local",
        help="local: start the ranks on this machine; external: bind TCP and wait for "
        "--world-size ranks launched elsewhere (`torchrun ... -m runtime.ranks`)",
    )
    group.add_argument(
        "--world-size",
        metavar="N",
        type=int,
        default=None,
        help="--ranks external: the number of ranks that must connect (default: "
        "--tensor-parallel-size; the two must agree)",
    )
    group.add_argument(
        "--bind-host",
        metavar="HOST",
        default="127.0.0.1",
        help="--ranks external: the address the frames, completions and heartbeat ports "
        "bind (a non-loopback address needs --allow-remote)",
    )
    group.add_argument(
        "--frames-port",
        metavar="PORT",
        type=bind_port,
        default=DEFAULT_FRAMES_PORT,
        help="--ranks external: the port ranks receive frames from",
    )
    group.add_argument(
        "--completions-port",
        metavar="PORT",
        type=bind_port,
        default=DEFAULT_COMPLETIONS_PORT,
        help="--ranks external: the port ranks send completions to",
    )
    group.add_argument(
        "--heartbeat-port",
        metavar="PORT",
        type=bind_port,
        default=DEFAULT_HEARTBEAT_PORT,
        help="--ranks external: the port of the heartbeats, both ways",
    )
    group.add_argument(
        "--allow-remote",
        action="store_true",
        help="--ranks external: allow --bind-host to be an address other hosts reach",
    )
    group.add_argument(
        "--handshake-timeout",
        metavar="SECONDS",
        type=expected_positive_seconds,
        default=DEFAULT_EXTERNAL_HANDSHAKE_S,
        help="--ranks external: how long to wait for every rank to load its shard, "
        "prepare its programs and connect (--log-level info logs the progress)",
    )


EXTERNAL_ONLY = (
    "world_size",
    "bind_host",
    "frames_port",
    "completions_port",
    "heartbeat_port",
    "allow_remote",
    "handshake_timeout",
)


def external_ranks(
    args: argparse.Namespace, parser: argparse.ArgumentParser, explicit: set[str]
) -> ExternalRanks | None:
    """The ``--ranks external`` settings, or None for local ranks; ``parser.error``
    naming the flag when they do not fit.  ``explicit``: the flags given."""
    if args.ranks != "external":
        stray = [name for name in EXTERNAL_ONLY if name in explicit]
        if stray:
            flag = "--" + stray[0].replace("_", "-")
            parser.error(f"{flag} applies to --ranks external only")
        return None
    tp = args.tensor_parallel_size
    world = args.world_size
    if world is None:
        world = tp
    elif "tensor_parallel_size" in explicit and world != tp:
        parser.error(
            f"--world-size {world} disagrees with --tensor-parallel-size {tp}: every rank "
            "holds one tensor-parallel shard"
        )
    if getattr(args, "prompt", None) is not None:
        parser.error("--prompt runs ranks on this machine; drop it with --ranks external")
    try:
        return ExternalRanks(
            world_size=world,
            bind_host=args.bind_host,
            frames_port=args.frames_port,
            completions_port=args.completions_port,
            heartbeat_port=args.heartbeat_port,
            allow_remote=bool(args.allow_remote),
            handshake_timeout_s=args.handshake_timeout,
        )
    except ValueError as exc:
        parser.error(_flag_message(str(exc)))
        raise  # unreachable


def _flag_message(text: str) -> str:
    """A config error in flag words: ``bind_host ...`` -> ``--bind-host ...``."""
    replacements = {
        "allow_remote=True": "--allow-remote",
        "handshake_timeout_s": "--handshake-timeout",
        "frames_port": "--frames-port",
        "completions_port": "--completions-port",
        "heartbeat_port": "--heartbeat-port",
        "world_size": "--world-size",
        "bind_host": "--bind-host",
    }
    for name, flag in replacements.items():
        text = text.replace(name, flag)
    return text
