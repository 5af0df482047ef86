"""Per-slot request state kept on every rank.

Decode frames carry no tokens: each rank keeps every slot's pending token (the
last one it sampled), the next KV position and the sampling step, so a second
decode frame can be queued before the first completes and still read the token
the first produces.  All ranks apply the same frames in the same order and
sample identically, so their slot tables stay identical.

A frame is checked in full against the table before anything changes
(:meth:`SlotTable.prepare`); :meth:`SlotTable.commit` then applies the sampled
tokens.

Each slot's penalty state (output-token counts, prompt-token mask) lives on the
device beside the programs (:class:`~runtime.ranks.sampling.PenaltyState`) and
the programs update it; a lane tells them whether it consumes prompt tokens
(``LaneInput.prefill``) and whether it starts a new generation
(``LaneInput.starts``: the slot's state is reset first).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.transport.schema import Frame, FrameLane, SamplingParams


class FrameError(ValueError):
    """A frame does not fit the rank's slot state; nothing changed."""


@dataclass
class SlotState:
    generation: int
    next_position: int  # KV position of the next token this slot writes
    pending_token: int | None  # the last sampled token, input of the next decode
    step: int  # tokens sampled so far: the sampling noise counter
    sampling: SamplingParams
    page_table: tuple[int, ...] = ()  # from the slot's prefill lanes


@dataclass(frozen=True)
class LaneInput:
    """What one lane feeds the program."""

    slot: int
    generation: int
    tokens: tuple[int, ...]  # new tokens this step (prompt chunk, or the pending token)
    start_position: int  # position of tokens[0]
    page_table: tuple[int, ...]
    samples: bool  # the lane commits a sampled token
    sampling: SamplingParams
    step: int  # sampling noise counter for this lane's token
    prefill: bool = False  # the tokens are prompt tokens (marked in the prompt mask)
    starts: bool = False  # the first chunk of a new generation: its penalty state resets


class SlotTable:
    def __init__(self, num_slots: int = 64) -> None:
        self.num_slots = num_slots
        self._slots: dict[int, SlotState] = {}

    def state(self, slot: int) -> SlotState | None:
        return self._slots.get(slot)

    def prepare(self, frame: Frame) -> list[LaneInput]:
        """Validate ``frame`` against the table; return each lane's inputs."""
        released = set(frame.release_slots)
        out = []
        for i, lane in enumerate(frame.lanes):
            if not 0 <= lane.slot < self.num_slots:
                raise FrameError(f"lane {i}: slot {lane.slot} out of range")
            state = None if lane.slot in released else self._slots.get(lane.slot)
            if lane.phase == "prefill":
                out.append(self._prefill_input(i, lane, state))
            else:
                out.append(self._decode_input(i, lane, state))
        return out

    @staticmethod
    def _prefill_input(i: int, lane: FrameLane, state: SlotState | None) -> LaneInput:
        if state is not None and state.generation == lane.generation:
            if lane.position != state.next_position:
                raise FrameError(
                    f"lane {i}: prefill at position {lane.position}, "
                    f"slot {lane.slot} is at {state.next_position}"
                )
            step = state.step
            starts = False
        else:  # a new tenant: its first chunk starts the request
            if lane.position != 0 or lane.prompt_start != 0:
                raise FrameError(
                    f"lane {i}: slot {lane.slot} generation {lane.generation} is new, "
                    f"so its first prefill must start at 0"
                )
            step = 0
            starts = True
        return LaneInput(
            lane.slot,
            lane.generation,
            tuple(lane.prompt_tokens),
            lane.position,
            tuple(lane.page_table),
            lane.max_tokens > 0,
            lane.sampling,
            step,
            prefill=True,
            starts=starts,
        )

    @staticmethod
    def _decode_input(i: int, lane: FrameLane, state: SlotState | None) -> LaneInput:
        if state is None or state.generation != lane.generation:
            raise FrameError(
                f"lane {i}: decode for slot {lane.slot} generation {lane.generation}, "
                "which has no state on this rank"
            )
        if state.pending_token is None:
            raise FrameError(f"lane {i}: slot {lane.slot} has no pending token")
        if lane.position != state.next_position:
            raise FrameError(
                f"lane {i}: decode at position {lane.position}, "
                f"slot {lane.slot} is at {state.next_position}"
            )
        return LaneInput(
            lane.slot,
            lane.generation,
            (state.pending_token,),
            state.next_position,
            tuple(lane.page_table) or state.page_table,
            True,
            state.sampling,
            state.step,
        )

    def commit(self, frame: Frame, inputs: list[LaneInput], sampled: list[int]) -> None:
        """Apply one executed frame: positions advance, sampled tokens become pending."""
        for slot in frame.release_slots:
            self._slots.pop(slot, None)
        for lane, inp, token in zip(frame.lanes, inputs, sampled):
            state = self._slots.get(inp.slot)
            if state is None or state.generation != inp.generation:
                state = SlotState(inp.generation, 0, None, 0, lane.sampling)
                self._slots[inp.slot] = state
            state.next_position = inp.start_position + len(inp.tokens)
            state.page_table = inp.page_table
            if inp.samples:
                state.pending_token = token
                state.step += 1

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)
