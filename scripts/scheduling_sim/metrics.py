"""Summaries of a simulation: TTFT, output gaps, throughput, Jain fairness."""

from __future__ import annotations

from scripts.scheduling_sim.engine import Simulation


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return float(ordered[int(min(rank, len(ordered))) - 1])


def jain(values: list[float]) -> float:
    if not values:
        return 1.0
    total = sum(values)
    squares = sum(v * v for v in values)
    return (total * total) / (len(values) * squares) if squares > 0 else 1.0


def summarize(sim: Simulation) -> dict:
    stats = list(sim.requests.values())
    ttfts = [s.ttft_ns / 1e6 for s in stats if s.ttft_ns is not None]
    gaps = [g / 1e6 for s in stats for g in s.gaps_ns()]
    output = sum(s.output_tokens for s in stats)
    prompt = sum(s.prompt_len for s in stats)
    end_ns = max((s.finished_ns or sim.now_ns for s in stats), default=sim.now_ns)
    start_ns = min((s.arrival_ns for s in stats), default=0)
    span_s = max(1e-9, (end_ns - start_ns) / 1e9)
    # Per-request service rate while present: (prompt + output tokens) / residence.
    rates = [
        (s.prompt_len + s.output_tokens) / max(1, (s.finished_ns or sim.now_ns) - s.arrival_ns)
        for s in stats
    ]
    return {
        "requests": len(stats),
        "finished": sum(1 for s in stats if s.finished_ns is not None),
        "frames": sim.frames,
        "sim_seconds": round(span_s, 6),
        "ttft_ms_p50": round(percentile(ttfts, 50), 3),
        "ttft_ms_p99": round(percentile(ttfts, 99), 3),
        "ttft_ms_max": round(max(ttfts, default=0.0), 3),
        "gap_ms_p50": round(percentile(gaps, 50), 3),
        "gap_ms_p99": round(percentile(gaps, 99), 3),
        "gap_ms_max": round(max(gaps, default=0.0), 3),
        "output_tokens_per_s": round(output / span_s, 1),
        "total_tokens_per_s": round((output + prompt) / span_s, 1),
        "device_utilization": round(sim.busy_ns / max(1, end_ns - start_ns), 4),
        "jain_fairness": round(jain(rates), 4),
        "frames_by_graph": dict(sorted(sim.frames_by_graph.items())),
    }
