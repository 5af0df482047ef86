"""Translation between the scheduler's plans/records and the wire's frames/completions."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.catalog import GraphKind
from runtime.coordinator.engine.config import EngineError
from runtime.coordinator.engine.stream import RequestStream
from runtime.coordinator.engine.vision_frames import (
    feature_rows,
    restored_generation,
    vision_frame,
    window_restore_start,
)
from runtime.coordinator.plan import LanePhase, LaneWork, ScheduledPlan
from runtime.coordinator.requests import GenerationStart, RequestHandle
from runtime.transport.completion import Completion
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import PHASE_DECODE, PHASE_PREFILL, PHASE_STATE
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams

RUNNABLE_KINDS = (
    GraphKind.PREFILL,
    GraphKind.SCORED_PREFILL,
    GraphKind.DECODE,
    GraphKind.MIXED,
    GraphKind.SPECULATIVE,
    GraphKind.RESTORE,
    GraphKind.SNAPSHOT,
    GraphKind.VISION,
)


@dataclass(slots=True)
class Live:
    """A submitted request the scheduler still knows.

    ``slot``/``generation``: its residency, learnt from its first planned
    lane; ``start``: how that generation begins (cached prefix, copies,
    restored output; None: a plain start).  ``pages``: its page table as the
    scheduler holds it now (it grows as tokens arrive); ``pages_sent``: how
    many of them the ranks have been sent for this generation; frames append
    only the rest (:func:`build_frame`, :func:`mark_pages_sent`).
    ``start_sent``: the generation's first frame is out (it carried the start).
    """

    stream: RequestStream
    handle: RequestHandle
    slot: int = -1
    generation: int = 0
    pages: list[int] = field(default_factory=list)
    pages_sent: int = 0
    start: GenerationStart | None = None
    start_sent: bool = False

    def reside(self, slot: int, generation: int, start: GenerationStart | None) -> None:
        """A new (slot, generation): the ranks start its page table empty."""
        self.slot, self.generation = slot, generation
        self.pages_sent = 0
        self.start, self.start_sent = start, False

    def tokens(self) -> Sequence[int]:
        """The token ids prefill chunks read, by position: the prompt, and for a
        resumed request the output it recomputes."""
        start = self.start
        return start.tokens if start is not None and start.tokens else self.stream.prompt_token_ids


@dataclass(slots=True)
class Dispatch:
    """A published frame awaiting every rank's completion.

    ``plan`` is None for an empty frame: sent to measure the round trip
    (``probe``), or to release retired slots on the ranks when nothing else runs.
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
    probe: bool = False  # an empty frame of a round-trip probe (else, without plan: releases)


def build_frame(
    plan: ScheduledPlan,
    fence: int,
    lives: Sequence[Live],
    release: set[int],
    window_rows: int = 0,
) -> Frame:
    """``plan`` as the frame of ``fence``; ``lives`` in lane order.

    Columns are filled lane by lane.  Prefill: the prompt chunk, written from
    ``prompt_start``, and the request's sampling settings.  Decode: no tokens
    (the ranks hold the pending token); ``position`` is the pending token's KV
    position, prompt + committed + in-flight output - 1, which is
    ``prompt_len + output_start - 1``.  Behind a queued speculative round the
    in-flight output is its bound (the round may commit fewer tokens), so the
    position is an upper bound and the ranks continue from their own slot
    state.  A speculative lane's ``query_len`` and ``commits`` are its query
    length (host allocation) or its ceiling (device allocation).  Every lane
    appends the pages of its request the ranks have not been sent yet
    (``Live.pages_sent``; this does not mark them sent: :func:`mark_pages_sent`
    does, once the frame is out).

    ``release``: retired slots whose rank state may go; a slot that a new
    tenant occupies in this frame is left out (its new generation replaces the
    state anyway).  A mixed plan's ``prompt_row`` is the index of its prefill
    lane (-1 when it has none); it may have at most one.  ``expected_ns``: the
    plan's duration estimate (0 when the scheduler has none).

    A generation's first frame carries its start (``Live.start``, unless
    plain): a restore record (its known tokens, where the output begins), so
    its lane may start past the cached prefix its first pages hold, and the
    copy-on-write page copies the ranks run before the program.

    Images (``window_rows``: the ranks' feature-store window, docs/vision.md): a
    vision plan is a vision frame, a prompt plan reading images carries their
    ``feature_rows``, and window rows are state rows
    (runtime/coordinator/engine/vision_frames.py).
    """
    kind = plan.graph.kind
    if kind not in RUNNABLE_KINDS:
        raise EngineError(f"fence {fence}: the engine cannot run {kind.value} programs yet")
    if kind is GraphKind.VISION:
        return vision_frame(plan, fence, lives, window_rows)
    columns = _FrameColumns()
    for i, (lane, live) in enumerate(zip(plan.lanes, lives, strict=True)):
        columns.add(i, lane, live, fence)
    prompt_row = -1
    if kind is GraphKind.MIXED:
        phase = columns.phase
        prefill = [i for i, (_, p) in enumerate(zip(plan.lanes, phase)) if p == PHASE_PREFILL]
        if len(prefill) > 1:
            raise EngineError(f"fence {fence}: a mixed plan has {len(prefill)} prefill lanes")
        prompt_row = prefill[0] if prefill else -1
    scores: dict = {}
    if kind is GraphKind.SCORED_PREFILL:  # the prompt token after each chunk; top-k
        k = max(live.stream.prompt_logprobs for live in lives)
        scores = {"score_next": array("q", columns.score_next), "score_k": max(0, k)}
    return Frame(
        fence,
        plan.graph,
        slot=array("q", columns.slot),
        generation=array("q", columns.generation),
        phase=array("q", columns.phase),
        position=array("q", columns.position),
        query_len=array("q", columns.query_len),
        commits=array("q", columns.commits),
        prompt_start=array("q", columns.prompt_start),
        prompt_tokens=array("q", columns.prompt_tokens),
        page_count=array("q", columns.page_count),
        pages=array("q", columns.pages),
        sampling=tuple(columns.sampling),
        prompt_row=prompt_row,
        release_slots=tuple(sorted(release.difference(columns.slot))),
        expected_ns=plan.estimated_duration_ns,
        copies=tuple(columns.copies),
        restores=tuple(columns.restores),
        feature_rows=feature_rows(plan, window_rows),
        **scores,
    )


@dataclass(slots=True)
class _FrameColumns:
    """A frame's columns, filled lane by lane (:func:`build_frame`)."""

    slot: list[int] = field(default_factory=list)
    generation: list[int] = field(default_factory=list)
    phase: list[int] = field(default_factory=list)
    position: list[int] = field(default_factory=list)
    query_len: list[int] = field(default_factory=list)
    commits: list[int] = field(default_factory=list)
    prompt_start: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    page_count: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    sampling: list[tuple[int, SamplingParams]] = field(default_factory=list)
    restores: list[tuple[int, Restore]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    score_next: list[int] = field(default_factory=list)  # prefill lanes (scored frames)

    def add(self, i: int, lane: LaneWork, live: Live, fence: int) -> None:
        """Lane ``i`` (``live``'s request) appended to every column."""
        stream = live.stream
        self.slot.append(lane.slot)
        self.generation.append(lane.generation)
        self.prompt_start.append(lane.prompt_start)
        if lane.phase is LanePhase.WINDOW_RESTORE:
            self._window_restore(i, lane, live)
            return
        if lane.phase in (LanePhase.RESTORE, LanePhase.TERMINAL, LanePhase.WINDOW_SNAPSHOT):
            # A state program's row feeds and commits nothing.  A restore starts
            # the new generation: its record, settings and copies; a terminal
            # row drops a known generation.
            self.phase.append(PHASE_STATE)
            self.position.append(lane.prompt_start)
            self.query_len.append(0)
            self.commits.append(0)
            begin = live.start
            if lane.phase is LanePhase.RESTORE:
                if begin is None:
                    raise EngineError(f"fence {fence}: lane {i} restores without a start")
                self.sampling.append((i, stream.sampling))
                self.restores.append((i, Restore(begin.tokens, begin.output_start)))
                self.copies += begin.copies
        elif lane.phase is LanePhase.PREFILL:
            start, count = lane.prompt_start, lane.prompt_tokens
            self.phase.append(PHASE_PREFILL)
            self.position.append(start)
            self.query_len.append(count)
            self.commits.append(lane.max_tokens)
            self.prompt_tokens += live.tokens()[start : start + count]
            prompt, end = stream.prompt_token_ids, start + count
            self.score_next.append(prompt[end] if end < len(prompt) else -1)
            self.sampling.append((i, stream.sampling))
            begin = live.start
            if begin is not None and not live.start_sent and not begin.plain:
                self.restores.append((i, Restore(begin.tokens, begin.output_start)))
                self.copies += begin.copies
        else:
            self.phase.append(PHASE_DECODE)
            self.position.append(len(stream.prompt_token_ids) + lane.output_start - 1)
            self.query_len.append(lane.max_tokens)
            self.commits.append(lane.max_tokens)
        unsent = live.pages[live.pages_sent :]
        self.page_count.append(len(unsent))
        self.pages += unsent

    def _window_restore(self, i: int, lane: LaneWork, live: Live) -> None:
        """A window restore row: the fresh generation at the consumed prompt, every
        page of the request, a restore record of its prompt (nothing emitted)."""
        stream = live.stream
        self.generation[-1] = restored_generation(lane.generation)
        self.phase.append(PHASE_STATE)
        self.position.append(lane.prompt_start)
        self.query_len.append(0)
        self.commits.append(0)
        self.sampling.append((i, stream.sampling))
        prompt = stream.prompt_token_ids
        self.restores.append((i, Restore(tuple(prompt), len(prompt))))
        self.page_count.append(len(live.pages))
        self.pages += live.pages


def mark_pages_sent(lives: Sequence[Live], plan: ScheduledPlan | None = None) -> None:
    """After a frame of ``lives`` is out: the ranks now hold every page of theirs
    (and each generation's start).  A vision frame sends none; a window restore
    row moves its request to the fresh generation, whose start it carried."""
    if plan is not None and plan.graph.kind is GraphKind.VISION:
        return
    for i, live in enumerate(lives):
        lane = plan.lanes[i] if plan is not None else None
        if lane is not None and lane.phase is LanePhase.WINDOW_RESTORE:
            generation = restored_generation(lane.generation)
            start = window_restore_start(live.stream.prompt_token_ids, lane.prompt_start)
            live.reside(lane.slot, generation, start)
            live.stream.generation = generation
        live.pages_sent = len(live.pages)
        live.start_sent = True
