"""Per-slot request state kept on every rank, as columns.

Decode frames carry no tokens: each slot's pending token (the last one it
sampled) stays on the device (:class:`~runtime.ranks.arena.SlotArena`), and
this table keeps, per slot, what the host needs to check and pack the next
frame: the generation it holds, the next KV position, the sampling step,
whether a token is pending, how many pages its table holds, and whether its
settings need the full sampler or log probabilities.  All ranks apply the
same frames in the same order and sample identically, so their tables stay
identical.

The table is a handful of numpy columns indexed by slot, so a frame is
checked in full with whole-column operations (:meth:`SlotTable.check`,
nothing changes) and then applied the same way (:meth:`SlotTable.apply`),
when the frame is launched: positions, steps and page counts are known before
its tokens are, which is what lets a rank check and pack the next frame while
this one runs.  Page tables arrive as appended pages: a lane whose (slot,
generation) is new starts an empty table.

A new generation starts at position 0, unless its lane carries a restore
record (:class:`~runtime.transport.restore.Restore`): then it starts at its
``prompt_start`` over KV its pages already hold, its chunk must agree with the
record's tokens, and its sampling step starts at the outputs already emitted
(:func:`~runtime.ranks.restores.check_restore_lanes`).  ``copies`` are checked against the pool
(:meth:`SlotTable.check_copies`).  Until a restored generation's prefill has
reached the end of its record's tokens, every later chunk must agree with them
too (the table keeps the record).

State frames (RESTORE and SNAPSHOT programs, :meth:`SlotTable.check_state`,
:meth:`SlotTable.apply_state`) run no forward: a restore row starts a new
generation at its ``position`` (decode-ready at ``len(tokens) - 1``: a pending
token at that position, as after a prefill that committed it; else
prefill-ready there), a terminal row drops a known generation.
"""

from __future__ import annotations

from array import array

import numpy as np

from runtime.ranks.checked_frame import CheckedFrame, FrameError, column
from runtime.ranks.restores import check_continuations, check_restore_lanes, track_records
from runtime.transport.frame import Frame
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams


class SlotTable:
    """Columns indexed by slot (``num_slots`` rows)."""

    def __init__(
        self, num_slots: int, *, page_size: int, max_pages: int, num_pages: int, max_context: int
    ) -> None:
        self.num_slots = num_slots
        self.page_size = page_size
        self.max_pages = max_pages
        self.num_pages = num_pages
        self.max_context = max_context
        # One row per slot, so a frame gathers its lanes' state in one index:
        # generation (0: empty), next position, pending (0/1), pages held,
        # full sampler (0/1), log probabilities (-1: none), sampling step, and
        # the slack of a speculative round in flight: the next position is an
        # upper bound (what the coordinator assumes), the round may end up to
        # ``slack`` tokens short of it; :meth:`settle` makes it exact and keeps
        # the round's shortfall: the coordinator builds the next frame before it
        # hears of the round, so that frame's position may still be the bound.
        self._state = np.zeros((num_slots, 9), np.int64)
        self.generation = self._state[:, 0]
        self.next_position = self._state[:, 1]
        self.pending = self._state[:, 2]
        self.page_count = self._state[:, 3]
        self.full = self._state[:, 4]
        self.logprobs = self._state[:, 5]
        self.logprobs[:] = -1
        self.step = self._state[:, 6]
        self.slack = self._state[:, 7]
        self.shortfall = self._state[:, 8]
        self.settings: list[SamplingParams | None] = [None] * num_slots
        # Restored generations still prefilling their record's tokens: slot ->
        # record (each later chunk must agree with it).
        self.records: dict[int, Restore] = {}
        # The steady decode path: the last applied frame when it was decode-only
        # with no pages, settings or releases; the positions its lanes continue
        # at (as the wire's column, so a frame compares in one C call), and the
        # context each lane's pages and the maximum context allow.
        self._last: CheckedFrame | None = None
        self._expected = array("q")
        self._capacity = np.zeros(0, np.int64)

    def holds(self, slot: int) -> bool:
        return bool(self.generation[slot])

    def check(self, frame: Frame, vocab: int) -> CheckedFrame:
        """Check ``frame`` against the table with column operations; nothing changes.

        Raises :class:`FrameError` naming the first offending lane.  A frame
        that continues the last applied one (the same decode lanes, one token
        on, no pages, settings or releases) is checked by comparing its columns
        with what that frame left: the steady decode path.
        """
        steady = self._steady(frame)
        if steady is not None:
            return steady
        if len(frame.slot) == 1:  # a single prefill frame: scalars beat column calls
            return self._check_one(frame, vocab)
        slot = column(frame.slot)  # distinct, inside [0, MAX_SLOTS) by schema
        generation = column(frame.generation)
        position = column(frame.position)
        query_len = column(frame.query_len)
        page_count = column(frame.page_count)
        state = self._state[slot]  # (R, 9)
        known = state[:, 0] == generation
        prefill = column(frame.phase) == 1
        restores = check_restore_lanes(frame, known.tolist(), vocab)
        if self.records:
            check_continuations(self.records, frame, known.tolist(), prefill.tolist())
        # A known slot continues where it stopped (behind a speculative round in
        # flight: anywhere in its slack); a new generation starts at 0 with a
        # prefill lane (a restored one at its prompt_start); a decode lane needs
        # a pending token.
        at = (position <= state[:, 1] + state[:, 8]) & (position >= state[:, 1] - state[:, 7])
        ok = known & at & ((state[:, 2] > 0) | prefill)
        if not ok.all():
            prompt_start = column(frame.prompt_start)
            restored = np.zeros(len(ok), bool)
            restored[list(restores)] = True
            ok |= ~known & prefill & ((position == 0) | restored) & (prompt_start == position)
            if not ok.all():
                i = int(np.argmax(~ok))
                raise FrameError(self._lane_error(frame, i, bool(known[i]), bool(prefill[i])))
        prompt_tokens, pages = self._check_ids(frame, vocab)
        base = np.where(known, state[:, 3], 0)
        held = base + page_count
        context = position + query_len
        bad = (context > held * self.page_size) | (held > self.max_pages)
        bad |= context > self.max_context
        if bad.any():
            i = int(np.argmax(bad))
            raise FrameError(self._context_error(frame, i, int(context[i]), int(held[i])))
        full = bool((state[:, 4] & known).any())
        logprobs = int(np.where(known, state[:, 5], -1).max(initial=-1))
        sampling, full, logprobs = self._settings(frame, known.tolist(), full, logprobs, vocab)
        step = np.where(known, state[:, 6], 0)
        for i, restore in restores.items():
            step[i] = restore.step
        return CheckedFrame(
            frame=frame,
            slot=slot,
            generation=generation,
            prefill=prefill,
            position=position,
            query_len=query_len,
            commits=column(frame.commits),
            starts=~known,
            step=step,
            page_base=base,
            page_count=page_count,
            pages=pages,
            prompt_tokens=prompt_tokens,
            sampling=sampling,
            full=full,
            logprobs=logprobs,
            restores=restores,
        )

    def _check_one(self, frame: Frame, vocab: int) -> CheckedFrame:
        """:meth:`check` for a one-lane frame, the same rules on Python ints."""
        slot, position = frame.slot[0], frame.position[0]
        generation, held_before, step, slack, short = self._state[slot, [0, 3, 6, 7, 8]].tolist()
        known = generation == frame.generation[0]
        prefill = frame.phase[0] == 1
        restores = check_restore_lanes(frame, [known], vocab)
        if self.records:
            check_continuations(self.records, frame, [known], [prefill])
        at = self.next_position[slot] - slack <= position <= self.next_position[slot] + short
        ok = known and at and (prefill or self.pending[slot])
        fresh = position == 0 or bool(restores)
        ok = ok or (not known and prefill and fresh and frame.prompt_start[0] == position)
        if not ok:
            raise FrameError(self._lane_error(frame, 0, known, prefill))
        prompt_tokens, pages = self._check_ids(frame, vocab)
        base = held_before if known else 0
        held = base + frame.page_count[0]
        context = position + frame.query_len[0]
        if context > min(held * self.page_size, self.max_context) or held > self.max_pages:
            raise FrameError(self._context_error(frame, 0, context, held))
        full = known and bool(self.full[slot])
        logprobs = int(self.logprobs[slot]) if known else -1
        sampling, full, logprobs = self._settings(frame, [known], full, logprobs, vocab)
        if restores:
            step = restores[0].step
        return CheckedFrame(
            frame=frame,
            slot=column(frame.slot),
            generation=column(frame.generation),
            prefill=np.array([prefill]),
            position=column(frame.position),
            query_len=column(frame.query_len),
            commits=column(frame.commits),
            starts=np.array([not known]),
            step=np.array([step if known or restores else 0]),
            page_base=np.array([base]),
            page_count=column(frame.page_count),
            pages=pages,
            prompt_tokens=prompt_tokens,
            sampling=sampling,
            full=full,
            logprobs=logprobs,
            restores=restores,
        )

    def _check_ids(self, frame: Frame, vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """The prompt tokens inside the vocabulary, the pages inside the pool."""
        prompt_tokens = column(frame.prompt_tokens)
        if prompt_tokens.size and prompt_tokens.max() >= vocab:
            raise FrameError(
                f"fence {frame.fence}: prompt token {int(prompt_tokens.max())} is outside "
                f"the vocabulary [0, {vocab})"
            )
        pages = column(frame.pages)
        if pages.size and pages.max() >= self.num_pages:
            raise FrameError(
                f"fence {frame.fence}: page {int(pages.max())} is outside the "
                f"rank's {self.num_pages} pages"
            )
        self.check_copies(frame)
        return prompt_tokens, pages

    def check_copies(self, frame: Frame) -> None:
        """The frame's page copies inside the pool (the schema checked the rest)."""
        for src, dst in frame.copies:
            if max(src, dst) >= self.num_pages:
                raise FrameError(
                    f"fence {frame.fence}: copies: page {max(src, dst)} is outside the "
                    f"rank's {self.num_pages} pages"
                )

    def check_state(self, frame: Frame, vocab: int) -> CheckedFrame:
        """A state frame (RESTORE or SNAPSHOT program) checked; nothing changes.

        Restore rows (lanes with a record): a new generation (the schema allows
        them in RESTORE programs only) at ``position == prompt_start <=
        len(tokens) - 1``, whose appended pages cover ``position`` positions.
        Terminal rows (the others): a generation the rank holds (pages they
        append are dropped with it).  Raises :class:`FrameError` naming the lane.
        """
        slot = column(frame.slot)
        generation = column(frame.generation)
        position = column(frame.position)
        page_count = column(frame.page_count)
        known = self.generation[slot] == generation
        restores = check_restore_lanes(frame, known.tolist(), vocab)
        for i in range(len(slot)):
            head = f"fence {frame.fence}: lane {i}"
            restore = restores.get(i)
            if restore is None:
                if not known[i]:
                    raise FrameError(
                        f"{head}: terminal row for slot {slot[i]} generation {generation[i]}, "
                        "which has no state on this rank (a new generation is a restore "
                        "row: it needs a restore record, in a restore program)"
                    )
                continue  # pages it appends (if any) go with the slot's state
            if position[i] >= len(restore.tokens):
                raise FrameError(
                    f"{head}: restore row at position {position[i]}: a restore row holds "
                    f"at most len(tokens) - 1 = {len(restore.tokens) - 1} positions (the "
                    "last token is pending or still to prefill)"
                )
            held = int(page_count[i])
            if position[i] > held * self.page_size or held > self.max_pages:
                raise FrameError(self._context_error(frame, i, int(position[i]), held))
            if position[i] + 1 > self.max_context:
                raise FrameError(self._context_error(frame, i, int(position[i]) + 1, held))
        prompt_tokens, pages = self._check_ids(frame, vocab)
        sampling, full, logprobs = self._settings(frame, known.tolist(), False, -1, vocab)
        step = np.zeros(len(slot), np.int64)
        for i, restore in restores.items():
            step[i] = restore.step
        zeros = np.zeros(len(slot), np.int64)
        return CheckedFrame(
            frame=frame,
            slot=slot,
            generation=generation,
            prefill=np.zeros(len(slot), bool),
            position=position,
            query_len=zeros,
            commits=zeros,
            starts=~known,
            step=step,
            page_base=zeros,
            page_count=page_count,
            pages=pages,
            prompt_tokens=prompt_tokens,
            sampling=sampling,
            full=full,
            logprobs=logprobs,
            restores=restores,
        )

    def apply_state(self, checked: CheckedFrame) -> None:
        """Apply a checked state frame: terminal rows and releases dropped, restore
        rows bound (decode-ready: a pending token at ``position``; else
        prefill-ready there, the record kept for the chunks to come)."""
        frame = checked.frame
        for i, slot in enumerate(checked.slot.tolist()):
            restore = checked.restores.get(i)
            if restore is None:
                self.release(slot)
                continue
            position = int(checked.position[i])
            ready = position == len(restore.tokens) - 1
            self.generation[slot] = checked.generation[i]
            self.next_position[slot] = position
            self.pending[slot] = int(ready)
            self.page_count[slot] = checked.page_count[i]
            self.step[slot] = restore.step
            self.slack[slot] = 0
            self.shortfall[slot] = 0
            params = checked.sampling[i]
            self.settings[slot] = params
            self.full[slot] = int(needs_full(params))
            self.logprobs[slot] = params.logprobs
            if ready:
                self.records.pop(slot, None)
            else:
                self.records[slot] = restore
        for released in frame.release_slots:
            self.release(released)
        self._last = None

    def _context_error(self, frame: Frame, i: int, context: int, held: int) -> str:
        return (
            f"fence {frame.fence}: lane {i}: slot {frame.slot[i]} needs a context of "
            f"{context} tokens; it holds {held} pages of {self.page_size} (at most "
            f"{self.max_pages}), the context at most {self.max_context}"
        )

    def _settings(
        self, frame: Frame, known: list[bool], full: bool, logprobs: int, vocab: int
    ) -> tuple[dict[int, SamplingParams], bool, int]:
        """The prefill lanes' settings (bias ids checked), and whether the frame
        needs the full sampler and how many log probabilities, new generations'
        settings included."""
        sampling = dict(frame.sampling)
        for i, params in sampling.items():
            outside = [token for token, _ in params.logit_bias if token >= vocab]
            if outside:
                raise FrameError(
                    f"fence {frame.fence}: lane {i}: logit_bias token id {outside[0]} is "
                    f"outside the vocabulary [0, {vocab})"
                )
            if not known[i]:  # a new generation brings its settings
                full = full or needs_full(params)
                logprobs = max(logprobs, params.logprobs)
        return sampling, full, logprobs

    def _steady(self, frame: Frame) -> CheckedFrame | None:
        last = self._last
        if (
            last is None
            or frame.release_slots
            or frame.sampling
            or frame.pages
            or frame.copies
            or frame.restores
            or frame.slot != last.frame.slot
            or frame.generation != last.frame.generation
            or frame.phase != last.frame.phase
            or frame.query_len != last.frame.query_len
            or frame.commits != last.frame.commits
            or frame.page_count != last.frame.page_count
            or frame.position != self._expected
        ):
            return None
        position = column(frame.position)
        context = position + last.query_len
        if (context > self._capacity).any():
            return None  # the general check names the lane
        return CheckedFrame(
            frame=frame,
            slot=last.slot,
            generation=last.generation,
            prefill=last.prefill,
            position=position,
            query_len=last.query_len,
            commits=last.commits,
            starts=last.starts,
            step=last.step + last.commits,
            page_base=last.page_base,
            page_count=last.page_count,
            pages=last.pages,
            prompt_tokens=last.prompt_tokens,
            sampling={},
            full=last.full,
            logprobs=last.logprobs,
            steady=True,
        )

    def _lane_error(self, frame: Frame, i: int, known: bool, prefill: bool) -> str:
        slot, gen = int(column(frame.slot)[i]), int(column(frame.generation)[i])
        head = f"fence {frame.fence}: lane {i}"
        position = int(column(frame.position)[i])
        slack, short = int(self.slack[slot]), int(self.shortfall[slot])
        if known and not -short <= self.next_position[slot] - position <= slack:
            phase = "prefill" if prefill else "decode"
            where = int(self.next_position[slot])
            at = f"{where - slack}..{where + short}" if slack or short else f"{where}"
            return f"{head}: {phase} at position {position}, slot {slot} is at {at}"
        if known:
            return f"{head}: slot {slot} has no pending token"
        if not prefill:
            return (
                f"{head}: decode for slot {slot} generation {gen}, which has no state on this rank"
            )
        return (
            f"{head}: slot {slot} generation {gen} is new, so its first prefill must start at 0 "
            "with prompt_start 0 (a restored lane: at its prompt_start)"
        )

    def apply(self, checked: CheckedFrame) -> None:
        """Apply a checked frame at launch: releases, positions, steps, pages, settings."""
        frame = checked.frame
        slot = checked.slot
        context = checked.context
        if self.shortfall[slot].any():  # a position still counting a round's bound
            known = ~(checked.starts | checked.prefill)
            start = np.where(known, np.minimum(checked.position, self.next_position[slot]), 0)
            context = np.where(known, start + checked.query_len, context)
        self.next_position[slot] = context
        self.step[slot] = checked.step + checked.commits
        self.shortfall[slot] = 0
        self.slack[slot] = np.where(checked.starts, 0, self.slack[slot])
        if checked.speculative:  # upper bounds until settle()
            self.slack[slot] += np.where(checked.prefill, 0, checked.query_len - 1)
        if not checked.steady:
            for released in frame.release_slots:
                self.generation[released] = 0
                self.slack[released] = 0
                self.settings[released] = None
            self.generation[slot] = checked.generation
            self.page_count[slot] = checked.page_base + checked.page_count
            if self.records or checked.restores:
                track_records(self.records, checked, context)
            commits = checked.commits > 0
            self.pending[slot] = np.where(checked.starts, 0, self.pending[slot]) | commits
            for i, params in checked.sampling.items():
                if checked.starts[i]:
                    s = int(slot[i])
                    self.settings[s] = params
                    self.full[s] = int(needs_full(params))
                    self.logprobs[s] = params.logprobs
            eligible = not (
                frame.release_slots
                or frame.sampling
                or frame.pages
                or checked.prefill.any()
                or checked.speculative
            )
            self._last = checked if eligible else None
            if eligible:
                held = (checked.page_base + checked.page_count) * self.page_size
                self._capacity = np.minimum(held, self.max_context)
        else:
            self._last = checked
        if self._last is not None:
            self._expected = array("q", context.tobytes())

    def settle(self, checked: CheckedFrame, counts: np.ndarray) -> None:
        """A speculative round finished: lane ``i`` emitted ``counts[i]`` of its
        ``query_len`` tokens; the slots it ran (unless retired since) are exact
        again for it."""
        short = checked.query_len - counts
        same = (self.generation[checked.slot] == checked.generation) & ~checked.prefill
        slot = checked.slot[same]
        self.next_position[slot] -= short[same]
        self.step[slot] -= short[same]
        self.slack[slot] -= checked.query_len[same] - 1
        self.shortfall[slot] = short[same]
        if short.any():
            self._last = None

    def release(self, slot: int) -> None:
        self.generation[slot] = 0
        self.slack[slot] = 0
        self.settings[slot] = None
        self.records.pop(slot, None)
        self._last = None


def needs_full(params: SamplingParams) -> bool:
    """Whether a lane with ``params`` needs more than an argmax of the raw logits."""
    return not params.greedy or params.adjusts_logits or params.min_tokens > 0
