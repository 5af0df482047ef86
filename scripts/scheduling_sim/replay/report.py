"""The replay's report: the suite's figures for the recorded run and for its replay.

Both sides go through :func:`scripts.scheduling_sim.metrics.summarize`, the
figures ``scripts/bench_schedulers.py`` reports per workload: tokens/s, TTFT
p50/p99, output gap p50/p99/max, goodput, fairness.  The recorded side is
read from the trace as the coordinator saw it (:class:`RecordedRun`): a
request arrives at its submission; it publishes at each frame that committed
tokens for it, applied, and, with snapshot programs, at its terminal
snapshot's frame, where its response completed (as the simulator publishes a
terminal snapshot's empty finish: both sides count that gap alike).
Fairness prices every request alone with the same measured costs and the host
model's mean frame overhead on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.catalog import GraphDescriptor
from runtime.coordinator.requests import RequestHandle, RequestSpec
from scripts.scheduling_sim.engine import RequestStats, solo_latency_ns
from scripts.scheduling_sim.metrics import summarize
from scripts.scheduling_sim.replay.costs import MeasuredCosts, frame_descriptor
from scripts.scheduling_sim.replay.recorded import Recording

# The figures of the table, in order: (key, label).
TABLE = (
    ("output_tokens_per_s", "output tokens/s"),
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p99", "TTFT p99 ms"),
    ("gap_ms_p50", "gap p50 ms"),
    ("gap_ms_p99", "gap p99 ms"),
    ("gap_ms_max", "gap max ms"),
    ("goodput_req_per_s", "goodput req/s"),
    ("goodput_fraction", "goodput fraction"),
    ("fairness_jain", "fairness (Jain)"),
    ("frames", "frames"),
    ("finished", "finished"),
)


@dataclass
class RecordedRun:
    """The recorded deployment, shaped as :func:`summarize` reads a simulation."""

    requests: dict[int, RequestStats]
    frames: int
    now_ns: int
    busy_ns: int
    frames_by_graph: dict[str, int] = field(default_factory=dict)
    catalog: tuple[GraphDescriptor, ...] | None = None


def recorded_run(recording: Recording) -> RecordedRun:
    t0 = recording.t0_ns
    requests = {}
    for r in recording.requests:
        stats = RequestStats(RequestHandle(r.request), r.submitted_ns - t0, r.prompt_len,
                             r.output_tokens)  # fmt: skip
        stats.publications_ns = [at - t0 for at in r.publications_ns]
        if r.terminal_ns is not None:
            stats.publications_ns.append(r.terminal_ns - t0)
        stats.output_tokens = r.output_tokens
        finished = r.finished_ns
        stats.finished_ns = None if finished is None else finished - t0
        requests[r.request] = stats
    frames = recording.frames
    by_graph: dict[str, int] = {}
    for frame in frames:
        name = frame_descriptor(frame).describe()
        by_graph[name] = by_graph.get(name, 0) + 1
    end = max((f["applied_ns"] for f in frames), default=t0) - t0
    busy = sum(f["device_ns"] for f in frames)
    return RecordedRun(requests, len(frames), end, busy, by_graph)


def solo_function(
    catalog: list[GraphDescriptor], costs: MeasuredCosts, overhead_ns: int
) -> Callable[[RequestStats], int]:
    """A request's latency alone (:func:`solo_latency_ns`) under the measured costs,
    each frame followed by ``overhead_ns`` of host time; cached by size."""
    cache: dict[tuple[int, int], int] = {}

    def solo(stats: RequestStats) -> int:
        key = (stats.prompt_len, stats.output_target)
        if key not in cache:
            spec = RequestSpec(stats.prompt_len, max(1, stats.output_target))
            cache[key] = solo_latency_ns(spec, catalog, costs.duration_ns, overhead_ns)
        return cache[key]

    return solo


def figures(run, solo: Callable[[RequestStats], int], ttft_slo_ms: float, tpot_slo_ms: float):
    """:func:`summarize` of ``run`` (a simulation or a :class:`RecordedRun`)."""
    return summarize(run, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms, solo_ns=solo,
                     speculation=False)  # fmt: skip


def ratios(recorded: dict, replayed: dict) -> dict[str, float | None]:
    """Replayed over recorded, per figure of the table (None where recorded is 0)."""
    out: dict[str, float | None] = {}
    for key, _ in TABLE:
        a, b = recorded.get(key), replayed.get(key)
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and a
        out[key] = round(b / a, 4) if ok else None
    return out


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.1f}"
    return str(value)


def render(report: dict) -> str:
    """The report as readable text (the JSON object follows it on the command line)."""
    head = (
        f"what-if replay of {report['trace']}: {report['requests']} requests "
        f"({len(report['not_replayed'])} not replayed), scheduler {report['scheduler']}, "
        f"policy {report['policy']}, host model {report['host']['host_model']}"
    )
    rows = [("figure", "recorded", "replayed", "replayed/recorded")]
    for key, label in TABLE:
        rows.append((label, _cell(report["recorded"].get(key)), _cell(report["replayed"].get(key)),
                     _cell(report["ratio"].get(key))))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [head, ""]
    for row in rows:
        lines.append("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                           zip(row[1:], widths[1:])]))  # fmt: skip
    divergence = report["first_divergent_frame"]
    lines += ["", "frames: the replay ran the recorded graphs in the recorded order" if divergence
              is None else f"frames: the replay's graphs first differ from the recorded ones at "
              f"frame {divergence} (of {report['recorded']['frames']})"]  # fmt: skip
    priced = report["priced_by_neighbour"]
    if priced:
        lines += ["", "graphs the trace never ran, priced from measured ones:"]
        for p in priced:
            where = "ran in the replay" if p["ran"] else "solo latency only"
            lines.append(f"  {p['graph']}: {p['cost_ns'] / 1e6:.3f} ms, {p['rule']} from "
                         f"{', '.join(p['from'])} ({where})")  # fmt: skip
    for request, why in sorted(report["not_replayed"].items()):
        lines.append(f"not replayed: request {request}: {why}")
    return "\n".join(lines)
