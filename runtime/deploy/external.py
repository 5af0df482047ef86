"""Ranks launched elsewhere: ``flare run --ranks external`` binds TCP and waits for
ranks started with ``torchrun`` on other machines to connect (docs/deploy.md).
The flags that fill :class:`ExternalRanks` are runtime/cli/flags/deployment.py's."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from runtime.transport.channels import ChannelEndpoints

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


def external_channel(external: ExternalRanks | None) -> dict:
    """The EngineConfig fields that bind TCP for external ranks (none for local ranks)."""
    if external is None:
        return {}
    return {
        "endpoints": ChannelEndpoints(
            frames=external.endpoint(external.frames_port),
            completions=external.endpoint(external.completions_port),
            heartbeat=external.endpoint(external.heartbeat_port),
        ),
        "allow_remote": external.allow_remote,
    }
