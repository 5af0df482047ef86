"""Rank answers as the scheduler's records and the streams' sidecars: rank 0's
lane columns as completion records, the token-id check, the log-probability and
prompt-score sidecars per lane, and a frame's execution timing (the maximum
interval across ranks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from runtime.coordinator.engine.config import EngineError
from runtime.coordinator.engine.frames import Dispatch
from runtime.coordinator.engine.stream import RequestStream
from runtime.coordinator.plan import ScheduledPlan
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.transport.api import TokenLogprobs
from runtime.transport.completion import Completion
from runtime.transport.fields import ProtocolError
from runtime.transport.tensor import Tensor


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
