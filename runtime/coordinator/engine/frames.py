"""Translation between the scheduler's plans/records and the wire's frames/completions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.catalog import GraphKind
from runtime.coordinator.engine.config import EngineError
from runtime.coordinator.engine.stream import RequestStream
from runtime.coordinator.plan import LanePhase, LaneWork, ScheduledPlan
from runtime.coordinator.records import CompletionRecord
from runtime.coordinator.requests import RequestHandle
from runtime.transport.api import TokenLogprobs
from runtime.transport.schema import Completion, Frame, FrameLane, LaneResult

RUNNABLE_KINDS = (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.MIXED)


@dataclass(slots=True)
class Live:
    """A submitted request the scheduler still knows.

    ``slot``/``generation``/``pages``: its residency, learnt from its first
    planned lane (the page table is the whole reservation, fixed while resident).
    """

    stream: RequestStream
    handle: RequestHandle
    slot: int = -1
    generation: int = 0
    pages: tuple[int, ...] = ()


@dataclass(slots=True)
class Dispatch:
    """A published frame awaiting every rank's completion.

    ``plan`` is None for an empty frame sent to measure the round trip.
    ``expected_end_ns``: when the ranks should finish it (its expected start,
    the dispatch or the previous frame's expected end, plus its estimate).
    """

    fence: int
    plan: ScheduledPlan | None
    ignore_eos: tuple[bool, ...]  # per lane
    queued: bool  # dispatched behind another frame
    plan_ns: int
    sent_ns: int
    expected_end_ns: int
    answers: dict[int, Completion] = field(default_factory=dict)  # by rank


def frame_lane(lane: LaneWork, live: Live) -> FrameLane:
    """One lane of a frame.

    Prefill: the prompt chunk, written from ``prompt_start``.  Decode: no
    tokens (the ranks hold the pending token); ``position`` is the pending
    token's KV position, prompt + committed + in-flight output - 1, which is
    ``prompt_len + output_start - 1``.
    """
    stream = live.stream
    if lane.phase is LanePhase.PREFILL:
        start = lane.prompt_start
        return FrameLane(
            lane.slot,
            lane.generation,
            "prefill",
            start,
            stream.prompt_token_ids[start : start + lane.prompt_tokens],
            start,
            live.pages,
            lane.max_tokens,
            stream.sampling,
        )
    return FrameLane(
        lane.slot,
        lane.generation,
        "decode",
        lane.prompt_start,
        (),
        len(stream.prompt_token_ids) + lane.output_start - 1,
        (),  # the ranks keep the slot's pages from its prefill
        1,
        None,  # and its sampling settings
    )


def build_frame(plan: ScheduledPlan, fence: int, lives: Sequence[Live], release: set[int]) -> Frame:
    """``plan`` as the frame of ``fence``; ``lives`` in lane order.

    ``release``: retired slots whose rank state may go; a slot that a new
    tenant occupies in this frame is left out (its new generation replaces the
    state anyway).  A mixed plan's ``prompt_row`` is the index of its prefill
    lane (-1 when it has none); it may have at most one.
    """
    kind = plan.graph.kind
    if kind not in RUNNABLE_KINDS:
        raise EngineError(f"fence {fence}: the engine cannot run {kind.value} programs yet")
    lanes = tuple(frame_lane(lane, live) for lane, live in zip(plan.lanes, lives, strict=True))
    released = tuple(sorted(release - {lane.slot for lane in plan.lanes}))
    prompt_row = -1
    if kind is GraphKind.MIXED:
        prefill = [i for i, lane in enumerate(plan.lanes) if lane.phase is LanePhase.PREFILL]
        if len(prefill) > 1:
            raise EngineError(f"fence {fence}: a mixed plan has {len(prefill)} prefill lanes")
        prompt_row = prefill[0] if prefill else -1
    return Frame(fence, plan.graph, lanes, prompt_row, released)


def completion_records(
    results: Sequence[LaneResult], ignore_eos: Sequence[bool]
) -> list[CompletionRecord]:
    """Rank 0's lane results as scheduler records; a "stop" of an ignore_eos lane is dropped."""
    records = []
    for i, result in enumerate(results):
        reason = result.finish_reason
        if reason == "stop" and i < len(ignore_eos) and ignore_eos[i]:
            reason = None
        records.append(CompletionRecord(result.slot, result.generation, result.tokens, reason))
    return records


def lane_logprobs(completion: Completion, asked: Sequence[int]) -> list[TokenLogprobs | None]:
    """Rank 0's log-probability sidecars as one entry per lane (None: not asked).

    ``asked``: each lane's ``SamplingParams.logprobs`` (-1 = none); a lane gets
    its sampled token's log probability and its own top ``asked`` entries.
    """
    out: list[TokenLogprobs | None] = [None] * len(asked)
    values = completion.sidecars.get("logprobs")
    ids = completion.sidecars.get("logprob_token_ids")
    if values is None or ids is None or max(asked, default=-1) < 0:
        return out
    rows, width = values.shape[0], values.shape[1]
    if rows < len(asked) or ids.shape != (rows, width - 1):
        raise EngineError(
            f"fence {completion.fence}: logprob sidecars of shape {list(values.shape)} and "
            f"{list(ids.shape)} do not fit {len(asked)} lanes"
        )
    flat, flat_ids = values.values(), ids.values()
    k_max = width - 1
    for lane, k in enumerate(asked):
        if k < 0:
            continue
        k = min(k, k_max)
        row = flat[lane * width : (lane + 1) * width]
        top_ids = flat_ids[lane * k_max : lane * k_max + k]
        out[lane] = TokenLogprobs(row[0], tuple(top_ids), tuple(row[1 : 1 + k]))
    return out
