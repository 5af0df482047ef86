"""The simulator's scheduler choice, the scheduler comparison benchmark and the
decision explainer: each runs, reports honest figures and ends with one JSON line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from scripts.bench_schedulers import WORKLOADS, configs, dominated, goals, run_profile
from scripts.scheduling_sim.__main__ import main as sim_main
from scripts.scheduling_sim.explain import main as explain_main
from scripts.scheduling_sim.runner import RunConfig, decode_batches_for, simulate
from scripts.scheduling_sim.workload import WorkloadConfig, chat_shared, make_workload

FLAGS = ["--requests", "12", "--prompt-len", "64:700", "--output-len", "8:40"]


@pytest.mark.parametrize("scheduler", ["flare", "fcfs", "vllm", "sglang", "sarathi", "vtc"])
def test_every_scheduler_runs_with_mixed_shapes(capsys, scheduler):
    assert (
        sim_main([*FLAGS, "--arrival-rate", "50", "--mixed-prefill", "--scheduler", scheduler]) == 0
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["finished"] == 12 and report["scheduler"] == scheduler
    assert report["mixed_prefill"] is True
    for key in ("ttft_ms_p50", "ttft_ms_p99", "gap_ms_p50", "gap_ms_p99", "gap_ms_max",
                "output_tokens_per_s", "goodput_req_per_s", "fairness_jain"):  # fmt: skip
        assert report[key] is not None
    assert 0 < report["fairness_jain"] <= 1
    if scheduler == "flare":
        assert any(name.startswith("mixed") for name in report["frames_by_graph"])


def test_mixed_chunk_is_an_sglang_flag(capsys):
    with pytest.raises(SystemExit):
        sim_main([*FLAGS, "--scheduler", "vllm", "--enable-mixed-chunk"])
    assert "sglang" in capsys.readouterr().err
    assert sim_main([*FLAGS, "--scheduler", "sglang", "--enable-mixed-chunk"]) == 0


def test_decode_batches_follow_the_padded_slot_count():
    assert decode_batches_for(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_batches_for(6) == (1, 2, 4, 8)
    catalog = RunConfig(max_slots=6, mixed_prefill=True).catalog()
    assert max(d.batch_capacity for d in catalog) == 8


def test_warm_start_measures_the_catalog_first():
    arrivals = make_workload(WorkloadConfig(8, 0.0, prompt_len=(64, 300), output_len=(4, 8)))
    cold, sim_cold = simulate(RunConfig(mixed_prefill=True), arrivals)
    warm, sim_warm = simulate(RunConfig(mixed_prefill=True, warm=True), arrivals)
    assert {t["reason"] for t in sim_warm.trace} == {"ordinary"}
    assert "discovery" in {t["reason"] for t in sim_cold.trace}
    assert warm["finished"] == cold["finished"] == 8
    with pytest.raises(ValueError, match="warm"):
        simulate(RunConfig(scheduler="vllm", warm=True), arrivals)


def _r(ttft, gap, tps):
    return {"ttft_ms_p99": ttft, "gap_ms_p99": gap, "output_tokens_per_s": tps}


def test_pareto_domination_and_vllm_goals():
    assert dominated(_r(10, 5, 100), _r(9, 5, 100))
    assert dominated(_r(10, 5, 100), _r(10, 5, 101))
    assert not dominated(_r(10, 5, 100), _r(10, 5, 100))  # equal is not dominated
    assert not dominated(_r(10, 5, 100), _r(9, 6, 200))
    base = {b: _r(20, 10, 50) for b in ("fcfs", "sglang", "sarathi", "vtc")}
    g = goals({"flare": _r(10, 3.5, 98), "vllm": _r(10, 5, 100), **base})
    assert g["pareto_ok"] and g["ttft_ok"] and g["gap_ok"] and g["tokens_per_s_ok"]
    g = goals({"flare": _r(10, 5.5, 97), "vllm": _r(9.9, 5, 100), **base})
    assert not g["gap_ok"] and not g["tokens_per_s_ok"] and not g["ttft_ok"]
    assert g["dominated_by"] == ["vllm"]


@pytest.mark.process
def test_bench_schedulers_quick_run_prints_tables_and_json_last():
    out = subprocess.run(
        [sys.executable, "scripts/bench_schedulers.py", "--quick", "--profiles", "llama1b-h100",
         "--workloads", "burst,issue_a", "--jobs", "1"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    data = json.loads(lines[-1])
    assert "## llama1b-h100 / burst" in out.stdout and "## goals" in out.stdout
    results = data["profiles"]["llama1b-h100"]["issue_a"]
    assert set(results) == {"flare", "fcfs", "vllm", "sglang", "sarathi", "vtc",
                            "flare-nomixed", "flare-warm"}  # fmt: skip
    for report in results.values():
        assert report["finished"] == report["requests"] == 25
        assert report["output_tokens_per_s"] > 0
    assert data["capacity_req_per_s"]["llama1b-h100"] > 0
    assert set(data["goals"]["llama1b-h100"]) == {"burst", "issue_a"}


def test_explain_names_the_winner_and_the_requests_best_candidate(capsys):
    args = [*FLAGS, "--arrival-rate", "80", "--mixed-prefill", "--request", "worst-ttft"]
    assert explain_main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    data = json.loads(lines[-1])
    assert data["rows"], "the watched request waited through at least one decision"
    assert lines[0].startswith(f"request {data['request']}:")
    for row in data["rows"]:
        assert row["winner"]["graph"]
        if not row["served"] and not row.get("in_flight"):
            mine = row["best_with_request"]
            if mine is not None:
                assert mine["score"] <= row["winner"]["score"] or row["winner"]["t_ms"] == 0


@pytest.mark.process
def test_bench_concurrency_starts_a_server_per_slot_count_and_prints_json_last():
    out = subprocess.run(
        [sys.executable, "scripts/bench_concurrency.py", "--slots", "2", "--rates", "20",
         "--num-requests", "4", "--output-len", "4"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    data = json.loads(lines[-1])
    (row,) = data["results"]
    assert (row["slots"], row["rate"], row["completed"]) == (2, 20, 4)
    assert row["request_throughput"] > 0 and row["median_tpot_ms"] > 0
    assert lines[0].split()[:2] == ["slots", "rate"]


def test_flare_and_every_baseline_reuse_the_shared_system_prompts_alike():
    arrivals = chat_shared(n=60)
    prompt = sum(a.spec.prompt_len for a in arrivals)
    rates = {}
    for scheduler in ("flare", "fcfs", "vllm", "sglang", "sarathi", "vtc"):
        report, sim = simulate(RunConfig(scheduler=scheduler, mixed_prefill=True), arrivals)
        assert report["finished"] == 60 and report["prompt_tokens"] == prompt
        cached = report["prompt_tokens_cached"]
        assert cached == sum(s.cached_tokens for s in sim.requests.values()) > 0
        # Cached tokens are not prompt work: the frames consumed exactly the rest.
        assert report["prompt_tokens_computed"] == prompt - cached
        rates[scheduler] = report["cache_hit_rate"]
    # The system prompts are whole pages, so flare's cache and the baselines'
    # model reuse the same tokens: comparable (here equal) hit rates, well above
    # what the first use of each system prompt leaves.
    assert rates["flare"] > 0.5
    assert all(abs(r - rates["flare"]) <= 0.01 for r in rates.values()), rates


def test_workloads_without_prompt_tokens_report_no_cache_figures():
    report, _ = simulate(RunConfig(scheduler="vllm"), make_workload(WorkloadConfig(8)))
    assert not {"prompt_tokens", "prompt_tokens_cached", "cache_hit_rate"} & set(report)


class _InlinePool:
    """ProcessPoolExecutor's submit, run at once in this process."""

    def submit(self, fn, *args):
        value = fn(*args)
        return type("Done", (), {"result": staticmethod(lambda: value)})()


def test_chat_shared_is_in_the_suite_with_cache_figures_and_goals(capsys):
    assert "chat_shared" in WORKLOADS
    out: dict = {"capacity_req_per_s": {}, "profiles": {}, "goals": {}}
    misses: list[str] = []
    base = RunConfig(mixed_prefill=True)
    args = argparse.Namespace(quick=True)
    run_profile(_InlinePool(), base, "llama1b-h100", ["chat_shared"], (), args, None, out, misses)
    printed = capsys.readouterr().out
    assert "## llama1b-h100 / chat_shared\n" in printed  # a fixed rate: no capacity share
    assert "prefix cache hit rate (cached / prompt tokens): flare " in printed
    results = out["profiles"]["llama1b-h100"]["chat_shared"]
    assert set(results) == set(configs(base, "llama1b-h100"))
    for report in results.values():
        assert report["requests"] == report["finished"] == 50
        assert report["cache_hit_rate"] > 0.5 and report["prompt_tokens_cached"] > 0
    assert set(out["goals"]["llama1b-h100"]) == {"chat_shared"}
