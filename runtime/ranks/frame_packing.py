"""Packing one checked frame into a program's input arena (the host side of a launch).

:func:`pack_frame` writes the arena layout of :mod:`runtime.ranks.arena` into
the host staging buffer: per lane its slot, query length, start position,
step, commit row, whether it continues from its pending token and the penalty
row it resets; the prompt row; the prompt lanes' tokens in lane order; for
a scored prefill, each lane's next prompt token; and for a vision model's
prompt program, each packed token's feature-store row (-1: none).  :func:`check_fits` refuses a
frame the program has no room or no role for, naming the lane.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from runtime.catalog import PREFILL_KINDS, GraphDescriptor
from runtime.ranks.arena import LANE_FIELDS, SCALARS, SlotArena
from runtime.ranks.checked_frame import CheckedFrame
from runtime.ranks.shapes import ProgramError, ProgramShape


class PackedProgram(Protocol):
    """What packing reads of a :class:`~runtime.ranks.programs.PreparedProgram`."""

    desc: GraphDescriptor
    shape: ProgramShape
    slots: SlotArena
    vocab: int
    page_size: int
    max_pages: int
    score_at: int  # a scored prefill's score_next entries start here
    feature_at: int  # a vision model's prompt program: its feature rows start here
    store: FeatureRows | None  # a vision model's prompt program: the feature store
    speculative: object | None


class FeatureRows(Protocol):
    """What packing reads of a :class:`~runtime.ranks.vision_programs.FeatureStore`."""

    rows: int  # addressable rows (the scratch row is not one)


def pack_frame(
    program: PackedProgram, checked: CheckedFrame, a: np.ndarray, memo: list | None = None
) -> tuple[int, int]:
    """Pack ``checked`` into the host int64 array ``a`` (the arena layout).

    Returns (entries used, page-table width the frame needs).  Column
    operations only; the prompt lanes' tokens are one slice copy (they lie
    in lane order, as the lanes pack them).  ``memo``: the buffer's memo
    (:attr:`HostStaging.memo`); when the buffer was last packed by this
    program with the same lanes and the frame is steady, only the start
    positions and steps are rewritten.
    """
    shape, scratch = program.shape, program.slots.scratch
    lanes, r = shape.lanes, checked.lanes
    key = (program.desc.key, checked.frame.slot, checked.frame.commits)
    if checked.steady and memo is not None and memo[0] == key:
        a[2 * lanes : 2 * lanes + r] = checked.position
        a[3 * lanes : 3 * lanes + r] = checked.step
        used = len(LANE_FIELDS) * lanes + len(SCALARS) + r
        return used, max(1, -(-int(checked.context.max()) // program.page_size))
    prompt = check_fits(program, checked)
    features = check_features(program, checked)
    q, slot, prefill = checked.query_len, checked.slot, checked.prefill
    o = 0
    for values, pad in (
        (slot, scratch),  # state_row
        (q, 0),  # query_lens
        (checked.position, 0),  # start_pos
        (checked.step, 0),  # step
        (np.where(checked.commits > 0, slot, scratch), scratch),  # count_row
        (~prefill, 0),  # from_pending
        (scratch, scratch),  # reset_row (the prompt lanes' below)
    ):
        a[o : o + r] = values
        a[o + r : o + lanes] = pad
        o += lanes
    if prompt:
        _pack_resets(checked, prompt, a[o - lanes : o])
    a[o] = checked.frame.prompt_row  # prefill_row
    o += len(SCALARS)
    total = int(q.sum())
    if len(prompt) == r:  # a prefill frame: its chunks in lane order are its tokens
        a[o : o + total] = checked.prompt_tokens
    elif program.desc.prompt_capacity:  # a mixed frame: at most one prompt lane
        # Zeros in the decode rows (their ids come from the pending tokens):
        # no stale entry of the shared buffer reaches the device's token ids.
        a[o : o + total] = 0
        if prompt:
            offset = int(q[: prompt[0]].sum())
            a[o + offset : o + offset + int(q[prompt[0]])] = checked.prompt_tokens
    used = o + total if program.desc.prompt_capacity else o  # a round feeds no prompt
    if shape.scored:  # after the arena's fields: each lane's next prompt token
        following = np.frombuffer(checked.frame.score_next, dtype=np.int64)
        if following.size and int(following.max()) >= program.vocab:
            i = int(np.argmax(following >= program.vocab))
            raise ProgramError(
                f"score_next[{i}]: token {int(following[i])} outside the vocabulary "
                f"({program.vocab} tokens)"
            )
        at = program.score_at
        a[at : at + r] = following
        a[at + r : at + lanes] = -1
        used = at + lanes
    if program.store is not None:  # each packed token's feature row, -1 but the prompt's
        at, offset = program.feature_at, 0
        if prompt and len(prompt) < r:  # a mixed frame's prompt row sits among decode rows
            offset = int(q[: prompt[0]].sum())
        a[at : at + shape.tokens] = -1
        a[at + offset : at + offset + features.size] = features
        used = at + shape.tokens
    if memo is not None:
        memo[0] = key if checked.steady or not prompt else None
    longest = int(checked.context.max(initial=1))
    if program.speculative is not None:  # the draft extent: D positions past the pending one
        longest = min(longest + program.desc.proposal_depth, program.max_pages * program.page_size)
    return used, max(1, -(-longest // program.page_size))


def _pack_resets(checked: CheckedFrame, prompt: list[int], reset_row: np.ndarray) -> None:
    """Each prompt lane that starts a new generation resets its slot's penalty
    row, unless the generation is restored: the rank wrote that row before
    the launch (DeviceRows.restore).  ``reset_row``: the field, scratch."""
    if len(prompt) == 1:  # a single prefill, a mixed prompt row: scalars
        i = prompt[0]
        if checked.starts[i] and i not in checked.restores:
            reset_row[i] = checked.slot[i]
        return
    fresh = checked.prefill & checked.starts  # (R,)
    if checked.restores:
        fresh[list(checked.restores)] = False
    reset_row[: checked.lanes] = np.where(fresh, checked.slot, reset_row[: checked.lanes])


def check_fits(program: PackedProgram, checked: CheckedFrame) -> list[int]:
    """The prompt lanes of ``checked``; ProgramError when it does not fit this
    program: more lanes than its rows, a lane over its query bound, more
    tokens than it packs, or a lane in a role the program has no row for (a
    prefill program's lanes are all prompt lanes; a mixed one takes at most
    one; decode and speculative programs none)."""
    shape, desc = program.shape, program.desc
    r, q, prefill = checked.lanes, checked.query_len, checked.prefill
    if r > shape.lanes:
        raise ProgramError(f"{r} lanes for {shape.lanes} rows of {desc.describe()}")
    if shape.mixed:
        limit = np.full(r, shape.row_query_len, np.int64)
        if checked.frame.prompt_row >= 0:
            limit[checked.frame.prompt_row] = shape.max_query_len
    else:
        limit = shape.max_query_len
    over = q > limit
    if over.any():
        i = int(np.argmax(over))
        raise ProgramError(f"lane {i}: {int(q[i])} tokens exceed {desc.describe()}")
    total = int(q.sum())
    if total > shape.tokens and not desc.device_allocated:  # ceilings may sum above P
        raise ProgramError(f"{total} tokens do not fit {desc.describe()}")
    prompt = np.flatnonzero(prefill).tolist()
    if desc.kind in PREFILL_KINDS:
        if len(prompt) < r:
            i = int(np.argmin(prefill))
            raise ProgramError(f"lane {i}: a decode lane for {desc.describe()} (prompt lanes only)")
    elif len(prompt) > 1:
        raise ProgramError(f"prompt lanes {prompt}: a program takes at most one")
    elif prompt and not desc.prompt_capacity:
        raise ProgramError(f"a prompt lane for {desc.describe()}")
    return prompt


def check_features(program: PackedProgram, checked: CheckedFrame) -> np.ndarray:
    """The frame's ``feature_rows`` (one per prompt token, or none); ProgramError
    naming the entry when one lies outside the program's feature store, or the
    program reads no features (a text-only model, a speculative program)."""
    rows = np.frombuffer(checked.frame.feature_rows, dtype=np.int64)
    if not rows.size:
        return rows
    store = program.store
    if store is None:
        raise ProgramError(
            f"feature_rows: {program.desc.describe()} reads no image features on this rank"
        )
    outside = (rows < -1) | (rows >= store.rows)
    if outside.any():
        i = int(np.argmax(outside))
        raise ProgramError(
            f"feature_rows[{i}]: row {int(rows[i])} outside the feature store ({store.rows} rows)"
        )
    return rows
