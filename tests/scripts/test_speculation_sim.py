"""Speculation in the simulator: acceptance sampling, the width-rule baselines,
the command line and the speculation benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import scripts.bench_speculation_sim as spec_bench
from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.plan import LanePhase, LaneWork, ScheduledPlan, SelectionReason
from runtime.coordinator.records import CompletionRecord, ExecutionTiming, GeneratedToken
from runtime.coordinator.requests import RequestHandle, RequestSpec
from runtime.ranks.capacity import speculative_shapes
from scripts.bench_schedulers import configs as bench_configs
from scripts.scheduling_sim.__main__ import main as sim_main
from scripts.scheduling_sim.baselines import (
    GlobalAdaptiveScheduler,
    TableScheduler,
    make_baseline,
)
from scripts.scheduling_sim.catalogs import PROFILES, build_catalog, profile_for
from scripts.scheduling_sim.engine import RequestStats, Simulation
from scripts.scheduling_sim.metrics import summarize
from scripts.scheduling_sim.runner import RunConfig, simulate
from scripts.scheduling_sim.workload import (
    ACCEPTANCE,
    Arrival,
    WorkloadConfig,
    assign_acceptance,
    make_workload,
)

ROOT = Path(__file__).resolve().parents[2]
PROFILE = PROFILES["llama1b-h100"]
CATALOG = build_catalog((64, 128, 256), (1, 2, 4, 8, 16, 32), speculative_widths=(2, 4, 8))


class FakeSpeculator:
    """Every request decodes from admission; each step is one SPECULATIVE round of
    all live requests at query length min(q, output left)."""

    def __init__(self, q: int, batch: int = 8) -> None:
        self.q = q
        self.graph = GraphDescriptor(GraphKind.SPECULATIVE, batch, token_capacity=q,
                                     proposal_depth=q - 1)  # fmt: skip
        self.specs: dict[int, RequestSpec] = {}
        self.output: dict[int, int] = {}
        self.inflight: ScheduledPlan | None = None

    def admit(self, spec: RequestSpec) -> RequestHandle:
        handle = RequestHandle(len(self.specs))
        self.specs[handle.id] = spec
        self.output[handle.id] = 0
        return handle

    def advance_to(self, now_ns: int) -> None:
        pass

    def plan(self) -> ScheduledPlan | None:
        live = [i for i, s in self.specs.items() if self.output[i] < s.max_output_tokens]
        if self.inflight is not None or not live:
            return None
        lanes = tuple(
            LaneWork(RequestHandle(i), i, 1, LanePhase.DECODE, 0, 0, self.output[i],
                     min(self.q, self.specs[i].max_output_tokens - self.output[i]), 1.0, 1.0, 0.0)
            for i in live[: self.graph.batch_capacity]
        )  # fmt: skip
        return ScheduledPlan(1, self.graph, lanes, 0, SelectionReason.ORDINARY, True, 0, 0,
                             0.0, 0.0, 0.0, 0)  # fmt: skip

    def commit(self, plan: ScheduledPlan, fence: int) -> None:
        self.inflight = plan

    def complete(self, fence, records, timing) -> list[GeneratedToken]:
        out = []
        for lane, record in zip(self.inflight.lanes, records):
            assert 1 <= len(record.tokens) <= lane.max_tokens
            i = lane.handle.id
            self.output[i] += len(record.tokens)
            done = self.output[i] >= self.specs[i].max_output_tokens
            out.append(GeneratedToken(lane.handle, fence, record.tokens, False, done, None))
        self.inflight = None
        return out

    def published_output(self, handle, fence, at_ns=None) -> bool:
        return True

    def drain_trace(self) -> list:
        return []


def _arrivals(n: int, output: int, acceptance: str, prompt: int = 64) -> list[Arrival]:
    return [Arrival(0, RequestSpec(prompt, output), acceptance=acceptance) for _ in range(n)]


def _fake_run(acceptance: str, q: int = 8, seed: int = 0) -> Simulation:
    sim = Simulation(FakeSpeculator(q), PROFILE.duration_ns, _arrivals(4, 200, acceptance),
                     seed=seed, catalog=CATALOG)  # fmt: skip
    return sim.run()


def test_acceptance_profiles_and_mixed_labels():
    assert ACCEPTANCE["high"].probability(100, 256) == 0.9
    assert ACCEPTANCE["low"].probability(0, 256) == 0.1
    drifting = ACCEPTANCE["drifting"]
    assert drifting.probability(0, 256) == pytest.approx(0.9)
    assert drifting.probability(255, 256) == pytest.approx(0.1)
    assert drifting.probability(127, 255) == pytest.approx(0.5)
    labelled = assign_acceptance(_arrivals(30, 8, None), "mixed", seed=3)
    counts = {name: sum(a.acceptance == name for a in labelled) for name in ACCEPTANCE}
    assert counts == {"high": 10, "low": 10, "drifting": 10}
    assert labelled == assign_acceptance(_arrivals(30, 8, None), "mixed", seed=3)
    assert [a.acceptance for a in labelled] != [
        a.acceptance for a in assign_acceptance(_arrivals(30, 8, None), "mixed", seed=4)
    ]
    cfg = WorkloadConfig(requests=6, acceptance="low")
    assert {a.acceptance for a in make_workload(cfg)} == {"low"}
    # labelling draws from its own generator: lengths and times are unchanged
    plain = make_workload(WorkloadConfig(requests=6, prompt_len=(8, 90)))
    mixed = make_workload(WorkloadConfig(requests=6, prompt_len=(8, 90), acceptance="mixed"))
    assert [a.spec for a in plain] == [a.spec for a in mixed]


def test_acceptance_sampling_is_reproducible_and_follows_the_profile():
    high, low = _fake_run("high"), _fake_run("low")
    for sim in (high, low):
        assert all(s.finished_ns is not None and s.output_tokens == 200
                   for s in sim.requests.values())  # fmt: skip
    per_round = {
        name: sum(s.spec_tokens for s in sim.requests.values())
        / sum(s.spec_rounds for s in sim.requests.values())
        for name, sim in (("high", high), ("low", low))
    }
    # q = 8: E = 1 + sum p^i (i = 1..7): 5.70 at 0.9, 1.11 at 0.1
    assert 4.5 < per_round["high"] < 6.5 and 1.0 <= per_round["low"] < 1.3
    s = next(iter(high.requests.values()))
    assert 0.55 < s.drafts_accepted / s.drafts_offered < 0.8  # E = 4.70 / 7
    again = _fake_run("high")
    assert [(s.spec_rounds, s.drafts_accepted, s.publications_ns)
            for s in again.requests.values()] == [
        (s.spec_rounds, s.drafts_accepted, s.publications_ns) for s in high.requests.values()
    ]  # fmt: skip
    other = _fake_run("high", seed=1)
    assert [s.drafts_accepted for s in other.requests.values()] != [
        s.drafts_accepted for s in high.requests.values()
    ]
    report = summarize(high)
    assert report["speculative_rounds"] == sum(s.spec_rounds for s in high.requests.values())
    assert report["acceptance_by_profile"]["high"]["acceptance_rate"] > 0.55
    assert report["rounds_by_width"] == {"8": high.frames}


def test_draws_are_per_output_position_whatever_the_width():
    """Common random numbers: a request's draws belong to its output positions,
    so a narrower round accepts exactly the wider round's prefix."""
    sim = Simulation(FakeSpeculator(8), PROFILE.duration_ns, _arrivals(40, 64, "high"),
                     catalog=CATALOG)  # fmt: skip
    sim._admit_due()
    for stats in sim.requests.values():
        wide = sim.accepted_drafts(stats, 7)
        assert sim.accepted_drafts(stats, 3) == min(wide, 3)
        assert sim.accepted_drafts(stats, 0) == 0
    other = Simulation(FakeSpeculator(4), PROFILE.duration_ns, _arrivals(40, 64, "high"),
                       catalog=CATALOG)  # fmt: skip
    other._admit_due()
    assert [sim.accepted_drafts(s, 7) for s in sim.requests.values()] == [
        other.accepted_drafts(s, 7) for s in other.requests.values()
    ]


def test_drifting_requests_accept_less_late_in_their_output():
    sim = Simulation(FakeSpeculator(8), PROFILE.duration_ns, _arrivals(8, 400, "drifting"),
                     catalog=CATALOG)  # fmt: skip
    sim.run(stop=lambda s: s.requests and min(r.output_tokens for r in s.requests.values()) >= 100)
    early = sum(r.drafts_accepted for r in sim.requests.values()) / sum(
        r.drafts_offered for r in sim.requests.values()
    )
    before = [(r.drafts_accepted, r.drafts_offered) for r in sim.requests.values()]
    sim.run()
    after = [(r.drafts_accepted, r.drafts_offered) for r in sim.requests.values()]
    late = sum(a[0] - b[0] for a, b in zip(after, before)) / sum(
        a[1] - b[1] for a, b in zip(after, before)
    )
    # q = 8 offers 7 drafts: the accepted share is E[leading run] / 7, about 0.45
    # over positions 0-100 of 400 (p 0.9 -> 0.7), under 0.2 beyond (p 0.7 -> 0.1)
    assert early > 0.35 and late < 0.25


def test_output_limit_caps_a_round():
    sim = Simulation(FakeSpeculator(8), PROFILE.duration_ns, _arrivals(3, 5, "high"),
                     catalog=CATALOG)  # fmt: skip
    sim.run()
    assert all(s.output_tokens == 5 for s in sim.requests.values())


def _decode_round_width(scheduler, n: int) -> GraphDescriptor:
    """Admit ``n`` requests, run their prefill, return the first decode round's shape."""
    handles = [scheduler.admit(RequestSpec(64, 64)) for _ in range(n)]
    plan = scheduler.plan()
    assert all(lane.phase is LanePhase.PREFILL for lane in plan.lanes)
    scheduler.commit(plan, 0)
    records = [CompletionRecord(lane.slot, lane.generation, (7,)) for lane in plan.lanes]
    scheduler.complete(0, records, ExecutionTiming((1_000_000,)))
    plan = scheduler.plan()
    assert {lane.handle for lane in plan.lanes} == set(handles)
    assert all(lane.max_tokens == plan.graph.token_capacity for lane in plan.lanes)
    return plan.graph


@pytest.mark.parametrize(("running", "width", "batch"), [(3, 4, 4), (10, 2, 16), (20, 1, 32)])
def test_table_picks_width_by_running_batch(running, width, batch):
    assert TableScheduler(CATALOG).width_for(running) == width
    graph = _decode_round_width(TableScheduler(CATALOG), running)
    assert graph.token_capacity == width and graph.batch_capacity == batch
    kind = GraphKind.DECODE if width == 1 else GraphKind.SPECULATIVE
    assert graph.kind is kind and (width == 1 or graph.proposal_depth == width - 1)


def test_table_falls_back_to_the_widest_catalog_width_below():
    catalog = build_catalog((64,), (1, 2, 4, 8), speculative_widths=(3,))
    assert _decode_round_width(TableScheduler(catalog), 3).token_capacity == 3
    assert _decode_round_width(TableScheduler(build_catalog((64,), (1, 2, 4))), 3).kind is (
        GraphKind.DECODE
    )


def _global_run(acceptance: str) -> tuple[GlobalAdaptiveScheduler, Simulation]:
    sched = make_baseline("global-adaptive", CATALOG)
    sim = Simulation(sched, PROFILE.duration_ns, _arrivals(4, 300, acceptance), catalog=CATALOG)
    sim.run()
    return sched, sim


def test_global_adaptive_moves_its_width_with_acceptance():
    high, sim_high = _global_run("high")
    low, _ = _global_run("low")
    assert all(s.output_tokens == 300 for s in sim_high.requests.values())
    # starts at the widest program, then follows the moving average
    assert GlobalAdaptiveScheduler(CATALOG).rule_width() == 8
    assert high.ema > 2.0 and high.rule_width() >= 3
    assert low.ema < 0.5 and low.rule_width() == 1
    wide = lambda s: sum(n for w, n in s.rounds_by_width.items() if w >= 4)  # noqa: E731
    assert wide(high) > 0.8 * sum(high.rounds_by_width.values())
    assert low.rounds_by_width.get(1, 0) > 0.7 * sum(low.rounds_by_width.values())
    # narrow rounds still probe at the narrowest speculative width
    assert low.rounds_by_width.get(2, 0) >= low.rounds_by_width[1] // 8 - 1


def test_make_baseline_speculative_arguments():
    assert make_baseline("fixed-width", CATALOG, speculative_width=4).width == 4
    with pytest.raises(ValueError, match="speculative_width"):
        make_baseline("fixed-width", CATALOG)
    with pytest.raises(ValueError, match="speculative_width"):
        make_baseline("vllm", CATALOG, speculative_width=2)


def test_copy_proposer_drops_the_draft_cost_only():
    spec = GraphDescriptor(GraphKind.SPECULATIVE, 8, token_capacity=4, proposal_depth=3)
    verify = GraphDescriptor(GraphKind.SPECULATIVE, 8, token_capacity=4, proposal_depth=0)
    decode = GraphDescriptor(GraphKind.DECODE, 8)
    for name, base in PROFILES.items():
        copy = profile_for(name, "copy")
        assert copy.duration_ns(spec) == base.duration_ns(verify) < base.duration_ns(spec)
        assert copy.duration_ns(decode) == base.duration_ns(decode)
        assert profile_for(name) is base


def test_flare_runs_speculative_rounds_with_variable_commits():
    arrivals = assign_acceptance(
        make_workload(WorkloadConfig(6, 0.0, (64, 64), (48, 48))), "mixed", seed=0
    )
    cfg = RunConfig(speculative_widths=(2, 4), max_slots=8, warm=True)
    report, sim = simulate(cfg, arrivals)
    assert report["finished"] == 6
    assert all(s.output_tokens == 48 for s in sim.requests.values())
    assert report["speculative_rounds"] > 0 and report["rounds_by_width"]
    fixed, _ = simulate(RunConfig(speculative_widths=(2, 4), max_slots=8,
                                  fixed_speculative_width=1), arrivals)  # fmt: skip
    assert fixed["speculative_rounds"] == 0 and set(fixed["rounds_by_width"]) == {"1"}


def test_cli_speculation_flags(capsys):
    flags = ["--requests", "6", "--output-len", "24", "--speculative-widths", "2,4"]
    assert sim_main([*flags, "--scheduler", "fixed-width", "--fixed-speculative-width", "4",
                     "--acceptance", "low", "--proposer", "copy"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["finished"] == 6 and report["proposer"] == "copy"
    assert set(report["rounds_by_width"]) == {"4"}
    assert set(report["acceptance_by_profile"]) == {"low"}
    assert sim_main([*flags, "--scheduler", "table", "--acceptance", "mixed"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["acceptance_by_profile"]) == {"high", "low", "drifting"}
    assert sim_main([*flags, "--fixed-speculative-width", "2"]) == 0  # flare, fixed width
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["rounds_by_width"]) == {"2"} and report["finished"] == 6
    with pytest.raises(SystemExit):
        sim_main([*flags, "--scheduler", "fixed-width"])
    with pytest.raises(SystemExit):
        sim_main([*flags, "--scheduler", "vllm", "--fixed-speculative-width", "2"])


def test_bench_schedulers_speculation_configs():
    base = RunConfig(speculative_widths=(2, 4))
    cfgs = bench_configs(base, "llama1b-h100", (2, 4))
    assert {"spec-w2", "spec-w4", "table", "global-adaptive", "flare", "vllm"} <= set(cfgs)
    assert cfgs["spec-w4"].fixed_speculative_width == 4
    assert cfgs["flare"].fixed_speculative_width == 0
    assert "table" not in bench_configs(RunConfig(), "llama1b-h100")


def test_bench_catalog_is_what_flare_run_captures():
    assert spec_bench.WIDTHS == (2, 3, 4, 8)
    assert spec_bench.FIXED == (1, 2, 3, 4, 8)
    cfg = RunConfig(speculative_widths=spec_bench.WIDTHS, max_slots=64)
    catalog = spec_bench.flare_run_catalog(cfg)
    speculative = [d for d in catalog if d.kind is GraphKind.SPECULATIVE]
    batches = (1, 2, 4, 8, 16, 32, 64)
    assert speculative == speculative_shapes(batches, (2, 3, 4, 8), 0, True)
    prefix_limit = {(d.batch_capacity, d.token_capacity, d.proposal_depth, d.target_capacity)
                    for d in speculative if d.device_allocated}  # fmt: skip
    assert prefix_limit == {(b, 8, 7, b * 4) for b in batches if b >= 2}
    rectangular = {(d.batch_capacity, d.token_capacity) for d in speculative
                   if not d.device_allocated}  # fmt: skip
    assert rectangular == {(b, w) for b in batches for w in (2, 3, 4, 8)}
    assert all(d.target_capacity == d.batch_capacity * d.token_capacity
               for d in speculative if not d.device_allocated)  # fmt: skip
    # the rest is the simulator's catalog without speculative shapes
    plain = replace(cfg, speculative_widths=()).catalog()
    assert [d for d in catalog if d.kind is not GraphKind.SPECULATIVE] == plain


def test_open_loop_arrivals_are_poisson_at_the_rate():
    rate = 40.0
    arrivals = spec_bench.poisson_population(4000, 64, 16, rate, seed=3)
    times = [a.at_ns / 1e9 for a in arrivals]
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    mean = sum(gaps) / len(gaps)
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert mean == pytest.approx(1 / rate, rel=0.05)  # exponential: mean 1/rate ...
    assert sd / mean == pytest.approx(1.0, abs=0.06)  # ... and coefficient of variation 1
    assert times == sorted(times) and times[0] > 0
    assert sum(g < mean for g in gaps) / len(gaps) == pytest.approx(1 - 1 / 2.718281828, abs=0.03)
    counts = {name: sum(a.acceptance == name for a in arrivals) for name in ACCEPTANCE}
    assert max(counts.values()) - min(counts.values()) <= 1
    assert all(a.spec == RequestSpec(64, 16) for a in arrivals)
    assert arrivals == spec_bench.poisson_population(4000, 64, 16, rate, seed=3)
    assert arrivals != spec_bench.poisson_population(4000, 64, 16, rate, seed=4)
    with pytest.raises(ValueError, match="rate"):
        spec_bench.poisson_population(4, 64, 16, 0.0, seed=0)


def test_every_configuration_sees_the_same_arrivals(monkeypatch):
    seen: dict[tuple[str, str], list[Arrival]] = {}

    def fake_simulate(cfg, arrivals):
        seen[(cfg.scheduler, str(cfg.fixed_speculative_width))] = arrivals
        return {"seed": cfg.seed}, None

    monkeypatch.setattr(spec_bench, "simulate", fake_simulate)
    base = RunConfig(speculative_widths=spec_bench.WIDTHS)
    for workload, rate in (("closed", 0.0), ("open50", 30.0)):
        seen.clear()
        for name in spec_bench.CONFIGS:
            spec_bench._run((workload, name, base, (12, 64, 32, rate), 2))
        assert len(seen) == len(spec_bench.CONFIGS)
        first = next(iter(seen.values()))
        assert all(arrivals == first for arrivals in seen.values())
        if workload == "closed":
            assert {a.at_ns for a in first} == {0}
        else:
            assert first == spec_bench.poisson_population(12, 64, 32, rate, 2)


def test_prefix_limit_rounds_complete_with_their_confidence():
    arrivals = spec_bench.population(8, 64, 48, 0.0, seed=0)
    cfg = RunConfig(speculative_widths=spec_bench.WIDTHS, max_slots=8)
    report, sim = spec_bench.simulate(cfg, arrivals)
    assert report["finished"] == 8
    assert all(s.output_tokens == 48 for s in sim.requests.values())
    # the cold catalog discovers the prefix-limit programs (B = 2, 4, 8): they
    # completed through complete_packed_round with a confidence sidecar
    assert report["prefix_limit_rounds"] >= 3
    assert report["reasons"]["discovery"][0] > 0 and report["top_gap_causes"]
    assert report["last_finisher"][0] in ACCEPTANCE
    # a calibrated draft: high lanes get the rows first
    sim2 = spec_bench.PrefixLimitSimulation(None, PROFILE.duration_ns, [])
    sim2.requests = {i: RequestStats(RequestHandle(i), 0, 64, 100, acceptance=name)
                     for i, name in enumerate(("low", "high", "drifting"))}  # fmt: skip
    lanes = tuple(LaneWork(RequestHandle(i), i, 1, LanePhase.DECODE, 0, 0, 0, 8, 1.0, 1.0, 0.0)
                  for i in range(3))  # fmt: skip
    graph = GraphDescriptor(GraphKind.SPECULATIVE, 4, 8, 7, 16, device_allocated=True)
    plan = ScheduledPlan(1, graph, lanes, 0, SelectionReason.ORDINARY, True, 0, 0,
                         0.0, 0.0, 0.0, 0)  # fmt: skip
    (conditional, joint), rows = sim2.prefix_limit_round(plan)
    assert len(conditional) == len(joint) == 4 and all(len(r) == 7 for r in joint)
    assert conditional[0] == [0.1] * 7 and joint[1][1] == pytest.approx(0.81)
    assert joint[3] == [0.0] * 7  # the padding lane
    assert sum(rows) == 16 and rows[1] == 8 and rows[0] < rows[2]


def test_gap_causes_orders_probe_discovery_prefill_left_out():
    def stats(publications):
        s = RequestStats(RequestHandle(0), 0, 64, 200)
        s.publications_ns = publications
        return s

    # request 0: 99 gaps of 1 and one of 10, request 1: 98 gaps of 1; the top
    # 1 % of the 197 gaps is the one of 10
    sim = SimpleNamespace(requests={0: stats([*range(100), 109]), 1: stats(list(range(99)))})
    for log, cause in (
        ([(105, "ordinary", False, frozenset({1})), (109, "acceptance-learning", False,
                                                     frozenset({0}))], "probe"),
        ([(105, "discovery", False, frozenset({1})), (109, "ordinary", False,
                                                      frozenset({0}))], "discovery"),
        ([(105, "ordinary", True, frozenset({1})), (109, "ordinary", False,
                                                    frozenset({0}))], "prefill"),
        ([(105, "ordinary", False, frozenset({1})), (109, "ordinary", False,
                                                     frozenset({0}))], "left_out"),
        ([(109, "ordinary", False, frozenset({0, 1}))], "round"),
    ):  # fmt: skip
        sim.frame_log = log
        assert spec_bench.gap_causes(sim) == {cause: 1}


def test_open_loop_goals():
    def row(tps, gap):
        return {"output_tokens_per_s": tps, "gap_ms_p99": gap}

    configs = {"adaptive": row(1060, 3.0), "fixed-1": row(900, 2.0), "fixed-2": row(1000, 3.0),
               "global-adaptive": row(1050, 4.0)}  # fmt: skip
    head = spec_bench.open_headline("open50", configs)
    assert head["open50_best_fixed"] == "fixed-2"
    assert head["open50_best_fixed_tokens_per_s"] == 1000
    assert head["open50_global_adaptive_tokens_per_s"] == 1050
    assert head["open50_goal_met"] is True
    configs["adaptive"] = row(1040, 3.0)  # 1.04x best fixed
    assert spec_bench.open_headline("open50", configs)["open50_goals"] == {
        "vs_best_fixed": False, "vs_global_adaptive": False, "gap": True}  # fmt: skip


OPEN_KEYS = [f"open{n}_{key}" for n in (50, 90) for key in (
    "adaptive_tokens_per_s", "best_fixed_tokens_per_s", "global_adaptive_tokens_per_s",
    "adaptive_gap_ms_p99", "best_fixed_gap_ms_p99", "goal_met")]  # fmt: skip
CLOSED_KEYS = ["adaptive_tokens_per_s", "best_fixed_tokens_per_s", "adaptive_gap_ms_p99",
               "best_fixed_gap_ms_p99", "goal_met", "best_fixed", "configs"]  # fmt: skip


def test_bench_speculation_json_has_every_figure(capsys):
    argv = ["--requests", "4", "--open-requests", "6", "--output-len", "8", "--seeds", "1",
            "--jobs", "1"]  # fmt: skip
    assert spec_bench.main(argv) == 0
    out = capsys.readouterr().out
    data = json.loads(out.strip().splitlines()[-1])
    for key in (*CLOSED_KEYS, *OPEN_KEYS, "capacity_req_per_s", "open50", "open90"):
        assert key in data, key
    assert set(data["configs"]) == set(spec_bench.CONFIGS) == set(data["open90"]["configs"])
    cap = data["capacity_req_per_s"]
    assert cap == pytest.approx(data["configs"]["adaptive"]["output_tokens_per_s"] / 8, rel=1e-3)
    rates = data["settings"]["open_rates_per_s"]
    assert rates["open50"] == pytest.approx(0.5 * cap, rel=1e-3)
    assert rates["open90"] == pytest.approx(0.9 * cap, rel=1e-3)
    assert data["open50"]["rate_per_s"] == data["settings"]["open_rates_per_s"]["open50"]
    for workload in ("configs", "open50", "open90"):
        rows = data[workload] if workload == "configs" else data[workload]["configs"]
        assert all(row["finished_all"] for row in rows.values())
    assert "open50: 6 requests, Poisson at" in out and "top-1% gaps by cause" in out


@pytest.mark.process
def test_bench_speculation_quick_ends_with_the_json_figures():
    out = subprocess.run(
        [sys.executable, "scripts/bench_speculation_sim.py", "--quick", "--jobs", "2"],
        capture_output=True, text=True, timeout=600, check=True, cwd=ROOT,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    data = json.loads(lines[-1])
    for key in (*CLOSED_KEYS, *OPEN_KEYS):
        assert key in data
    assert isinstance(data["goal_met"], bool) and isinstance(data["open90_goal_met"], bool)
    expected = {"adaptive", *(f"fixed-{w}" for w in (1, 2, 3, 4, 8)), "table", "global-adaptive"}
    assert set(data["configs"]) == expected
    for rows in (data["configs"], data["open50"]["configs"], data["open90"]["configs"]):
        for row in rows.values():
            assert row["finished_all"] and row["output_tokens_per_s"] > 0
        assert max(rows[f"fixed-{w}"]["output_tokens_per_s"] for w in (1, 2, 3, 4, 8)) in (
            data["best_fixed_tokens_per_s"], data["open50_best_fixed_tokens_per_s"],
            data["open90_best_fixed_tokens_per_s"])  # fmt: skip
    assert data["best_fixed_tokens_per_s"] == max(
        data["configs"][f"fixed-{w}"]["output_tokens_per_s"] for w in (1, 2, 3, 4, 8)
    )
    assert "configuration" in out.stdout and "global-adaptive" in out.stdout
