"""One benchmark run: send a workload, print the table, write the result.

``flare bench`` (runtime/cli/commands/bench.py) resolves its flags into a
:class:`WorkloadSpec`, a :class:`ClientConfig` and :class:`BenchSettings`, then
calls :func:`run_bench`: it sends the requests (Poisson arrivals, or a fixed
concurrency), shows progress (a bar on a terminal, a line every few seconds
otherwise), prints the table, writes ``result_json`` (configuration, summary
and one entry per request) and ends stdout with one JSON line: the
configuration and every figure of the table.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from runtime.loadgen.client import ClientConfig, run_benchmark
from runtime.loadgen.progress import ProgressLines
from runtime.loadgen.report import format_table, per_request, summarize
from runtime.loadgen.workload import WorkloadSpec, arrival_offsets, build_requests


@dataclass(frozen=True)
class BenchSettings:
    """How the requests arrive and what the result reports."""

    request_rate: float = math.inf  # Poisson arrivals in requests/s (inf: all at once)
    concurrency: int | None = None  # keep N in flight instead of the rate
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    result_json: Path | None = None
    config: dict | None = None  # the configuration the result reports


def run_bench(spec: WorkloadSpec, client: ClientConfig, settings: BenchSettings) -> int:
    """Run the benchmark; 0 unless no request succeeded."""
    rate = math.inf if settings.concurrency else settings.request_rate
    offsets = arrival_offsets(spec.num_requests, rate, spec.seed)
    requests = build_requests(spec)
    if sys.stderr.isatty():
        with tqdm(total=spec.num_requests, unit="req") as bar:
            records, duration = asyncio.run(
                run_benchmark(
                    client, requests, offsets, settings.concurrency, lambda _: bar.update()
                )
            )
    else:  # a log or a pipe: a line every few seconds, not a bar
        lines = ProgressLines(spec.num_requests)
        work = run_benchmark(client, requests, offsets, settings.concurrency, lines.update)
        records, duration = asyncio.run(lines.run(work))

    summary = summarize(records, duration, settings.ttft_slo_ms, settings.tpot_slo_ms)
    result = {"config": settings.config, **summary}
    print(format_table(summary))
    if settings.result_json is not None:
        full = {**result, "requests": per_request(records)}
        settings.result_json.write_text(json.dumps(full, indent=2, allow_nan=False) + "\n")
    print(json.dumps(result, allow_nan=False), flush=True)
    return 0 if summary["completed"] else 1
