"""Start rank processes on this machine the way torchrun would.

``flare run`` uses this: the coordinator runs in the calling process and the
ranks are ``python -m runtime.ranks`` children with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a
multi-host deployment runs the very same entry point under ``torchrun``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from runtime.transport.channels import ChannelEndpoints
from runtime.transport.run_dirs import make_run_dir

DIST_INIT_ENV = "FLARE_DIST_INIT_METHOD"  # how local ranks rendezvous (a file:// store)
DIST_RUN_PREFIX = "flare-dist-"
DIST_RUN_FILES = ("store",)

ROOT = Path(__file__).resolve().parents[2]


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
    """``python -m runtime.ranks`` connected to ``endpoints`` (heartbeat included)."""
    heartbeat = ["--heartbeat-endpoint", endpoints.heartbeat] if endpoints.heartbeat else []
    return [
        sys.executable,
        "-m",
        "runtime.ranks",
        "--frames-endpoint",
        endpoints.frames,
        "--completions-endpoint",
        endpoints.completions,
        *heartbeat,
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
    base = dict(os.environ if env is None else env)
    path = base.get("PYTHONPATH", "")
    base["PYTHONPATH"] = f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)
    # No listener beyond loopback: the ranks rendezvous through a file store in a
    # private (0700) directory instead of a TCP store, which would listen on every
    # interface, and their collectives' sockets bind the loopback interface.
    store_dir = make_run_dir(DIST_RUN_PREFIX, DIST_RUN_FILES)
    base[DIST_INIT_ENV] = f"file://{os.path.join(store_dir, DIST_RUN_FILES[0])}"
    loopback = loopback_interface()
    if loopback is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            base.setdefault(name, loopback)
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world_size):
            rank_env = dict(
                base,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
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
        _remove_store(store_dir)
        raise
    for proc in procs:
        proc.flare_store_dir = store_dir  # type: ignore[attr-defined]  # stop_ranks removes it
    return procs


def loopback_interface() -> str | None:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux), or None."""
    try:
        import psutil

        interfaces = psutil.net_if_addrs()
    except (ImportError, OSError):
        return None
    for name, addresses in sorted(interfaces.items()):
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None


def _remove_store(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def stop_ranks(procs: Sequence[subprocess.Popen], timeout_s: float = 30.0) -> list[int | None]:
    """Wait for the ranks to exit (after a shutdown control), all of them against one
    deadline ``timeout_s`` from now, then kill the ones left together: a hung rank
    costs the deadline once, whatever the tensor parallel size.  Each rank's exit
    code (None: killed)."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    for p in procs:
        left = deadline - time.monotonic()
        if left > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=left)
    codes = [p.poll() for p in procs]
    stragglers = [p for p in procs if p.poll() is None]
    for p in stragglers:
        p.kill()  # SIGKILL: a stopped (SIGSTOP) or hung process goes too
    for p in stragglers:
        p.wait()
    for store_dir in {getattr(p, "flare_store_dir", None) for p in procs} - {None}:
        _remove_store(store_dir)
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
