"""Image plans as wire frames (docs/vision.md): vision frames, the feature rows a
prompt frame reads, and the ranks' side of a window transition.

* **A vision plan** (``ScheduledPlan.vision_images``) becomes
  :meth:`Frame.vision <runtime.transport.frame.Frame.vision>`: per image its
  store row ``window_slot * window_rows + offset`` and its preprocessed pixels
  (the request's :class:`~runtime.coordinator.engine.submission.RequestImages`),
  concatenated in frame order.  It carries no lanes; its completion has none,
  so the scheduler's records (one per plan lane, no tokens) are made here
  (:func:`plan_records`).
* **A prompt plan that reads images** (``ScheduledPlan.image_reads``) gets a
  ``feature_rows`` column, one entry per token of the frame's ``prompt_tokens``:
  the store row of each image token, -1 for text (:func:`feature_rows`).
* **Window transitions.** On these ranks a request's state is its KV pages,
  which the scheduler keeps through the transition, plus its slot rows (position,
  sampling step, penalty and history rows).  The window snapshot is a terminal
  row of the old generation: the ranks drop its slot rows; the pages are
  untouched, partial pages included.  The window restore is a restore row of
  the fresh generation (the slot's next, ``SlotPool.renew``) at the consumed
  prompt position, with every page and a restore record of the prompt
  (nothing emitted), from which the ranks rebuild the slot rows exactly as a
  computed prefix leaves them; the next prefill continues that generation.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from runtime.catalog import GraphKind
from runtime.coordinator.engine.config import EngineError
from runtime.coordinator.plan import LanePhase, ScheduledPlan
from runtime.coordinator.records import CompletionRecord
from runtime.coordinator.requests import GenerationStart
from runtime.transport.frame import Frame

IMAGE_LANE_PHASES = frozenset(
    {LanePhase.VISION, LanePhase.WINDOW_SNAPSHOT, LanePhase.WINDOW_RESTORE}
)


def vision_frame(plan: ScheduledPlan, fence: int, lives: Sequence, window_rows: int) -> Frame:
    """``plan`` (a VISION plan) as its frame: each image's store row and pixels."""
    by_handle = {live.handle.id: live for live in lives}
    bases: list[int] = []
    pixels: list[bytes] = []
    for image in plan.vision_images:
        live = by_handle.get(image.handle.id)
        images = None if live is None else live.stream.images
        if images is None:
            raise EngineError(
                f"fence {fence}: request {image.handle.id}'s image {image.span} has no pixels"
            )
        data, _shape = images.pixels(image.span)
        bases.append(image.window_slot * window_rows + image.offset)
        pixels.append(data)
    if not bases:
        raise EngineError(f"fence {fence}: a vision plan with no images")
    return Frame.vision(
        fence, plan.graph, bases, b"".join(pixels), expected_ns=plan.estimated_duration_ns
    )


def feature_rows(plan: ScheduledPlan, window_rows: int) -> array:
    """The ``feature_rows`` column of a prompt plan (empty when it reads no image):
    for each token of the frame's ``prompt_tokens`` (the prompt lanes' chunks in
    lane order) the store row it reads, -1 for a text token."""
    if not plan.image_reads:
        return array("q")
    prompt = [lane.phase is LanePhase.PREFILL for lane in plan.lanes]
    starts, total = [], 0
    for lane, is_prompt in zip(plan.lanes, prompt):
        starts.append(total)
        total += lane.prompt_tokens if is_prompt else 0
    rows = array("q", [-1]) * total
    for read in plan.image_reads:
        lane = plan.lanes[read.lane]
        if not prompt[read.lane]:
            raise EngineError(f"lane {read.lane} reads an image but feeds no prompt chunk")
        chunk_start, chunk_end = lane.prompt_start, lane.prompt_start + lane.prompt_tokens
        if read.position < chunk_start or read.position + read.rows > chunk_end:
            raise EngineError(
                f"lane {read.lane}: image {read.span} at [{read.position}, "
                f"{read.position + read.rows}) is not inside its chunk [{chunk_start}, {chunk_end})"
            )
        base = read.window_slot * window_rows + read.offset
        at = starts[read.lane] + read.position - chunk_start
        rows[at : at + read.rows] = array("q", range(base, base + read.rows))
    return rows


def restored_generation(generation: int) -> int:
    """The fresh generation a window restore binds the request to: the slot's next
    (``runtime.coordinator.resources.SlotPool.renew``), which its following
    prefill names."""
    return generation + 1


def window_restore_start(tokens: Sequence[int], position: int) -> GenerationStart:
    """A window restore's generation start: the prompt, nothing emitted, KV valid
    up to ``position`` (the consumed prompt)."""
    return GenerationStart(tuple(tokens), len(tokens), position)


def plan_records(plan: ScheduledPlan, records: list[CompletionRecord]) -> list[CompletionRecord]:
    """The scheduler's records of ``plan`` from rank 0's: a vision frame has no
    lanes on the wire, and a window restore row answers with the fresh
    generation, so every image row's record is its plan lane's, with no tokens."""
    if plan.graph.kind is GraphKind.VISION:
        return [CompletionRecord(lane.slot, lane.generation, ()) for lane in plan.lanes]
    if not any(lane.phase in IMAGE_LANE_PHASES for lane in plan.lanes):
        return records
    out = list(records)
    for i, lane in enumerate(plan.lanes):
        if lane.phase in IMAGE_LANE_PHASES and i < len(out):
            out[i] = CompletionRecord(lane.slot, lane.generation, ())
    return out
