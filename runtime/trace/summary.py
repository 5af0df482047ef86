"""``flare trace summary FILE``: per graph, the estimate against what the ranks took.

For each graph (program) of the trace, and for all frames together:

* ``count``: frames;
* ``estimate``: the scheduler's selected cost at selection, p50 over the frames
  it had one for (``unmeasured``: frames selected with none, discovery);
* ``observed``: the frame's cost sample as the scheduler takes it, max over
  ranks of (interval - launch wait), less the readiness delay: p50 and p99;
* per rank: its interval (``device_ns``) p50 and p99, its launch wait p50 when
  reported, and the share of frames in which it was the slowest;
* ``skew``: largest minus smallest rank interval of a frame, p50 and p99;
* the slowest rank: the rank most often slowest in a frame by interval less
  launch wait (a rank that only waited for a late peer is not slow; the late
  peer is); it "stands out" when its p50 of that also leads every other rank's
  by more than :data:`STANDS_OUT`.

Percentiles are nearest-rank.  Times print in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from runtime.trace.files import Trace

ALL = "all frames"
STANDS_OUT = 0.05  # a slowest rank whose p50 leads the next by more than this is named as such


def percentile(values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile ``q`` in (0, 1] of ``values`` (0 for none)."""
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _wait(rank: dict) -> int:
    return rank.get("launch_wait_ns") or 0


def _execution(rank: dict) -> int:
    """A rank's interval less its wait for the others at the first collective."""
    return max(0, rank["device_ns"] - _wait(rank))


def cost_sample_ns(frame: dict) -> int:
    """The frame's cost sample as the scheduler computes it (``runtime.coordinator.cost``)."""
    ranks = frame["ranks"]
    raw = max((_execution(r) for r in ranks if r["device_ns"] > 0), default=0)
    readiness = max((r.get("readiness_delay_ns") or 0 for r in ranks), default=0)
    return max(0, raw - readiness)


def group_figures(frames: list[dict], world: int) -> dict:
    """The figures of one graph's frames (or all of them)."""
    estimates = [f["selected_cost_ns"] for f in frames if f.get("selected_cost_ns")]
    observed = [cost_sample_ns(f) for f in frames]
    skews = [f["skew_ns"] for f in frames]
    slowest_counts = [0] * world
    for f in frames:
        ranks = f["ranks"]
        slowest = max(range(len(ranks)), key=lambda r: (_execution(ranks[r]), -r))
        slowest_counts[slowest] += 1
    ranks = []
    for r in range(world):
        intervals = [f["ranks"][r]["device_ns"] for f in frames if r < len(f["ranks"])]
        executions = [_execution(f["ranks"][r]) for f in frames if r < len(f["ranks"])]
        waits = [
            f["ranks"][r]["launch_wait_ns"]
            for f in frames
            if r < len(f["ranks"]) and f["ranks"][r].get("launch_wait_ns") is not None
        ]
        ranks.append(
            {
                "rank": r,
                "device_ns": {
                    "p50": percentile(intervals, 0.5),
                    "p99": percentile(intervals, 0.99),
                },
                "execution_ns": {"p50": percentile(executions, 0.5)},
                "launch_wait_ns": {"p50": percentile(waits, 0.5)} if waits else None,
                "slowest_share": slowest_counts[r] / len(frames) if frames else 0.0,
            }
        )
    slowest_rank = max(
        range(world), key=lambda r: (slowest_counts[r], ranks[r]["execution_ns"]["p50"], -r)
    )
    executions = sorted((r["execution_ns"]["p50"] for r in ranks), reverse=True)
    next_p50 = executions[1] if world > 1 else 0
    slow_p50 = ranks[slowest_rank]["execution_ns"]["p50"]
    return {
        "count": len(frames),
        "unmeasured": len(frames) - len(estimates),
        "estimate_ns": {"p50": percentile(estimates, 0.5)},
        "observed_ns": {"p50": percentile(observed, 0.5), "p99": percentile(observed, 0.99)},
        "skew_ns": {"p50": percentile(skews, 0.5), "p99": percentile(skews, 0.99)},
        "ranks": ranks,
        "slowest_rank": slowest_rank,
        # The slowest rank's p50 leads every other by more than STANDS_OUT.
        "stands_out": world > 1
        and slow_p50 > (1 + STANDS_OUT) * next_p50
        and slow_p50 == executions[0],
    }


def summarize(trace: Trace, path: str) -> dict:
    """The summary as one JSON object (``--json``)."""
    world = trace.world_size
    by_graph: dict[str, list[dict]] = {}
    for frame in trace.frames:
        by_graph.setdefault(frame["graph"], []).append(frame)
    graphs = {g: group_figures(fs, world) for g, fs in sorted(by_graph.items(), key=_graph_order)}
    out = {
        "file": path,
        "files": trace.files,
        "frames": len(trace.frames),
        "world_size": world,
        "dropped": trace.dropped,
        "bad_lines": trace.bad_lines,
        "graphs": graphs,
    }
    if trace.frames:
        out[ALL] = group_figures(trace.frames, world)
        out["slowest_rank"] = out[ALL]["slowest_rank"]
    return out


def _graph_order(item: tuple[str, list[dict]]) -> tuple:
    frames = item[1]
    first = frames[0]
    return (first.get("kind", ""), first.get("batch_capacity", 0),
            first.get("prompt_capacity", 0), item[0])  # fmt: skip


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"


def _table(rows: list[list[str]], right: int = 1) -> list[str]:
    """Rows as aligned text; columns from ``right`` on are right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(widths[i]) if i < right else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def render(summary: dict) -> str:
    """The summary as readable tables (times in ms)."""
    files = summary["files"]
    rotated = f" (+{len(files) - 1} rotated)" if len(files) > 1 else ""
    head = (
        f"trace {summary['file']}{rotated}: {summary['frames']} frames, "
        f"{summary['world_size']} ranks, {summary['dropped']} dropped"
    )
    if summary["bad_lines"]:
        head += f", {summary['bad_lines']} unreadable lines skipped"
    if not summary["frames"]:
        return head + "\n(no frames)"
    groups = [*summary["graphs"].items(), (ALL, summary[ALL])]
    rows = [["graph", "count", "est p50", "obs p50", "obs p99", "skew p50", "skew p99",
             "slowest"]]  # fmt: skip
    for name, g in groups:
        est = "-" if g["unmeasured"] == g["count"] else _ms(g["estimate_ns"]["p50"])
        share = g["ranks"][g["slowest_rank"]]["slowest_share"]
        rows.append(
            [name, str(g["count"]), est, _ms(g["observed_ns"]["p50"]), _ms(g["observed_ns"]["p99"]),
             _ms(g["skew_ns"]["p50"]), _ms(g["skew_ns"]["p99"]),
             f"rank {g['slowest_rank']} ({share:.0%})"]
        )  # fmt: skip
    out = [head, "", "per graph (ms): the scheduler's estimate against the observed cost sample",
           *_table(rows)]  # fmt: skip
    rows = [["graph", "rank", "p50", "p99", "wait p50", "slowest in"]]
    for name, g in groups:
        for r in g["ranks"]:
            wait = "-" if r["launch_wait_ns"] is None else _ms(r["launch_wait_ns"]["p50"])
            rows.append(
                [name, str(r["rank"]), _ms(r["device_ns"]["p50"]), _ms(r["device_ns"]["p99"]),
                 wait, f"{r['slowest_share']:.0%}"]
            )  # fmt: skip
    out += ["", "per rank (ms): interval p50/p99, launch wait p50, share of frames slowest",
            *_table(rows, right=1)]  # fmt: skip
    every = summary[ALL]
    slow = every["ranks"][every["slowest_rank"]]
    others = [r["execution_ns"]["p50"] for r in every["ranks"] if r is not slow]
    versus = f" against {_ms(max(others))} ms for the next" if others else ""
    verdict = "" if every["stands_out"] else "; no rank stands out"
    out += [
        "",
        f"slowest rank: {every['slowest_rank']} (slowest in {slow['slowest_share']:.0%} of "
        f"frames; interval less launch wait p50 {_ms(slow['execution_ns']['p50'])} ms"
        f"{versus}{verdict})",
    ]
    return "\n".join(out)
