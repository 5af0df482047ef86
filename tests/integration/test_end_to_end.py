"""The whole runtime on CPU: coordinator engine + rank processes (gloo at TP=2),
real sockets, against transformers' greedy tokens."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from tests.support.checkpoints import greedy, write_tiny

ROOT = Path(__file__).resolve().parents[2]
NEW = 8


def _checkpoint(arch: str, tmp_path_factory):
    path = tmp_path_factory.mktemp(arch)
    rng = random.Random(4)
    prompts = [[rng.randrange(120) for _ in range(rng.randint(3, 90))] for _ in range(16)]
    if arch == "llama":
        model = write_tiny("llama", path, seed=21)
    else:
        model = write_tiny("qwen2", path, seed=21, tie=True, bias=True)
    return path, prompts, greedy(model, prompts, NEW)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _checkpoint("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen2_reference(tmp_path_factory):
    return _checkpoint("qwen2", tmp_path_factory)


def deployment(path, tp: int) -> LocalDeployment:
    return LocalDeployment(
        DeploymentConfig(
            model=str(path), tensor_parallel_size=tp, max_concurrency=16,
            max_prefill_tokens=64, num_pages=256, device="cpu", startup_timeout_s=120,
        )
    )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.process
def test_sixteen_concurrent_requests_match_transformers(reference, tp):
    path, prompts, expected = reference
    with deployment(path, tp) as d:
        streams = [d.engine.submit(p, NEW, ignore_eos=True) for p in prompts]
        got = [s.result(timeout=300).token_ids for s in streams]
        stats = d.engine.stats.summary()
    assert got == expected
    assert stats["frames"] > 0 and stats["host_overhead_ratio"] >= 1.0


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.process
def test_qwen2_with_bias_and_tied_embeddings_matches_transformers(qwen2_reference, tp):
    path, prompts, expected = qwen2_reference
    with deployment(path, tp) as d:
        streams = [d.engine.submit(p, NEW, ignore_eos=True) for p in prompts[:8]]
        assert [s.result(timeout=300).token_ids for s in streams] == expected[:8]


@pytest.mark.process
def test_a_slower_rank_sets_the_cost_estimate(reference, monkeypatch):
    """Every rank reports its interval; the coordinator's cost sample is the maximum."""
    path, prompts, _ = reference
    monkeypatch.setenv("FLARE_DEBUG_DELAY_NS_RANK1", str(30_000_000))
    with deployment(path, 2) as d:
        d.engine.submit(prompts[0], 4, ignore_eos=True).result(timeout=300)
        frames = d.engine.stats.frames()
        estimates = dict(d.engine.scheduler.catalog.estimates())
    # Rank 1 reports the delay in every frame (rank 0 may wait for it inside the
    # next frame's collective, so its own interval can grow too).
    assert frames and all(f.rank_device_ns[1] >= 30_000_000 for f in frames)
    assert any(f.rank_device_ns[0] < 30_000_000 for f in frames)
    used = {f.graph for f in frames}
    assert used and all(estimates[g] >= 30_000_000 for g in used)


@pytest.mark.process
def test_each_request_alone_matches_the_batched_run(reference):
    """Batch invariance: the same greedy tokens alone as among sixteen."""
    path, prompts, expected = reference
    with deployment(path, 1) as d:
        for prompt, want in list(zip(prompts, expected))[:6]:
            assert (
                d.engine.submit(prompt, NEW, ignore_eos=True).result(timeout=120).token_ids == want
            )


@pytest.mark.process
def test_flare_run_cli_generates_with_the_embedded_model(tmp_path):
    env = dict(os.environ, FLARE_HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "run", "--prompt", "Hello", "--max-tokens", "5",
         "--device", "cpu", "--tensor-parallel-size", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    # The completion alone on stdout; the prompt and the figures on stderr.
    assert done.stdout.strip() and not done.stdout.startswith("Hello")
    assert "TP=2" in done.stderr and "5 generated tokens" in done.stderr
    figures = done.stderr.strip().splitlines()[-1]
    frames = int(figures.removeprefix("==> figures: ").split()[0])
    assert frames >= 5


@pytest.mark.process
def test_flare_run_rejects_bad_flags_naming_them():
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "run", "--tensor-parallel-size", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--tensor-parallel-size" in done.stderr


@pytest.mark.process
def test_a_rank_that_dies_at_start_up_fails_the_start_at_once(tmp_path):
    start = time.monotonic()
    deployment = LocalDeployment(
        DeploymentConfig(model=str(tmp_path / "missing"), device="cpu", startup_timeout_s=300)
    )
    with pytest.raises(RuntimeError, match="rank 0 exited"):
        deployment.start()
    assert time.monotonic() - start < 60
    assert all(p.poll() is not None for p in deployment.ranks)


def test_spin_budget_needs_a_core_per_process(monkeypatch):
    from runtime.deploy import config as local

    monkeypatch.setattr(local.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert local.spin_budget_us(1) == local.DEFAULT_SPIN_US  # coordinator + 1 rank, 2 cores
    assert local.spin_budget_us(2) == 0  # 3 processes on 2 cores: never spin
    config = DeploymentConfig(tensor_parallel_size=2)
    assert config.rank_args()[config.rank_args().index("--poll-spin-us") + 1] == "0"
    assert DeploymentConfig(tensor_parallel_size=2, poll_spin_us=50).spin_us == 50
    with pytest.raises(ValueError, match="poll_spin_us"):
        DeploymentConfig(poll_spin_us=-5)
