"""The simulator's workloads: distributions, make_workload and the suite builders."""

from __future__ import annotations

import random
import statistics
from itertools import pairwise

import pytest

from runtime.coordinator.requests import RequestSpec
from scripts.scheduling_sim.workload import (
    CHAT_OUTPUT,
    CHAT_PROMPT,
    TOKEN_STRIDE,
    Arrival,
    ChatSharedConfig,
    LogNormal,
    TwoTenantsConfig,
    Uniform,
    WorkloadConfig,
    burst,
    chat,
    chat_shared,
    long_prompt_contention,
    make_workload,
    two_tenants,
)


def _reference_make_workload(cfg: WorkloadConfig) -> list[tuple[int, RequestSpec]]:
    """make_workload as it was before distributions and tenants."""
    rng = random.Random(cfg.seed)
    t_ns = 0.0
    out = []
    for _ in range(cfg.requests):
        if cfg.arrival_rate_per_s > 0:
            t_ns += rng.expovariate(cfg.arrival_rate_per_s) * 1e9
        prompt = rng.randint(*cfg.prompt_len)
        output = rng.randint(*cfg.output_len)
        n_msgs = min(prompt, rng.randint(*cfg.messages))
        endpoints = tuple(sorted(rng.sample(range(1, prompt), n_msgs - 1))) if n_msgs > 1 else ()
        out.append((int(t_ns), RequestSpec(prompt, output, message_endpoints=endpoints)))
    return out


@pytest.mark.parametrize(
    "cfg",
    [
        WorkloadConfig(),
        WorkloadConfig(12, 200.0, (64, 700), (8, 40), (1, 3), seed=7),
        WorkloadConfig(30, 20.0, (64, 4096), (16, 512), seed=3),
    ],
)
def test_make_workload_unchanged_for_existing_callers(cfg):
    got = make_workload(cfg)
    assert [(a.at_ns, a.spec) for a in got] == _reference_make_workload(cfg)
    assert all(a.tenant == 0 for a in got)


def test_arrival_keeps_positional_form():
    a = Arrival(5, RequestSpec(1, 1))
    assert a.tenant == 0 and Arrival(5, RequestSpec(1, 1), tenant=2).tenant == 2


def test_lognormal_median_sigma_and_clip():
    dist = LogNormal(median=200, sigma=1.0, lo=4, hi=4096)
    rng = random.Random(1)
    xs = [dist.sample(rng) for _ in range(20000)]
    assert min(xs) >= 4 and max(xs) <= 4096
    assert 185 <= statistics.median(xs) <= 215
    # sigma: the 84th percentile sits about e^sigma above the median.
    p84 = sorted(xs)[int(0.8413 * len(xs))]
    assert 2.5 <= p84 / statistics.median(xs) <= 3.0
    clipped = LogNormal(median=1000, sigma=2.0, lo=10, hi=20)
    assert {clipped.sample(rng) for _ in range(200)} <= set(range(10, 21))
    assert LogNormal(50, 0.0, 1, 100).sample(rng) == 50
    with pytest.raises(ValueError):
        LogNormal(100, 1.0, 5, 4)


def test_make_workload_with_distributions():
    cfg = WorkloadConfig(50, 0.0, CHAT_PROMPT, Uniform(8, 16), seed=2)
    arrivals = make_workload(cfg)
    assert arrivals == make_workload(cfg)
    assert all(4 <= a.spec.prompt_len <= 4096 for a in arrivals)
    assert all(8 <= a.spec.max_output_tokens <= 16 for a in arrivals)


def test_burst():
    arrivals = burst()
    assert len(arrivals) == 64 and all(a.at_ns == 0 for a in arrivals)
    assert arrivals == burst() and arrivals != burst(seed=1)
    assert len(burst(requests=8)) == 8


def test_chat_shape_and_rate():
    arrivals = chat(50.0, 400, seed=4)
    assert len(arrivals) == 400 and arrivals == chat(50.0, 400, seed=4)
    times = [a.at_ns for a in arrivals]
    assert times == sorted(times) and times[0] > 0
    # Poisson at 50/s: 400 arrivals take about 8 s.
    assert 6.5e9 < times[-1] < 9.5e9
    prompts = [a.spec.prompt_len for a in arrivals]
    outputs = [a.spec.max_output_tokens for a in arrivals]
    assert 160 <= statistics.median(prompts) <= 250
    assert 160 <= statistics.median(outputs) <= 250
    assert max(prompts) > 1500 and max(prompts) <= CHAT_PROMPT.hi
    assert max(outputs) <= CHAT_OUTPUT.hi
    assert statistics.mean(prompts) > statistics.median(prompts)  # a long tail


def test_long_prompt_contention():
    arrivals = long_prompt_contention()
    assert arrivals == long_prompt_contention()
    streams = [a for a in arrivals if a.at_ns == 0]
    longs = [a for a in arrivals if a.at_ns > 0]
    assert 8 <= len(streams) <= 16 and 3 <= len(longs) <= 8
    assert all(a.spec.prompt_len <= 256 and a.spec.max_output_tokens >= 1024 for a in streams)
    assert all(2048 <= a.spec.prompt_len <= 8192 for a in longs)
    assert all(a.spec.max_output_tokens <= 256 for a in longs)
    assert min(a.at_ns for a in longs) >= 100e6
    assert len(long_prompt_contention(streams=16)) == 16 + len(longs)


def test_two_tenants():
    arrivals = two_tenants(20.0)
    assert arrivals == two_tenants(20.0)
    assert [a.at_ns for a in arrivals] == sorted(a.at_ns for a in arrivals)
    flood = [a for a in arrivals if a.tenant == 0]
    steady = [a for a in arrivals if a.tenant == 1]
    cfg = TwoTenantsConfig()
    assert len(flood) == cfg.flood_requests and len(steady) == cfg.steady_requests
    flood_rate = len(flood) / (flood[-1].at_ns / 1e9)
    assert flood_rate > 2 * 20.0  # well above capacity
    gaps = {b.at_ns - a.at_ns for a, b in pairwise(steady)}
    assert max(gaps) - min(gaps) <= 1 and min(gaps) == pytest.approx(1e9 / 5.0, abs=1)
    # The steady tenant keeps sending while the flood's backlog lasts.
    assert steady[-1].at_ns > flood[-1].at_ns
    assert len(two_tenants(10.0, steady_requests=4)) == cfg.flood_requests + 4
    assert two_tenants() == two_tenants(TwoTenantsConfig().capacity_req_per_s)
    with pytest.raises(TypeError):
        two_tenants(10.0, nonsense=1)


def test_chat_shared_is_deterministic_and_shaped_as_documented():
    arrivals = chat_shared()
    cfg = ChatSharedConfig()
    assert arrivals == chat_shared() and arrivals != chat_shared(seed=1)
    assert len(arrivals) == cfg.requests == 200
    times = [a.at_ns for a in arrivals]
    assert times == sorted(times) and times[0] > 0
    # Poisson at 70/s: 200 arrivals take about 2.9 s.
    assert 2.2e9 < times[-1] < 3.6e9
    systems: dict[tuple[int, ...], int] = {}
    user_ids: set[int] = set()
    for a in arrivals:
        spec = a.spec
        (end,) = spec.message_endpoints
        assert len(spec.prompt_tokens) == spec.prompt_len > end
        assert end % cfg.page_size == 0 and 512 <= end <= 2000  # whole pages
        system, user = spec.prompt_tokens[:end], spec.prompt_tokens[end:]
        systems[system] = systems.get(system, 0) + 1
        assert not user_ids & set(user), "user message ids must be unique per request"
        user_ids |= set(user)
        assert 1 <= spec.max_output_tokens <= CHAT_OUTPUT.hi
    # A handful of system prompts, pairwise disjoint, none sharing an id with a user.
    assert 4 <= len(systems) <= cfg.system_prompts == 6
    system_ids = [set(s) for s in systems]
    assert sum(map(len, system_ids)) == len(set().union(*system_ids))
    assert not user_ids & set().union(*system_ids)
    # Zipf-like: the first system prompt (the smallest ids) is the most popular.
    counts = sorted(systems.items(), key=lambda kv: kv[0][0])
    assert counts[0][1] == max(systems.values()) and counts[0][1] > len(arrivals) / 4
    users = [a.spec.prompt_len - a.spec.message_endpoints[0] for a in arrivals]
    assert 150 <= statistics.median(users) <= 260 and max(users) <= CHAT_PROMPT.hi


def test_chat_shared_takes_overrides_and_is_alone_in_naming_tokens():
    assert len(chat_shared(50.0, 10)) == 10
    one = chat_shared(n=20, system_prompts=1)
    assert len({a.spec.prompt_tokens[: a.spec.message_endpoints[0]] for a in one}) == 1
    assert chat_shared(n=5, cfg=ChatSharedConfig(seed=3)) == chat_shared(n=5, seed=3)
    with pytest.raises(TypeError):
        chat_shared(nonsense=1)
    with pytest.raises(ValueError):
        chat_shared(system_prompts=0)
    with pytest.raises(ValueError):
        chat_shared(system_pages=Uniform(TOKEN_STRIDE // 16, TOKEN_STRIDE // 16))
    # The other suite workloads name no tokens: they neither reuse nor publish pages.
    for arrivals in (burst(), chat(10.0, 20), long_prompt_contention(), two_tenants(20.0)):
        assert all(a.spec.prompt_tokens == () for a in arrivals)
