"""Liveness and hang detection with real processes (CPU, the embedded model, test
heartbeats of 0.5 s / 2 s): a killed coordinator takes every rank with it, a
killed rank fails its stream and the server, a stopped rank is named with the
fence it left unanswered, and a message a live rank cannot decode (or a replayed
frame) is answered instead of met with silence."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from runtime.coordinator.engine import ERROR, Engine, EngineConfig, EngineError
from runtime.deploy.config import DeploymentConfig
from runtime.deploy.launch import free_port, rank_command, spawn_ranks, stop_ranks
from runtime.deploy.local import LocalDeployment
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.frame import Frame
from runtime.transport.liveness import COORDINATOR_GONE_EXIT_CODE
from tests.support.server import Server

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 2.0}
HEARTBEAT_FLAGS = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "2"]
RANK_FLAGS = [
    "--device", "cpu", "--num-pages", "256", "--max-concurrency", "2",
    "--max-prefill-tokens", "64", *HEARTBEAT_FLAGS,
]  # fmt: skip
START_S = 180.0  # start-up on a loaded machine (load, prepare, handshake)


def wait_until(predicate, limit_s: float, what: str):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {limit_s} s")


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def cleanup() -> Iterator[list[subprocess.Popen]]:
    """Processes a test started: whatever is left is killed (with its session)."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait()


# A coordinator of its own: an Engine that binds, prints its endpoints, waits for
# two ranks and serves until killed.
COORDINATOR = """
import json, sys, time
from runtime.coordinator.engine import Engine, EngineConfig
engine = Engine(EngineConfig(
    world_size=2, heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0, require_heartbeats=True,
    handshake_timeout_s=180, catalog_timeout_s=180,
))
e = engine.bind()
print(json.dumps([e.frames, e.completions, e.heartbeat]), flush=True)
engine.start()
engine.run_in_thread()
print("serving", flush=True)
time.sleep(600)
"""


def test_every_rank_exits_when_the_coordinator_is_killed(short_tmp, cleanup) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(short_tmp))
    out = open(short_tmp / "coordinator.out", "w+")  # noqa: SIM115 - closed below
    coordinator = subprocess.Popen(
        [sys.executable, "-c", COORDINATOR], env=env, stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True, text=True,
    )  # fmt: skip
    cleanup.append(coordinator)

    def lines() -> list[str]:
        out.seek(0)
        return out.read().splitlines()

    first = wait_until(lambda: [x for x in lines() if x.startswith("[")], START_S, "endpoints")
    endpoints = ChannelEndpoints(*json.loads(first[0]))
    assert endpoints.heartbeat
    # Ranks as torchrun starts them on another host: no parent-death signal, a
    # session of their own, the coordinator is not their parent.
    port = free_port()
    logs, ranks = [], []
    for rank in range(2):
        log = open(short_tmp / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        rank_env = dict(
            env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        ranks.append(
            subprocess.Popen(
                rank_command(endpoints, RANK_FLAGS), env=rank_env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        )  # fmt: skip
        cleanup.append(ranks[-1])
    wait_until(lambda: "serving" in lines(), START_S, "the coordinator serving")
    time.sleep(1.5)  # heartbeats flow both ways (three intervals)
    assert all(r.poll() is None for r in ranks)
    coordinator.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # Every rank notices within its heartbeat timeout (2 s) + a margin for a loaded machine.
    wait_until(lambda: all(r.poll() is not None for r in ranks), 2.0 + 10.0, "ranks exit")
    took = time.monotonic() - killed
    for rank, (proc, log) in enumerate(zip(ranks, logs)):
        log.seek(0)
        text = log.read()
        assert proc.returncode == COORDINATOR_GONE_EXIT_CODE, text[-2000:]
        assert f"rank {rank}: no heartbeat from the coordinator at {endpoints.heartbeat}" in text
        assert "the coordinator is gone; this rank exits" in text
        log.close()
    assert took >= 1.0  # not at once: after the heartbeat timeout
    out.close()


def test_a_killed_rank_fails_its_stream_and_the_server_exits_non_zero() -> None:
    server = Server(*HEARTBEAT_FLAGS)
    try:
        assert server.proc is not None
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        ranks = [p for p in tree if "runtime.ranks" in " ".join(p.cmdline())]
        assert len(ranks) == 1
        request = {"prompt": "alpha beta gamma", "max_tokens": 3000, "stream": True,
                   "ignore_eos": True, "temperature": 0}  # fmt: skip
        events: list[str] = []
        with httpx.stream(
            "POST", f"{server.base}/v1/completions", json=request, timeout=60
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            while len(events) < 3:  # the request runs
                line = next(lines)
                if line.startswith("data:"):
                    events.append(line)
            ranks[0].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            for line in lines:
                if line.startswith("data:"):
                    events.append(line)
            ended = time.monotonic() - killed
        errors = [e for e in events if '"error"' in e]
        assert errors, events[-3:]
        assert "rank 0" in errors[-1]  # the failure names the rank
        assert ended < 5.0  # an error within 5 s, not the 300 s of old
        code = server.proc.wait(timeout=60)
        assert code != 0, server.output()[-3000:]
        assert alive(tree) == []  # the coordinator and the rank went with it
    finally:
        server.stop()


def test_a_stopped_rank_is_named_with_the_fence_it_left_unanswered() -> None:
    deployment = LocalDeployment(
        DeploymentConfig(
            tensor_parallel_size=2, device="cpu", max_concurrency=2, num_pages=256,
            max_prefill_tokens=64, startup_timeout_s=START_S, allow_code_mismatch=True,
            **HEARTBEAT,
        )
    )  # fmt: skip
    deployment.start()
    stopped_rank = None
    try:
        engine = deployment.engine
        stream = engine.submit([5, 6, 7, 8], 3000, ignore_eos=True)
        wait_until(lambda: len(stream.token_ids) >= 3, 60, "the request runs")
        stopped_rank = deployment.ranks[1]
        os.kill(stopped_rank.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        result = stream.result(timeout=30)
        took = time.monotonic() - stopped
        assert result.finish_reason == ERROR
        message = str(engine.error)
        assert message.startswith("rank 1 is gone: no heartbeat for"), message
        assert "in flight, unanswered by rank 1" in message and "fence(s) " in message
        assert took < 2.0 + 8.0  # the heartbeat timeout, not the watchdog's minutes
        # Continued, the rank leaves by itself: told to shut down, or finding its
        # coordinator silent; rank 0, whose collective waited for it, too.
        os.kill(stopped_rank.pid, signal.SIGCONT)
        for proc in deployment.ranks:
            proc.wait(timeout=30)
    finally:
        if stopped_rank is not None and stopped_rank.poll() is None:
            os.kill(stopped_rank.pid, signal.SIGCONT)
        deployment.stop()
    assert all(p.poll() is not None for p in deployment.ranks)


def test_a_broken_message_to_a_live_rank_fails_the_engine_fast(caplog, monkeypatch) -> None:
    # Two ranks, rank 1 slow (300 ms after each frame): rank 0 reads the broken
    # message right after its part of the frame, while rank 1 still holds it,
    # so that frame is in flight when rank 0's error arrives.  With one rank the
    # rank finishes the frame first, and whether the coordinator has published
    # the next one by then is a race (CI, issue 25: "fence(s) none").
    monkeypatch.setenv("FLARE_DEBUG_DELAY_NS_RANK1", str(300_000_000))
    engine = Engine(
        EngineConfig(
            world_size=2, handshake_timeout_s=START_S, catalog_timeout_s=START_S,
            require_heartbeats=True, **HEARTBEAT,
        )
    )  # fmt: skip
    ranks = spawn_ranks(engine.bind(), 2, RANK_FLAGS)
    try:
        engine.start()

        def drive(stream, limit_s: float = 60) -> None:
            deadline = time.monotonic() + limit_s
            while not stream.finished:
                assert time.monotonic() < deadline
                engine.step(20)

        drive(engine.submit([1, 2, 3], 4))
        # A replayed frame (fence 1 again): the rank refuses it with an error
        # completion naming the fence; the coordinator ignores it (not in
        # flight), counts it, and keeps serving.
        program = min(engine.facts.descriptors, key=lambda d: d.batch_capacity)
        engine._channel.publish(Frame(1, program))
        stream = engine.submit([4, 5, 6], 4)
        drive(stream)
        wait_until(
            lambda: engine.step(20) or engine.stats.counters()["ignored_messages"], 10, "refusal"
        )
        assert stream.result(timeout=0).finish_reason != ERROR
        assert "for fence 1: not in flight (its error: rejected: fence 1 replayed" in caplog.text
        # A message the rank cannot decode: it answers Control("error") and the frames
        # in flight fail at once, not after the watchdog's minutes.
        stream = engine.submit([7, 8, 9], 3000, ignore_eos=True)
        while not engine.in_flight_fences:
            engine.step(20)
        fence = engine.in_flight_fences[0]
        engine._channel._pub.send(b"\xc1 not a message")
        sent = time.monotonic()
        with pytest.raises(EngineError, match="rank 0 could not decode a message") as raised:
            while time.monotonic() - sent < 30:
                engine.step(20)
        assert time.monotonic() - sent < 5.0
        named = re.search(r"frames in flight fail: fence\(s\) (\d+)", str(raised.value))
        assert named is not None and int(named.group(1)) >= fence
        assert stream.result(timeout=0).finish_reason == ERROR
    finally:
        engine.stop()
        codes = stop_ranks(ranks, timeout_s=30)
    assert codes == [0, 0]  # the ranks kept serving until told to shut down


def test_a_rank_busy_in_a_frame_longer_than_the_timeout_is_not_taken_for_dead(
    monkeypatch,
) -> None:
    # Every frame of rank 0 takes 2.5 s, more than the 2 s heartbeat timeout: its
    # heartbeat thread keeps sending while the frame runs, so nothing fails.
    monkeypatch.setenv("FLARE_DEBUG_DELAY_NS_RANK0", str(2_500_000_000))
    deployment = LocalDeployment(
        DeploymentConfig(
            device="cpu", max_concurrency=2, num_pages=64, max_prefill_tokens=64,
            startup_timeout_s=START_S, allow_code_mismatch=True, **HEARTBEAT,
        )
    )  # fmt: skip
    with deployment:
        stream = deployment.engine.submit([1, 2, 3], 2, ignore_eos=True)
        result = stream.result(timeout=60)
        assert result.finish_reason != ERROR, deployment.engine.error
        assert len(result.token_ids) == 2
        assert deployment.engine.error is None and deployment.engine.liveness.gone == {}
