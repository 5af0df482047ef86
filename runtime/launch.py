"""Start rank processes on this machine the way torchrun would.

``flare run`` uses this: the coordinator runs in the calling process and the
ranks are ``python -m runtime.ranks`` children with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a
multi-host deployment runs the very same entry point under ``torchrun``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from runtime.transport.channels import ChannelEndpoints

ROOT = Path(__file__).resolve().parents[1]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the rank gets SIGTERM if the launching process dies (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def rank_command(endpoints: ChannelEndpoints, rank_args: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "runtime.ranks",
        "--frames-endpoint",
        endpoints.frames,
        "--completions-endpoint",
        endpoints.completions,
        *rank_args,
    ]


def spawn_ranks(
    endpoints: ChannelEndpoints,
    world_size: int,
    rank_args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen]:
    """Start ``world_size`` rank processes; they inherit stdout and stderr."""
    if world_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {world_size}")
    port = free_port()
    base = dict(os.environ if env is None else env)
    path = base.get("PYTHONPATH", "")
    base["PYTHONPATH"] = f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)
    procs = []
    try:
        for rank in range(world_size):
            rank_env = dict(
                base,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            procs.append(
                subprocess.Popen(
                    rank_command(endpoints, rank_args),
                    env=rank_env,
                    start_new_session=True,  # Ctrl-C reaches the coordinator, not the ranks
                    preexec_fn=_die_with_parent,
                )
            )
    except BaseException:
        stop_ranks(procs, timeout_s=0)
        raise
    return procs


def stop_ranks(procs: Sequence[subprocess.Popen], timeout_s: float = 30.0) -> list[int | None]:
    """Wait for the ranks to exit (after a shutdown control); kill stragglers."""
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout_s) if timeout_s > 0 else p.poll())
        except subprocess.TimeoutExpired:
            codes.append(None)
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes


def spawn_coordinator(args: Sequence[str]) -> subprocess.Popen:
    """Start ``python -m runtime.coordinator ARGS`` for the HTTP frontend.

    It dies with this process and keeps out of the terminal's Ctrl-C (the
    frontend stops it with SIGTERM, and it stops its ranks).
    """
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "runtime.coordinator", *args],
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
