"""Where the ranks of ``flare run`` come from: this machine (the default) or
``--ranks external``, ranks launched elsewhere with ``torchrun`` that connect to
the coordinator over TCP (docs/deploy.md).  Kept beside runtime/cli.py, which
only wires these flags."""

from __future__ import annotations

import argparse
import ipaddress
import math
from dataclasses import dataclass

# Fixed defaults, so firewall rules and the ranks' command lines can be written
# down before the coordinator starts (docs/deploy.md).
DEFAULT_FRAMES_PORT = 29600
DEFAULT_COMPLETIONS_PORT = 29601
DEFAULT_HEARTBEAT_PORT = 29602
# Ranks load and shard the weights and prepare their programs before they
# connect: a 70B checkpoint from network storage takes many minutes.
DEFAULT_EXTERNAL_HANDSHAKE_S = 1800.0


@dataclass(frozen=True)
class ExternalRanks:
    """``flare run --ranks external``: bind TCP on ``bind_host`` and wait up to
    ``handshake_timeout_s`` for ``world_size`` ranks started elsewhere."""

    world_size: int
    bind_host: str = "127.0.0.1"
    frames_port: int = DEFAULT_FRAMES_PORT
    completions_port: int = DEFAULT_COMPLETIONS_PORT
    heartbeat_port: int = DEFAULT_HEARTBEAT_PORT
    allow_remote: bool = False
    handshake_timeout_s: float = DEFAULT_EXTERNAL_HANDSHAKE_S

    def __post_init__(self) -> None:
        if type(self.world_size) is not int or not 1 <= self.world_size <= 64:
            raise ValueError(f"world_size must lie in 1..64, got {self.world_size!r}")
        ports = {
            "frames_port": self.frames_port,
            "completions_port": self.completions_port,
            "heartbeat_port": self.heartbeat_port,
        }
        for name, port in ports.items():
            if type(port) is not int or not 0 <= port <= 65535:
                raise ValueError(f"{name} must lie in 0..65535, got {port!r}")
        fixed = [port for port in ports.values() if port]
        if len(set(fixed)) != len(fixed):
            raise ValueError(f"frames, completions and heartbeat ports must differ, got {ports}")
        timeout = self.handshake_timeout_s
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"handshake_timeout_s must be a finite number > 0, got {timeout!r}")
        host = bind_address(self.bind_host)
        if not host.is_loopback and not self.allow_remote:
            raise ValueError(
                f"bind_host {self.bind_host} is not a loopback address: ranks on other hosts "
                "could connect; pass allow_remote=True to mean it"
            )

    def endpoint(self, port: int) -> str:
        """``tcp://HOST:PORT`` for the coordinator to bind."""
        host = str(bind_address(self.bind_host))
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def bind_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` as an IP address (``localhost`` is 127.0.0.1, ``*`` or ``0.0.0.0`` all IPv4
    interfaces); ValueError naming it otherwise (ZeroMQ binds addresses, not names)."""
    text = {"localhost": "127.0.0.1", "*": "0.0.0.0", "": "0.0.0.0"}.get(host, host)
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        raise ValueError(f"bind_host must be an IP address (or localhost), got {host!r}") from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port lies in 0..65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text}")
    return value


def add_deploy_flags(run: argparse.ArgumentParser) -> None:
    from runtime.cli_groups import flag_group

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
        type=_port,
        default=DEFAULT_FRAMES_PORT,
        help="--ranks external: the port ranks receive frames from",
    )
    group.add_argument(
        "--completions-port",
        metavar="PORT",
        type=_port,
        default=DEFAULT_COMPLETIONS_PORT,
        help="--ranks external: the port ranks send completions to",
    )
    group.add_argument(
        "--heartbeat-port",
        metavar="PORT",
        type=_port,
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
        type=_seconds,
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
