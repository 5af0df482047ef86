"""Seeded synthetic workloads: arrivals, prompt and output lengths, message endpoints."""

from __future__ import annotations

import random
from dataclasses import dataclass

from runtime.coordinator import RequestSpec


@dataclass(frozen=True)
class Arrival:
    at_ns: int
    spec: RequestSpec


@dataclass(frozen=True)
class WorkloadConfig:
    requests: int = 16
    arrival_rate_per_s: float = 0.0  # 0: everything arrives at t=0; else Poisson
    prompt_len: tuple[int, int] = (64, 64)  # uniform inclusive range
    output_len: tuple[int, int] = (128, 128)
    messages: tuple[int, int] = (1, 1)  # message count per prompt (endpoints between)
    seed: int = 0


def make_workload(cfg: WorkloadConfig) -> list[Arrival]:
    rng = random.Random(cfg.seed)
    t_ns = 0.0
    out: list[Arrival] = []
    for _ in range(cfg.requests):
        if cfg.arrival_rate_per_s > 0:
            t_ns += rng.expovariate(cfg.arrival_rate_per_s) * 1e9
        prompt = rng.randint(*cfg.prompt_len)
        output = rng.randint(*cfg.output_len)
        n_msgs = min(prompt, rng.randint(*cfg.messages))
        endpoints = tuple(sorted(rng.sample(range(1, prompt), n_msgs - 1))) if n_msgs > 1 else ()
        spec = RequestSpec(prompt, output, message_endpoints=endpoints)
        out.append(Arrival(int(t_ns), spec))
    return out
