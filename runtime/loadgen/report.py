"""Serving metrics from request records, as a flat dict and a readable table.

The definitions follow common serving benchmarks (vLLM's benchmark_serving), so
figures compare across tools:

* TTFT: arrival of the first output chunk minus the send time.
* TPOT: (end - first token) / (output tokens - 1), for requests of > 1 token.
* ITL: gaps between consecutive output chunks, pooled over all requests.
* E2EL: end of the response minus the send time.
* goodput: successful requests per second whose TTFT and TPOT are both within
  the SLOs given (a one-token request has no TPOT and meets that SLO).

Latencies cover successful requests only; rates divide by the run's wall time.
The table prints exactly the dict's figures, so the JSON holds all it shows.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from runtime.loadgen.client import RequestRecord

LATENCIES: dict[str, str] = {
    "ttft": "Time to first token",
    "tpot": "Time per output token (excl. 1st)",
    "itl": "Inter-token latency",
    "e2el": "End-to-end latency",
}

_ROWS: tuple[tuple[str, str], ...] = (
    ("completed", "Successful requests"),
    ("failed", "Failed requests"),
    ("duration_s", "Benchmark duration (s)"),
    ("total_input_tokens", "Total input tokens"),
    ("total_output_tokens", "Total generated tokens"),
    ("request_throughput", "Request throughput (req/s)"),
    ("output_throughput", "Output token throughput (tok/s)"),
    ("total_token_throughput", "Total token throughput (tok/s)"),
    ("ttft_slo_ms", "TTFT SLO (ms)"),
    ("tpot_slo_ms", "TPOT SLO (ms)"),
    ("good_requests", "Requests meeting the SLOs"),
    ("request_goodput", "Request goodput (req/s)"),
)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def request_latencies(record: RequestRecord) -> dict[str, Any]:
    """TTFT, TPOT (None below two tokens), ITLs and E2EL of one request, in ms."""
    first = record.first_token_time
    times = record.chunk_times
    tpot = None
    if first is not None and record.output_tokens > 1:
        tpot = 1000 * (record.end_time - first) / (record.output_tokens - 1)
    return {
        "ttft": None if first is None else 1000 * (first - record.send_time),
        "tpot": tpot,
        "itl": [1000 * (b - a) for a, b in itertools.pairwise(times)],
        "e2el": 1000 * (record.end_time - record.send_time),
    }


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
) -> dict[str, Any]:
    """Every figure of a run: counts, rates, mean/median/p99 of each latency (None
    where nothing was measured), goodput (None without SLOs) and ``errors``, a
    map from error text to how many requests failed with it."""
    ok = [r for r in records if r.success]
    per_request = [request_latencies(r) for r in ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_slo_ms": ttft_slo_ms,
        "tpot_slo_ms": tpot_slo_ms,
        "good_requests": None,
        "request_goodput": None,
    }
    if ttft_slo_ms is not None or tpot_slo_ms is not None:
        good = sum(
            (ttft_slo_ms is None or (x["ttft"] is not None and x["ttft"] <= ttft_slo_ms))
            and (tpot_slo_ms is None or x["tpot"] is None or x["tpot"] <= tpot_slo_ms)
            for x in per_request
        )
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration_s
    for name in LATENCIES:
        if name == "itl":
            values = [gap for x in per_request for gap in x["itl"]]
        else:
            values = [x[name] for x in per_request if x[name] is not None]
        summary[f"mean_{name}_ms"] = statistics.fmean(values) if values else None
        summary[f"median_{name}_ms"] = percentile(values, 50) if values else None
        summary[f"p99_{name}_ms"] = percentile(values, 99) if values else None
    summary["errors"] = dict(Counter(r.error for r in records if not r.success))
    return summary


def per_request(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """One JSON-ready entry per request, for the result file."""
    return [
        {
            "index": r.index,
            "error": r.error,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            **{f"{name}_ms": value for name, value in request_latencies(r).items()},
        }
        for r in records
    ]


def _format(value: Any) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def format_table(summary: dict[str, Any]) -> str:
    """The summary as aligned ``label  value`` lines, latencies by section, then
    the error texts with their counts."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]
    lines += [f"{label + ':':<40}{_format(summary[key]):>10}" for key, label in _ROWS]
    for name, title in LATENCIES.items():
        lines.append(f" {title} ".center(width, "-"))
        for stat in ("mean", "median", "p99"):
            label = f"{'P99' if stat == 'p99' else stat.capitalize()} {name.upper()} (ms):"
            lines.append(f"{label:<40}{_format(summary[f'{stat}_{name}_ms']):>10}")
    if summary["errors"]:
        lines.append(" Errors (count x text) ".center(width, "-"))
        lines += [f"{count:>6} x {text}" for text, count in summary["errors"].items()]
    lines.append("=" * width)
    return "\n".join(lines)
