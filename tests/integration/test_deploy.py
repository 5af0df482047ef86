"""Deployment shapes of docs/deploy.md, with real processes.

* A local ``flare run -tp 2`` listens on nothing but loopback: the ranks
  rendezvous through a file store and their gloo sockets bind ``lo``
  (every listening socket of the process tree is listed with psutil).
* The two-node rehearsal: ``flare run --ranks external`` and two ``torchrun
  --nnodes 2`` invocations on this machine, exactly the commands of
  docs/deploy.md, over TCP with CURVE keys from ``flare keys``; the greedy
  tokens equal a single-process run, and SIGTERM to the server ends every
  process of both "nodes".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from runtime.deploy.launch import free_port, loopback_interface
from runtime.deploy.local import LocalDeployment
from runtime.ranks.model.default import default_model_dir
from tests.support.server import Server

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
RANK_FLAGS = ["--max-concurrency", "4", "--device", "cpu", "--num-pages", "128"]
PROMPTS = [[1, 17, 42, 99, 5], [7, 7, 300, 12, 64, 2, 9]]
MAX_TOKENS = 12
START_S = 240.0
EXIT_S = 60.0


def _tree(root: psutil.Process) -> list[psutil.Process]:
    return [root, *root.children(recursive=True)]


def _listeners(procs: list[psutil.Process]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of ``procs``."""
    out = []
    for proc in procs:
        try:
            connections = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for c in connections:
            if c.status == psutil.CONN_LISTEN:
                out.append((proc.pid, c.laddr.ip, c.laddr.port))
    return out


def test_a_local_deployment_listens_on_loopback_only() -> None:
    server = Server("-tp", "2")
    try:
        reply = server.post("/v1/completions", {"prompt": "hello", "max_tokens": 4})
        assert reply.status_code == 200
        assert server.proc is not None
        procs = _tree(psutil.Process(server.proc.pid))
        assert len(procs) >= 4  # frontend, coordinator, two ranks
        listeners = _listeners(procs)
        # The HTTP port, and the gloo pair sockets of both ranks at least.
        assert any(port == server.port for _, _, port in listeners), listeners
        assert len({pid for pid, _, _ in listeners}) >= 3, listeners
        outside = [item for item in listeners if item[1] not in ("127.0.0.1", "::1")]
        assert not outside, f"listening beyond loopback: {outside}"
    finally:
        assert server.stop() == 0


def _reference_texts() -> list[list[int]]:
    """The prompts' greedy tokens from one rank in this process."""
    with LocalDeployment(tensor_parallel_size=1, num_pages=128, max_concurrency=4) as deployment:
        return [
            deployment.engine.submit(ids, MAX_TOKENS, ignore_eos=True).result(timeout=120).token_ids
            for ids in PROMPTS
        ]


def _wait_healthy(base: str, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args[:4]} exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the external deployment never became healthy: " + logs[0].read_text())


@pytest.mark.skipif(loopback_interface() is None, reason="no loopback interface to bind gloo to")
def test_two_node_rehearsal_with_torchrun_and_curve(tmp_path: Path) -> None:
    expected = _reference_texts()
    run_dir = Path(tempfile.mkdtemp(prefix="flare-deploy-"))
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        TMPDIR=str(run_dir),
        GLOO_SOCKET_IFNAME=loopback_interface() or "lo",
    )
    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "runtime.cli", "keys", str(keys)], env=env, check=True, timeout=60
    )
    frames, completions, heartbeat, http = (free_port() for _ in range(4))
    master = free_port()
    logs = [tmp_path / name for name in ("server.log", "node0.log", "node1.log")]
    procs: list[subprocess.Popen] = []
    try:
        server = [
            sys.executable, "-m", "runtime.cli", "run", "--ranks", "external",
            "--world-size", "2", "--bind-host", "127.0.0.1",
            "--frames-port", str(frames), "--completions-port", str(completions),
            "--heartbeat-port", str(heartbeat), "--transport-keys", str(keys),
            "--port", str(http), "--device", "cpu", "--max-concurrency", "4",
            "--num-pages", "128", "--handshake-timeout", str(START_S),
        ]  # fmt: skip
        procs.append(_start(server, env, logs[0]))
        for node in (0, 1):
            torchrun = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(master),
                "-m", "runtime.ranks",
                "--frames-endpoint", f"tcp://127.0.0.1:{frames}",
                "--completions-endpoint", f"tcp://127.0.0.1:{completions}",
                "--heartbeat-endpoint", f"tcp://127.0.0.1:{heartbeat}",
                "--transport-keys", str(keys), *RANK_FLAGS,
            ]  # fmt: skip
            procs.append(_start(torchrun, env, logs[1 + node]))
        base = f"http://127.0.0.1:{http}"
        _wait_healthy(base, procs, logs)
        from runtime.frontend.tokenizer import ModelTokenizer

        tokenizer = ModelTokenizer.from_dir(str(default_model_dir()))
        for ids, tokens in zip(PROMPTS, expected):
            body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert choice["text"] == tokenizer.decode(tokens)
        trees = [_tree(psutil.Process(p.pid)) for p in procs]
        procs[0].send_signal(signal.SIGTERM)
        for proc, log in zip(procs, logs):
            code = proc.wait(timeout=EXIT_S)
            assert code == 0, log.read_text()[-3000:]
        survivors = [p.pid for tree in trees for p in tree if _alive(p)]
        assert not survivors, f"processes of the run survived: {survivors}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
