"""The rank-level debugging flags end to end on the command line: `flare run
--prompt` at TP=2 with --check-ranks, --record-frames and --log-dir, then
`flare replay` of the recording."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # every test here starts flare or rank processes

ROOT = Path(__file__).resolve().parents[2]


def flare(args: list[str], tmp: Path, timeout: float = 300.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLARE_HOME=str(tmp / "home"))
    env.pop("FLARE_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_record_check_log_then_replay(tmp_path):
    recording, logs = tmp_path / "rec", tmp_path / "logs"
    run = flare(
        ["run", "--prompt", "The coordinator", "--max-tokens", "6", "--device", "cpu",
         "-tp", "2", "--num-pages", "64", "--check-ranks", "--record-frames", str(recording),
         "--log-dir", str(logs), "--log-level", "debug"],
        tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert stat.S_IMODE(os.stat(recording).st_mode) == 0o700
    for rank in (0, 1):
        log = logs / f"rank{rank}.log"
        assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
        assert f"[rank {rank} pid " in log.read_text()
    replayed = flare(["replay", str(recording)], tmp_path)
    assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-2000:]
    assert "rank 0's results equal the recording" in replayed.stdout
    alone = flare(["replay", str(recording), "-tp", "1"], tmp_path)
    assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-2000:]
    # A rank fault replays with the environment: the ranks' CRCs are compared.
    os.environ["FLARE_DEBUG_PERTURB_FENCE_RANK1"] = "2"
    try:
        faulty = flare(["replay", str(recording)], tmp_path)
    finally:
        del os.environ["FLARE_DEBUG_PERTURB_FENCE_RANK1"]
    assert faulty.returncode == 1, faulty.stdout[-2000:] + faulty.stderr[-2000:]
    assert "ranks disagree: fence 2: rank 1 sampled different tokens" in faulty.stdout
    assert "rank 0's results equal the recording" in faulty.stdout  # rank 0 is right


def test_ranks_that_disagree_fail_the_run_naming_rank_and_fence(tmp_path, monkeypatch):
    monkeypatch.setenv("FLARE_DEBUG_PERTURB_FENCE_RANK1", "3")
    run = flare(
        ["run", "--prompt", "The coordinator", "--max-tokens", "6", "--device", "cpu",
         "-tp", "2", "--num-pages", "64", "--check-ranks"],
        tmp_path,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr[-2000:]
    assert "finish: error" in run.stderr
    assert "flare: the engine failed: fence 3: rank 1 sampled different tokens" in run.stderr
