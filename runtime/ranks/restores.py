"""Restore records on a rank (:class:`~runtime.transport.restore.Restore`): the
checks of a frame's restored lanes against the slot table, and the records of
restored generations still prefilling their tokens (each later chunk must agree
with the record until the prefill reaches its end)."""

from __future__ import annotations

import numpy as np

from runtime.ranks.checked_frame import CheckedFrame, FrameError
from runtime.transport.frame import Frame
from runtime.transport.restore import Restore


def check_restore_lanes(frame: Frame, known: list[bool], vocab: int) -> dict[int, Restore]:
    """The frame's restore records, lane -> record, checked against the table.

    A restored lane starts a new generation (its slot's generation is new to
    the rank) at ``position == prompt_start <= len(tokens)``; its chunk equals
    ``tokens[position:]`` where they overlap and runs past them only when the
    record has no output (``output_start == len(tokens)``); every token lies
    inside the vocabulary.  Raises :class:`FrameError` naming the lane.
    """
    if not frame.restores:
        return {}
    offsets = frame.prompt_offsets()
    out: dict[int, Restore] = {}
    for i, restore in frame.restores:
        head = f"fence {frame.fence}: lane {i}: restore"
        tokens, position = restore.tokens, frame.position[i]
        if known[i]:
            raise FrameError(
                f"{head}: slot {frame.slot[i]} generation {frame.generation[i]} is not "
                "new on this rank (a restore starts a generation)"
            )
        if tokens and max(tokens) >= vocab:
            raise FrameError(f"{head}: token {max(tokens)} is outside the vocabulary [0, {vocab})")
        if frame.prompt_start[i] != position or position > len(tokens):
            raise FrameError(
                f"{head}: position {position} (prompt_start {frame.prompt_start[i]}) must "
                f"equal prompt_start and lie in [0, {len(tokens)}], the record's tokens"
            )
        check_chunk(head, restore, position, frame.prompt_tokens[offsets[i] : offsets[i + 1]])
        out[i] = restore
    return out


def check_continuations(
    records: dict[int, Restore], frame: Frame, known: list[bool], prefill: list[bool]
) -> None:
    """A known prefill lane of a restored generation still inside its record
    continues the record's tokens (:func:`check_chunk`)."""
    offsets = None
    for i, slot in enumerate(frame.slot):
        restore = records.get(slot) if known[i] and prefill[i] else None
        if restore is None:
            continue
        offsets = offsets or frame.prompt_offsets()
        head = f"fence {frame.fence}: lane {i}: slot {slot} continues a restore"
        chunk = frame.prompt_tokens[offsets[i] : offsets[i + 1]]
        check_chunk(head, restore, frame.position[i], chunk)


def track_records(records: dict[int, Restore], checked: CheckedFrame, context: np.ndarray) -> None:
    """The records of restored generations still short of their tokens: a new
    generation drops its slot's (a restored prefill lane keeps its own), a
    lane that reaches the record's end drops it."""
    for i, slot in enumerate(checked.slot.tolist()):
        if checked.starts[i]:
            records.pop(slot, None)
            restore = checked.restores.get(i)
            if restore is not None and checked.prefill[i]:
                records[slot] = restore
        restore = records.get(slot)
        if restore is not None and context[i] >= len(restore.tokens):
            del records[slot]
    for released in checked.frame.release_slots:
        records.pop(released, None)


def check_chunk(head: str, restore: Restore, position: int, chunk) -> None:
    """A prefill chunk written from ``position`` agrees with the record's tokens
    where they overlap, and runs past them only when the record has no output."""
    tokens = restore.tokens
    inside = tokens[position : position + len(chunk)]
    if tuple(chunk[: len(inside)]) != inside:
        at = next(k for k, (a, b) in enumerate(zip(chunk, inside)) if a != b)
        raise FrameError(
            f"{head}: the chunk's token at position {position + at} is "
            f"{chunk[at]}, the record's is {inside[at]}"
        )
    if len(chunk) > len(inside) and restore.output_start != len(tokens):
        raise FrameError(
            f"{head}: the chunk runs past the record's {len(tokens)} tokens, which "
            f"end with output (output_start {restore.output_start})"
        )
