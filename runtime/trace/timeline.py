"""``flare trace timeline FILE -o timeline.json``: the trace as Chrome trace / Perfetto JSON.

Open the file in https://ui.perfetto.dev or ``chrome://tracing``.  One process,
``flare``, with one track (thread) for the coordinator (``tid`` 0) and one per
rank (``tid`` r + 1).  Times are microseconds from the trace's first plan.

* coordinator: per frame a slice from planning to publication (``plan``), and
  one from its last rank's completion arriving to the completion applied
  (``apply``), when arrivals are known;
* rank r: per frame a slice of the rank's interval (``device_ns``), named by
  the graph.  With rank timestamps it starts at the rank's launch, moved onto
  the coordinator's clock by the rank's clock offset; without them it ends
  when the rank's completion arrived (``args.anchor`` says which).

Every frame slice carries in ``args`` the fence, the graph, the selection
reason, the lanes (request, slot, phase, prompt tokens, committed tokens), the
estimate and the rank's interval, launch wait and timestamps.

``--png FILE`` draws the same tracks with matplotlib, when it is installed.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.trace.files import Trace
from runtime.trace.lines import lane_list

PID = 1
COORDINATOR_TID = 0


class TimelineError(RuntimeError):
    """The timeline cannot be drawn (say, --png without matplotlib)."""


def _us(ns: int, origin: int) -> float:
    return (ns - origin) / 1e3


def _lanes(frame: dict) -> list[dict]:
    return [
        {"request": lane["request"], "slot": lane["slot"], "phase": lane["phase"],
         "prompt_tokens": lane["prompt_tokens"], "tokens": lane["tokens"]}
        for lane in lane_list(frame["lanes"])
    ]  # fmt: skip


def rank_slice(frame: dict, rank: dict, origin: int) -> dict:
    """Rank ``rank``'s slice of ``frame`` (``rank``: the frame's entry for it)."""
    offset = rank.get("clock_offset_ns", 0)
    times = rank.get("host_times") or []
    if len(times) == 4:
        start_ns, anchor = times[1] - offset, "rank launch"
    else:
        end_ns = rank.get("arrived_ns") or frame["applied_ns"]
        start_ns, anchor = end_ns - rank["device_ns"], "completion arrival"
    args: dict[str, Any] = {
        "fence": frame["fence"],
        "graph": frame["graph"],
        "reason": frame["reason"],
        "lanes": _lanes(frame),
        "selected_cost_ns": frame.get("selected_cost_ns"),
        "device_ns": rank["device_ns"],
        "launch_wait_ns": rank.get("launch_wait_ns"),
        "readiness_delay_ns": rank.get("readiness_delay_ns", 0),
        "queued": frame.get("queued"),
        "anchor": anchor,
        "clock_offset_ns": offset,
        "clock_source": rank.get("clock_source"),
    }
    if len(times) == 4:
        names = ("received_us", "launched_us", "ended_us", "published_us")
        args.update({name: _us(t - offset, origin) for name, t in zip(names, times)})
    return {
        "name": frame["graph"],
        "cat": "frame",
        "ph": "X",
        "pid": PID,
        "tid": rank["rank"] + 1,
        "ts": _us(start_ns, origin),
        "dur": rank["device_ns"] / 1e3,
        "args": args,
    }


def coordinator_slices(frame: dict, origin: int) -> list[dict]:
    args = {
        "fence": frame["fence"],
        "graph": frame["graph"],
        "reason": frame["reason"],
        "lanes": _lanes(frame),
        "estimated_ns": frame.get("estimated_ns"),
        "queued": frame.get("queued"),
    }
    out = [
        {"name": "plan", "cat": "coordinator", "ph": "X", "pid": PID, "tid": COORDINATOR_TID,
         "ts": _us(frame["plan_ns"], origin),
         "dur": (frame["sent_ns"] - frame["plan_ns"]) / 1e3, "args": args}
    ]  # fmt: skip
    arrivals = [r.get("arrived_ns") or 0 for r in frame["ranks"]]
    if all(arrivals):
        last = max(arrivals)
        out.append(
            {"name": "apply", "cat": "coordinator", "ph": "X", "pid": PID,
             "tid": COORDINATOR_TID, "ts": _us(last, origin),
             "dur": max(0, frame["applied_ns"] - last) / 1e3,
             "args": {"fence": frame["fence"],
                      "host_wall_ns": frame["applied_ns"] - frame["sent_ns"]}}
        )  # fmt: skip
    return out


def timeline(trace: Trace) -> dict:
    """The Chrome trace JSON object of ``trace``."""
    world = trace.world_size
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "flare"}},
        {"name": "thread_name", "ph": "M", "pid": PID, "tid": COORDINATOR_TID,
         "args": {"name": "coordinator"}},
        {"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": COORDINATOR_TID,
         "args": {"sort_index": 0}},
    ]  # fmt: skip
    for r in range(world):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": PID, "tid": r + 1,
             "args": {"name": f"rank {r}"}}
        )  # fmt: skip
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": r + 1,
             "args": {"sort_index": r + 1}}
        )  # fmt: skip
    origin = min((f["plan_ns"] for f in trace.frames), default=0)
    for frame in trace.frames:
        events += coordinator_slices(frame, origin)
        events += [rank_slice(frame, rank, origin) for rank in frame["ranks"]]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"model": trace.start.get("model", ""), "world_size": world,
                      "frames": len(trace.frames), "dropped": trace.dropped,
                      "origin_monotonic_ns": origin},
    }  # fmt: skip


def write_json(data: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, separators=(",", ":"))


def write_png(data: dict, path: str) -> None:
    """The timeline's tracks drawn with matplotlib (TimelineError if it is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TimelineError(
            "--png needs matplotlib, which is not installed (pip install matplotlib); "
            "the JSON timeline needs nothing"
        ) from None
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    tids = sorted(names)
    bars: dict[int, list[tuple[float, float]]] = {tid: [] for tid in tids}
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            bars[e["tid"]].append((e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3)))
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(tids)))
    for row, tid in enumerate(tids):
        ax.broken_barh(bars[tid], (row - 0.4, 0.8), color="tab:blue" if tid else "tab:orange")
    ax.set_yticks(range(len(tids)), [names[t] for t in tids])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the first plan")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
