"""The simulator and benchmark scripts run, are deterministic, and report JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.coordinator.config import PRESETS, PolicyConfig
from scripts.scheduling_sim.__main__ import main as sim_main

ROOT = Path(__file__).resolve().parents[2]


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_simulator_is_deterministic_and_reports(capsys, tmp_path):
    args = [
        "--requests",
        "12",
        "--prompt-len",
        "64:700",
        "--output-len",
        "8:40",
        "--arrival-rate",
        "200",
        "--messages",
        "1:3",
        "--seed",
        "7",
    ]
    trace = tmp_path / "trace.jsonl"
    assert sim_main([*args, "--trace", str(trace)]) == 0
    first = _last_json(capsys.readouterr().out)
    assert sim_main(args) == 0
    second = _last_json(capsys.readouterr().out)
    first.pop("trace_records")
    assert first == second
    assert first["finished"] == 12
    assert first["ttft_ms_p50"] > 0 and first["gap_ms_p99"] >= first["gap_ms_p50"]
    assert 0 < first["fairness_jain"] <= 1 and first["slowdown_p99"] >= first["slowdown_p50"] > 0
    assert 0 <= first["goodput_fraction"] <= 1
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records and {
        "fence",
        "graph",
        "reason",
        "selected_cost_ns",
        "observation_age_ns",
        "refresh_credit_ns",
    } <= set(records[0])
    assert records[0]["reason"] == "discovery"
    assert [r["fence"] for r in records] == sorted(r["fence"] for r in records)


def test_fcfs_baseline_runs_same_workload(capsys):
    assert sim_main(["--requests", "6", "--output-len", "10", "--scheduler", "fcfs"]) == 0
    report = _last_json(capsys.readouterr().out)
    assert report["finished"] == 6 and report["scheduler"] == "fcfs"


@pytest.mark.process
def test_bench_scheduler_prints_json_last():
    out = subprocess.run(
        [sys.executable, "scripts/bench_scheduler.py", "--iterations", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    result = _last_json(out)
    for n in (8, 32, 64):
        assert result[f"plan_us_median_{n}"] > 0
        assert result[f"plan_us_p99_{n}"] >= result[f"plan_us_median_{n}"]
    assert result["catalog_descriptors"] >= 180
    assert result["commit_us_median_64"] > 0 and result["complete_us_median_64"] > 0
    missed = [k for k, bound in result["goals_us"].items() if result[k] > bound]
    assert result["goals_missed"] == sorted(missed)
    assert result["goal_met"] is (not missed)


def test_config_files_match_presets():
    assert PolicyConfig.from_toml(ROOT / "configs/balanced.toml") == PRESETS["balanced"]
    assert PolicyConfig.from_toml(ROOT / "configs/throughput.toml") == PRESETS["throughput"]


def test_config_file_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[scheduler]\npreset = "balanced"\n[scheduler.policy]\ntoken_fairness = -1\n')
    try:
        PolicyConfig.from_toml(bad)
    except ValueError as exc:
        assert "token_fairness" in str(exc)
    else:
        raise AssertionError("negative token_fairness accepted")


@pytest.mark.process
def test_gpu_check_dry_runs_on_cpu(tmp_path):
    """The prepared CUDA check must work when a GPU session finally runs it."""
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["all_ok"] and result == json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(result["replay_us"]) >= {"decode B=8", "prefill B=1 C=64"}
