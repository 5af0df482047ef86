"""Translation between the scheduler's plans/records and the wire's frames/completions."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

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
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import GenerationStart, RequestHandle
from runtime.transport.api import TokenLogprobs
from runtime.transport.completion import Completion
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import PHASE_DECODE, PHASE_PREFILL, PHASE_STATE
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import Tensor

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


def completion_records(
    completion: Completion, ignore_eos: Sequence[bool]
) -> list[CompletionRecord]:
    """Rank 0's lane columns as scheduler records; a "stop" of an ignore_eos lane is dropped."""
    records = []
    tokens = completion.tokens
    end = 0
    columns = zip(
        completion.slot, completion.generation, completion.token_count, completion.finished
    )
    for i, (slot, generation, count, finished) in enumerate(columns):
        start, end = end, end + count
        stop = finished and not (i < len(ignore_eos) and ignore_eos[i])
        records.append(
            CompletionRecord(slot, generation, tuple(tokens[start:end]), "stop" if stop else None)
        )
    return records


def check_token_ids(completion: Completion, vocab: int) -> None:
    """Raise EngineError unless rank 0's committed tokens lie in [0, ``vocab``)."""
    tokens = completion.tokens
    if tokens and max(tokens) >= vocab:
        token = max(tokens)
        raise EngineError(
            f"fence {completion.fence}: rank 0 sent token id {token} (entry "
            f"{tokens.index(token)}), outside the vocabulary [0, {vocab})"
        )


def _logprob_sidecars(completion: Completion) -> tuple[Tensor, Tensor] | None:
    """Rank 0's (values, token ids) sidecars; EngineError unless float32 and
    int32 matrices (None: not sent)."""
    values = completion.sidecars.get("logprobs")
    ids = completion.sidecars.get("logprob_token_ids")
    if values is None or ids is None:
        return None
    if (values.dtype, ids.dtype) != ("float32", "int32"):
        raise EngineError(
            f"fence {completion.fence}: logprob sidecars must be float32 values and int32 "
            f"token ids, got {values.dtype} and {ids.dtype}"
        )
    if len(values.shape) != 2 or len(ids.shape) != 2:
        raise EngineError(
            f"fence {completion.fence}: logprob sidecars of shape {list(values.shape)} and "
            f"{list(ids.shape)} do not fit: both must be matrices"
        )
    return values, ids


def _entry(
    fence: int,
    logprob: float,
    ids: Sequence[int],
    values: Sequence[float],
    vocab: int | None,
    sidecar: str = "logprob",
) -> TokenLogprobs:
    """One token's TokenLogprobs; EngineError naming the sidecar for a value that
    is no log probability (NaN, +inf) or a token id outside the vocabulary."""
    if vocab is not None and any(not 0 <= i < vocab for i in ids):
        bad = next(i for i in ids if not 0 <= i < vocab)
        raise EngineError(
            f"fence {fence}: the {sidecar}_token_ids sidecar holds token id {bad}, outside "
            f"the vocabulary [0, {vocab})"
        )
    try:
        return TokenLogprobs(logprob, tuple(ids), tuple(values))
    except ProtocolError as exc:
        raise EngineError(
            f"fence {fence}: the {sidecar} sidecars hold an invalid entry ({exc})"
        ) from None


def lane_logprobs(
    completion: Completion, asked: Sequence[int], vocab: int | None = None
) -> list[TokenLogprobs | None]:
    """Rank 0's log-probability sidecars as one entry per lane (None: not asked).

    ``asked``: each lane's ``SamplingParams.logprobs`` (-1 = none); a lane gets
    its sampled token's log probability and its own top ``asked`` entries.
    ``vocab``: token ids must lie below it.  Sidecars of the wrong dtype or
    shape, values that are no log probabilities and ids outside the vocabulary
    raise EngineError.
    """
    out: list[TokenLogprobs | None] = [None] * len(asked)
    sidecars = _logprob_sidecars(completion)
    if sidecars is None or max(asked, default=-1) < 0:
        return out
    values, ids = sidecars
    rows, width = values.shape[0], values.shape[1]
    if rows < len(asked) or ids.shape != (rows, width - 1):
        raise EngineError(
            f"fence {completion.fence}: logprob sidecars of shape {list(values.shape)} and "
            f"{list(ids.shape)} do not fit {len(asked)} lanes"
        )
    flat, flat_ids = values.values(), cast("list[int]", ids.values())  # the ids column is int32
    k_max = width - 1
    for lane, k in enumerate(asked):
        if k < 0:
            continue
        k = min(k, k_max)
        row = flat[lane * width : (lane + 1) * width]
        top_ids = flat_ids[lane * k_max : lane * k_max + k]
        out[lane] = _entry(completion.fence, row[0], top_ids, row[1 : 1 + k], vocab)
    return out


def token_logprobs(
    completion: Completion, asked: Sequence[int], vocab: int | None = None
) -> list[tuple[TokenLogprobs, ...] | None]:
    """A speculative round's log-probability sidecars (one row per emitted token,
    lanes in order, ``token_count`` rows each) as one tuple per lane (None: not
    asked); EngineError as for :func:`lane_logprobs`."""
    out: list[tuple[TokenLogprobs, ...] | None] = [None] * len(asked)
    sidecars = _logprob_sidecars(completion)
    if sidecars is None or max(asked, default=-1) < 0:
        return out
    values, ids = sidecars
    rows, width = values.shape[0], values.shape[1]
    counts = list(completion.token_count)
    if rows != sum(counts) or ids.shape != (rows, width - 1) or len(counts) < len(asked):
        raise EngineError(
            f"fence {completion.fence}: logprob sidecars of shape {list(values.shape)} and "
            f"{list(ids.shape)} do not fit {sum(counts)} emitted tokens"
        )
    flat, flat_ids = values.values(), cast("list[int]", ids.values())  # the ids column is int32
    k_max = width - 1
    row = 0
    for lane, k in enumerate(asked):
        n = counts[lane]
        if k >= 0:
            k = min(k, k_max)
            out[lane] = tuple(
                _entry(
                    completion.fence,
                    flat[r * width],
                    flat_ids[r * k_max : r * k_max + k],
                    flat[r * width + 1 : r * width + 1 + k],
                    vocab,
                )
                for r in range(row, row + n)
            )
        row += n
    return out


def execution_timing(dispatch: Dispatch, now_ns: int, world: int) -> ExecutionTiming:
    """The scheduler's timing of a completed frame from every rank's answer:
    intervals, launch waits (left out of the cost sample), the largest
    readiness delay, the host wall since dispatch.

    Raises EngineError when the ranks checked each other (``token_crc`` set)
    and one disagrees with rank 0: which rank, which fence.
    """
    answers = dispatch.answers
    rank_ns = tuple(answers[rank].device_ns for rank in range(world))
    waits = tuple(answers[rank].launch_wait_ns for rank in range(world))
    readiness = max(answer.readiness_delay_ns for answer in answers.values())
    reference = answers[0].token_crc
    if reference >= 0:
        for rank in range(1, world):
            if answers[rank].token_crc != reference:
                raise EngineError(
                    f"fence {dispatch.fence}: rank {rank} sampled different tokens than "
                    f"rank 0 (token CRC {answers[rank].token_crc:#010x} against "
                    f"{reference:#010x}): the tensor-parallel ranks disagree"
                )
    return ExecutionTiming(rank_ns, readiness, now_ns - dispatch.sent_ns, dispatch.queued, waits)


def sidecar_rows(completion: Completion, name: str, ndim: int) -> list | None:
    """A float sidecar of rank ``completion`` as nested lists (None: absent).

    Raises EngineError when it is not a ``ndim``-dimensional float32 tensor or
    holds a value that is not a probability (every rank's sidecar must be
    valid; rank 0's drives the decisions, the others need not agree bitwise).
    """
    tensor = completion.sidecars.get(name)
    if tensor is None:
        return None
    if tensor.dtype != "float32" or len(tensor.shape) != ndim:
        raise EngineError(
            f"fence {completion.fence}: rank {completion.rank}'s {name} sidecar must be "
            f"{ndim}-dimensional float32, got {tensor.dtype} {list(tensor.shape)}"
        )
    flat = tensor.values()
    if any(not 0.0 <= v <= 1.0 for v in flat):  # NaN fails both comparisons
        raise EngineError(
            f"fence {completion.fence}: rank {completion.rank}'s {name} sidecar holds values "
            "that are not probabilities"
        )

    def nest(values: list, shape: tuple[int, ...]) -> list:
        if len(shape) == 1:
            return list(values)
        step = len(values) // shape[0] if shape[0] else 0
        return [nest(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]

    return nest(list(flat), tuple(tensor.shape))


def prompt_scores(
    completion: Completion, plan: ScheduledPlan, streams: Sequence[RequestStream], vocab: int
) -> None:
    """A scored prefill's ``prompt_logprobs`` / ``prompt_logprob_token_ids`` sidecars
    (rank 0's, one row per packed prompt token in lane order) into each lane's
    stream: the row of position ``p`` is the entry of prompt token ``p + 1``
    (its log probability, the top ``prompt_logprobs`` alternatives at ``p``),
    kept for ``p + 1`` inside the prompt.  EngineError naming the sidecar for a
    missing sidecar, a wrong dtype or shape, a value that is no log probability
    or a token id outside the vocabulary; nothing is stored then."""
    fence = completion.fence
    values = completion.sidecars.get("prompt_logprobs")
    ids = completion.sidecars.get("prompt_logprob_token_ids")
    if values is None or ids is None:
        raise EngineError(f"fence {fence}: a scored prefill's rank 0 sent no prompt_logprobs")
    if (values.dtype, ids.dtype) != ("float32", "int32"):
        raise EngineError(
            f"fence {fence}: prompt_logprobs sidecars must be float32 values and int32 "
            f"token ids, got {values.dtype} and {ids.dtype}"
        )
    rows = sum(lane.prompt_tokens for lane in plan.lanes)
    k_max = max(0, max(stream.prompt_logprobs for stream in streams))
    if tuple(values.shape) != (rows, 1 + k_max) or tuple(ids.shape) != (rows, k_max):
        raise EngineError(
            f"fence {fence}: prompt_logprobs sidecars of shape {list(values.shape)} and "
            f"{list(ids.shape)}, expected [{rows}, {1 + k_max}] and [{rows}, {k_max}]"
        )
    flat, flat_ids = values.values(), cast("list[int]", ids.values())
    width = 1 + k_max
    found: list[dict[int, TokenLogprobs]] = []
    row = 0
    for lane, stream in zip(plan.lanes, streams, strict=True):
        entries: dict[int, TokenLogprobs] = {}
        k = max(0, stream.prompt_logprobs)
        last = len(stream.prompt_token_ids) - 1  # the prompt's end: no next prompt token
        for i in range(lane.prompt_tokens):
            p = lane.prompt_start + i
            if p < last:
                at = (row + i) * width
                top = flat_ids[(row + i) * k_max : (row + i) * k_max + k]
                values_k = flat[at + 1 : at + 1 + k]
                entry = _entry(fence, flat[at], top, values_k, vocab, "prompt_logprob")
                entries[p + 1] = entry
        found.append(entries)
        row += lane.prompt_tokens
    for stream, entries in zip(streams, found, strict=True):
        stream.prompt_scores.update(entries)
