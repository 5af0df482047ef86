"""What one trace line holds: a committed frame, from plan to applied completion.

A frame line (``"event": "frame"``) has, besides ``fence``:

* the scheduler's :class:`~runtime.coordinator.plan.TraceRecord`, field for
  field (physical B/D/W/P, ``selected_cost_ns``, ``observation_age_ns``,
  ``reason``, the exploration credits, ``value_rate_scaled`` ...), and
  ``estimated_ns``, the plan's duration estimate;
* coordinator timestamps on its ``time.monotonic_ns`` clock: ``plan_ns``
  (planning began), ``sent_ns`` (just before publication), ``applied_ns``
  (every rank answered, the completion applied), and ``queued`` (dispatched
  behind another frame);
* ``lanes``: columns, one entry per lane in lane order (as on the wire):
  ``request``, ``slot``, ``generation``, ``phase`` ("prefill"/"decode"),
  ``prompt_start``, ``prompt_tokens``, ``output_start``, ``max_tokens``,
  ``token_count`` (tokens committed), ``finished`` (0/1, an EOS), and
  ``tokens``: every lane's committed token ids in lane order (rank 0's results);
* ``ranks``: per rank ``device_ns`` (its interval), ``readiness_delay_ns``,
  ``launch_wait_ns`` (null when the rank does not report it), ``host_times``
  (received, launched, ended, published on the rank's clock, as reported;
  empty when not), ``stage_ns`` (host stages, empty when not reported),
  ``arrived_ns`` (its completion reached the coordinator), and its clock
  estimate (:mod:`runtime.trace.clocks`);
* ``device_ns`` (the largest rank interval), ``skew_ns`` (largest - smallest);
* ``dropped``: lines the writer had dropped so far (added by the writer).

A request line (``"event": "request"``) is written when the engine admits a
request to the scheduler: ``request`` (the scheduler's id, as in frame lines'
``requests``), ``submitted_ns`` (``Engine.submit`` took it) and ``admitted_ns``
(the engine thread handed it to the scheduler), both on the coordinator's
clock, ``prompt_tokens``, ``max_tokens``, and ``fence``: the first fence that
could carry it (frames before it were planned without it).  So a trace says
how long a request waited for its first frame, and which frames ran meanwhile.
Since format 2 it also holds the request as the scheduler was given it:
``message_endpoints`` and ``boundaries`` (prompt positions), ``ignore_eos``,
``group``, and ``prompt_pages``/``prompt_tail``: the prompt's content as
digests, not tokens (:func:`runtime.trace.outcomes.prompt_digests`), so a
replay can tell which prompts share a cached prefix.

A finish line (``"event": "finish"``, format 2) says how a request ended:
``output_tokens`` it produced, ``finish_reason`` ("stop", "length",
"cancelled", or "unfinished" when the trace closed first), ``cancelled``,
``at_ns`` (coordinator clock) and ``fence`` (the frame that finished it; for a
cancel, the next fence).  See :mod:`runtime.trace.outcomes`.

A scheduler line (``"event": "scheduler"``, format 2), before the first
request line: ``scheduler`` (its class), ``config`` (the ``SchedulerConfig``
fields), ``policy`` (the ``PolicyConfig`` fields, null without one) and
``preset`` (the preset they equal, if any).  Later files' start lines carry
the same under ``"scheduler"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from runtime.coordinator.plan import ScheduledPlan, TraceRecord
from runtime.trace.clocks import ClockEstimate
from runtime.transport.completion import STAGE_NAMES

# Stage names of Completion.stage_ns, in order (the ranks' host stages).
STAGES = STAGE_NAMES  # a rank's host stages, as its completion carries them


def lane_columns(plan: ScheduledPlan, rank0: Any) -> dict[str, list]:
    """The lanes of ``plan`` as columns, with what rank 0 committed for them."""
    lanes = plan.lanes
    n = len(lanes)
    counts = list(getattr(rank0, "token_count", ()))[:n]
    finished = list(getattr(rank0, "finished", ()))[:n]
    return {
        "request": [lane.handle.id for lane in lanes],
        "slot": [lane.slot for lane in lanes],
        "generation": [lane.generation for lane in lanes],
        "phase": [lane.phase.value for lane in lanes],
        "prompt_start": [lane.prompt_start for lane in lanes],
        "prompt_tokens": [lane.prompt_tokens for lane in lanes],
        "output_start": [lane.output_start for lane in lanes],
        "max_tokens": [lane.max_tokens for lane in lanes],
        "token_count": counts + [0] * (n - len(counts)),
        "finished": finished + [0] * (n - len(finished)),
        "tokens": list(getattr(rank0, "tokens", ())),
    }


def lane_list(columns: dict[str, list]) -> list[dict]:
    """A line's lane columns as one dict per lane, each with its own ``tokens``."""
    out = []
    end = 0
    for i in range(len(columns["request"])):
        lane = {name: values[i] for name, values in columns.items() if name != "tokens"}
        start, end = end, end + lane["token_count"]
        lane["tokens"] = columns["tokens"][start:end]
        out.append(lane)
    return out


def rank_rows(
    completions: Sequence[Any], arrivals: Sequence[int] | None, clocks: Sequence[ClockEstimate]
) -> list[dict]:
    """Each rank's interval, delays, timestamps as reported, arrival and clock estimate."""
    rows = []
    for rank, c in enumerate(completions):
        wait = getattr(c, "launch_wait_ns", None)
        row = {
            "rank": rank,
            "device_ns": c.device_ns,
            "readiness_delay_ns": c.readiness_delay_ns,
            "launch_wait_ns": wait,
            "host_times": list(getattr(c, "host_times", ())),
            "stage_ns": list(getattr(c, "stage_ns", ())),
            "arrived_ns": arrivals[rank] if arrivals else 0,
        }
        row.update(clocks[rank].to_json())
        rows.append(row)
    return rows


def frame_line(
    fence: int,
    record: TraceRecord | None,
    plan: ScheduledPlan,
    queued: bool,
    plan_ns: int,
    sent_ns: int,
    applied_ns: int,
    completions: Sequence[Any],
    arrivals: Sequence[int] | None,
    clocks: Sequence[ClockEstimate],
) -> dict:
    """The trace line of frame ``fence``, applied; ``completions`` by rank.

    ``record`` is None only if the scheduler's own trace dropped it; the line
    then takes what it can from the plan.
    """
    graph = plan.graph
    line: dict[str, Any] = {"event": "frame"}
    if record is not None:
        line.update(record.to_json())
        line["requests"] = list(record.requests)
    else:
        line.update(
            fence=fence, committed_at_ns=0, graph=graph.describe(), kind=graph.kind.value,
            batch_capacity=graph.batch_capacity, token_capacity=graph.token_capacity,
            proposal_depth=graph.proposal_depth, target_capacity=graph.target_capacity,
            prompt_capacity=graph.prompt_capacity, active_rows=len(plan.lanes),
            selected_cost_ns=plan.estimated_duration_ns, observation_age_ns=None,
            reason=plan.reason.value, requests=[lane.handle.id for lane in plan.lanes],
        )  # fmt: skip
    line["estimated_ns"] = plan.estimated_duration_ns
    line.update(queued=queued, plan_ns=plan_ns, sent_ns=sent_ns, applied_ns=applied_ns)
    line["lanes"] = lane_columns(plan, completions[0])
    ranks = rank_rows(completions, arrivals, clocks)
    line["ranks"] = ranks
    intervals = [row["device_ns"] for row in ranks]
    line["device_ns"] = max(intervals)
    line["skew_ns"] = max(intervals) - min(intervals)
    return line


def request_line(
    fence: int,
    request: int,
    submitted_ns: int,
    admitted_ns: int,
    prompt_tokens: int,
    max_tokens: int,
    **given: Any,
) -> dict:
    """The trace line of a request admitted before frame ``fence`` was planned;
    ``given``: the format-2 fields (see the module docstring)."""
    line = {
        "event": "request", "fence": fence, "request": request,
        "submitted_ns": submitted_ns, "admitted_ns": admitted_ns,
        "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
    }  # fmt: skip
    line.update(given)
    return line


def finish_line(
    fence: int, request: int, output_tokens: int, reason: str, cancelled: bool, at_ns: int
) -> dict:
    """How request ``request`` ended (see the module docstring)."""
    return {
        "event": "finish", "fence": fence, "request": request, "output_tokens": output_tokens,
        "finish_reason": reason, "cancelled": cancelled, "at_ns": at_ns,
    }  # fmt: skip


def scheduler_fields(scheduler: Any, presets: dict[str, Any]) -> dict:
    """What a trace says of the scheduler: its class, configuration and policy.

    ``presets``: the named policies, to name the one ``scheduler.policy`` equals.
    """
    config = getattr(scheduler, "config", None)
    policy = getattr(scheduler, "policy", None)
    fields = {
        "scheduler": type(scheduler).__name__,
        "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None,
        "policy": dataclasses.asdict(policy) if dataclasses.is_dataclass(policy) else None,
        "preset": next((name for name, p in presets.items() if p == policy), None),
    }
    return fields


def start_fields(model: str, world_size: int, programs: Sequence[str], pid: int) -> dict:
    """What every trace file's start line says about the deployment."""
    return {
        "model": model,
        "world_size": world_size,
        "programs": list(programs),
        "pid": pid,
        "clock": "time.monotonic_ns",
        "stages": list(STAGES),
    }
