"""Run directories of the ipc sockets: a ``pid`` file in each, and the directories a
killed process left behind removed at the next start, only when provably stale."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.frontend.client import CoordinatorClient
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.run_dirs import (
    TRANSPORT_RUN_FILES,
    TRANSPORT_RUN_PREFIX,
    make_run_dir,
    remove_stale_run_dirs,
)

ROOT = Path(__file__).resolve().parents[2]
FILES = ("requests", "outputs")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def left_behind(parent: Path, name: str, pid: int | None, files=FILES, listen=False):
    """A run directory as a killed process leaves it: a pid file, socket files."""
    path = parent / name
    path.mkdir(mode=0o700)
    if pid is not None:
        (path / "pid").write_text(f"{pid}\n")
    keep = []
    for file in files:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path / file))
        if listen:
            sock.listen()
            keep.append(sock)
        else:
            sock.close()  # the file stays, nobody listens
    return path, keep


def test_a_run_dir_is_private_and_names_its_process(tmp_path):
    path = Path(make_run_dir("flare-api-", FILES, str(tmp_path)))
    assert path.name.startswith("flare-api-") and path.parent == tmp_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert (path / "pid").read_text() == f"{os.getpid()}\n"


@pytest.mark.process
def test_only_provably_stale_dirs_of_this_user_are_removed(tmp_path):
    dead = dead_pid()
    stale, _ = left_behind(tmp_path, "flare-api-stale", dead)
    alive, _ = left_behind(tmp_path, "flare-api-alive", os.getpid())
    no_pid, _ = left_behind(tmp_path, "flare-api-nopid", None)
    listening, socks = left_behind(tmp_path, "flare-api-listening", dead, listen=True)
    extra, _ = left_behind(tmp_path, "flare-api-extra", dead)
    (extra / "notes.txt").write_text("someone's file")
    garbage, _ = left_behind(tmp_path, "flare-api-garbage", None)
    (garbage / "pid").write_text("not a pid")
    other_prefix, _ = left_behind(tmp_path, "flare-transport-x", dead)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "pid").write_text(f"{dead}\n")
    (tmp_path / "flare-api-link").symlink_to(target)
    (tmp_path / "flare-api-file").write_text(f"{dead}\n")

    removed = remove_stale_run_dirs("flare-api-", FILES, str(tmp_path))
    assert removed == [str(stale)]
    assert not stale.exists()
    for kept in (alive, no_pid, listening, extra, garbage, other_prefix, target):
        assert kept.exists(), kept
    assert (tmp_path / "flare-api-link").is_symlink() and (tmp_path / "flare-api-file").exists()
    for sock in socks:
        sock.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory of another user")
@pytest.mark.process
def test_another_users_dir_is_left_alone(tmp_path):
    theirs, _ = left_behind(tmp_path, "flare-api-theirs", dead_pid())
    os.chown(theirs, 12345, 12345)
    assert remove_stale_run_dirs("flare-api-", FILES, str(tmp_path)) == []
    assert theirs.exists()


@pytest.mark.process
def test_a_killed_frontend_and_coordinators_dirs_go_at_the_next_start(short_tmp):
    """SIGKILL skips every clean-up; the next CoordinatorClient and CoordinatorChannel
    in the same temp dir remove what the dead process left."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from runtime.frontend.client import CoordinatorClient
        from runtime.transport.coordinator_channel import CoordinatorChannel
        client = CoordinatorClient({str(short_tmp)!r})
        channel = CoordinatorChannel(1, run_dir={str(short_tmp)!r})
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = sorted(p.name.split("-")[1] for p in short_tmp.iterdir())
    assert left == ["api", "transport"]

    channel = CoordinatorChannel(1, run_dir=str(short_tmp))
    assert sorted(p.name.split("-")[1] for p in short_tmp.iterdir()) == ["api", "transport"]
    assert Path(channel.run_dir).exists()  # the live one is its own
    client = CoordinatorClient(str(short_tmp))
    mine = {Path(channel.run_dir), Path(client.run_dir)}
    assert set(short_tmp.iterdir()) == mine
    channel.close()
    asyncio.run(client.close())
    assert list(short_tmp.iterdir()) == []  # closing removes the pid file too


def test_the_transport_dir_holds_its_sockets_and_pid(short_tmp):
    channel = CoordinatorChannel(1, run_dir=str(short_tmp))
    names = {p.name for p in Path(channel.run_dir).iterdir()}
    assert names == {"pid", "frames", "completions"}  # a bare channel binds no heartbeat
    assert Path(channel.run_dir).name.startswith(TRANSPORT_RUN_PREFIX)
    channel.close()
    channel = CoordinatorChannel(1, run_dir=str(short_tmp), heartbeat=True)
    try:
        names = {p.name for p in Path(channel.run_dir).iterdir()}
        assert names == {"pid", *TRANSPORT_RUN_FILES}
        assert "heartbeat" in TRANSPORT_RUN_FILES
    finally:
        channel.take_heartbeat_socket().close(linger=0)
        channel.close()
    assert not Path(channel.run_dir).exists()
