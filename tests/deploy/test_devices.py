"""`--device`: a device this machine cannot run is refused before any process
starts, in one line naming the flag, exit 2: by `flare run`/`flare serve`, by the
coordinator entry point and by every rank (`python -m runtime.ranks`, as torchrun
starts it).  The rules run against a stand-in torch of each kind (CPU build,
CUDA build without a device, N devices); the real commands run on this machine's
torch when it has no CUDA."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.cli.converters import device as parse_device
from runtime.deploy import devices
from runtime.deploy.devices import device_problem, rank_device_problem

ROOT = Path(__file__).resolve().parents[2]


def fake_torch(monkeypatch, cuda: str | None, count: int) -> None:
    """This process's torch as a build for ``cuda`` (None: a CPU build) that sees
    ``count`` devices."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_device_values():
    for text in ("auto", "cpu", "cuda", "cuda:0", "cuda:7", "CUDA:1"):
        assert parse_device(text) == text.lower()
    for text in ("gpu", "cuda:", "cuda:-1", "cuda:x", "tpu"):
        with pytest.raises(argparse.ArgumentTypeError, match="auto, cpu, cuda or cuda:N"):
            parse_device(text)
    assert devices.first_cuda_index("cuda:3") == 3 and devices.first_cuda_index("cuda") == 0


def test_a_cpu_build_of_torch_refuses_cuda_naming_the_flag(monkeypatch):
    fake_torch(monkeypatch, None, 0)
    for device in ("cuda", "cuda:1"):
        problem = device_problem(device, 1)
        assert problem is not None and problem.startswith(f"--device {device}: ")
        assert "no CUDA support" in problem and "--device cpu" in problem
        assert rank_device_problem(device, 0) == problem
    assert device_problem("auto", 4) is None and device_problem("cpu", 4) is None


def test_a_cuda_build_without_a_device_says_so(monkeypatch):
    fake_torch(monkeypatch, "12.4", 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    problem = device_problem("cuda", 1)
    assert problem is not None and "no CUDA device is visible" in problem
    assert "CUDA_VISIBLE_DEVICES=''" in problem
    assert device_problem("auto", 2) is None  # auto: the CPU


def test_ranks_need_as_many_devices_as_the_tensor_parallel_size(monkeypatch):
    fake_torch(monkeypatch, "12.4", 2)
    assert device_problem("cuda", 2) is None and device_problem("cuda:1", 1) is None
    problem = device_problem("cuda", 3)
    assert problem is not None and problem.startswith("--tensor-parallel-size 3: ")
    assert "2 CUDA devices visible" in problem
    auto = device_problem("auto", 4)
    assert auto is not None and "--device auto picks CUDA" in auto
    past = device_problem("cuda:1", 2)
    assert past is not None and past.startswith("--device cuda:1: ")
    assert "cuda:1..cuda:2" in past
    missing = device_problem("cuda:5", 1)
    assert missing is not None and "no such device" in missing and "cuda:0..cuda:1" in missing
    assert rank_device_problem("cuda", 1) is None
    rank = rank_device_problem("cuda:1", 1)
    assert rank is not None and "LOCAL_RANK 1 would run on cuda:2" in rank
    assert "at most 1 ranks per machine" in rank


def test_the_deployment_passes_cuda_n_to_the_ranks():
    from runtime.deploy.config import DeploymentConfig

    config = DeploymentConfig(device="cuda:1", tensor_parallel_size=2)
    args = config.rank_args()
    assert args[args.index("--device") + 1] == "cuda:1"
    with pytest.raises(ValueError, match="cuda:N"):
        DeploymentConfig(device="gpu")


# -- the real entry points, on a machine without CUDA ---------------------------------------

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def run(argv: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path), **env)
    environ.pop("FLARE_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", *argv], env=environ, capture_output=True, text=True, timeout=120
    )


@no_cuda
@pytest.mark.parametrize(
    "argv",
    [
        ["runtime.cli", "run", "--device", "cuda", "--prompt", "Hello"],
        ["runtime.cli", "serve", "--device", "cuda:1", "-tp", "2"],
        ["runtime.coordinator", "--device", "cuda", "--api-requests", "ipc:///nowhere/r",
         "--api-outputs", "ipc:///nowhere/o"],
    ],
    ids=["run", "serve", "coordinator"],
)  # fmt: skip
@pytest.mark.process
def test_flare_and_the_coordinator_refuse_in_one_line_before_starting(argv, tmp_path):
    done = run(argv, tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    device = argv[argv.index("--device") + 1]
    assert lines[0].startswith(f"flare run: error: --device {device}: "), lines[0]
    assert not any(p.name.startswith("flare-") for p in tmp_path.iterdir())  # nothing started


@no_cuda
@pytest.mark.process
def test_a_rank_started_by_torchrun_refuses_in_one_line(tmp_path):
    endpoints = ["--frames-endpoint", "ipc:///nowhere/f", "--completions-endpoint",
                 "ipc:///nowhere/c"]  # fmt: skip
    done = run(["runtime.ranks", "--device", "cuda", *endpoints], tmp_path, RANK="1",
               LOCAL_RANK="1", WORLD_SIZE="2")  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("rank 1: --device cuda: this torch build has no CUDA support")


def test_the_device_check_is_skipped_for_ranks_on_other_machines(monkeypatch):
    """--ranks external: the ranks' devices are theirs; this machine may have none."""
    from runtime.cli.app import build_parser
    from runtime.cli.commands.run import checked_run

    fake_torch(monkeypatch, None, 0)
    argv = ["--device", "cuda", "--ranks", "external", "--insecure-transport", "-tp", "2"]
    parser = build_parser()
    config, _ = checked_run(parser.parse_args(["run", *argv]), parser, argv)
    assert config.device == "cuda" and config.external is not None
