"""Frame roles: a mixed frame's one prompt row, and the engine building it from a plan."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.engine.config import EngineError
from runtime.coordinator.engine.frames import RUNNABLE_KINDS, Live, build_frame
from runtime.coordinator.engine.stream import RequestStream
from runtime.coordinator.plan import LanePhase, LaneWork, ScheduledPlan, SelectionReason
from runtime.coordinator.requests import RequestHandle
from runtime.transport.codec import decode, encode
from runtime.transport.schema import Frame, FrameLane, ProtocolError, SamplingParams

MIXED = GraphDescriptor(GraphKind.MIXED, 4, prompt_capacity=64)
DECODE = GraphDescriptor(GraphKind.DECODE, 4)
PREFILL = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)


def prefill(slot: int, tokens: int = 4) -> FrameLane:
    return FrameLane(slot, 1, "prefill", 0, tuple(range(tokens)), 0, (slot,), 1, SamplingParams())


def decoder(slot: int) -> FrameLane:
    return FrameLane(slot, 1, "decode", 0, (), 9, (), 1, None)


def refused(build, field: str) -> str:
    with pytest.raises(ProtocolError) as raised:
        build()
    assert raised.value.field == field
    return str(raised.value)


def test_mixed_frames_have_at_most_one_prompt_row_and_name_it():
    ok = [
        Frame(1, MIXED, (decoder(0), prefill(1), decoder(2)), prompt_row=1),
        Frame(1, MIXED, (prefill(1, 64),), prompt_row=0),  # a prompt-only population
        Frame(1, MIXED, (decoder(0), decoder(2)), prompt_row=-1),  # decode only
        Frame(1, MIXED, (), prompt_row=-1),  # empty
    ]
    for frame in ok:
        assert decode(encode(frame)) == frame
    both = (prefill(1), decoder(0), prefill(2))
    assert "at most one prefill lane" in refused(lambda: Frame(1, MIXED, both, 0), "lanes")
    refused(lambda: Frame(1, MIXED, both, -1), "lanes")
    lanes = (decoder(0), prefill(1), decoder(2))
    refused(lambda: Frame(1, MIXED, lanes, prompt_row=0), "prompt_row")  # a decode lane
    refused(lambda: Frame(1, MIXED, lanes, prompt_row=2), "prompt_row")
    refused(lambda: Frame(1, MIXED, lanes, prompt_row=-1), "prompt_row")  # left unnamed
    refused(lambda: Frame(1, MIXED, lanes, prompt_row=3), "prompt_row")  # no such lane
    refused(lambda: Frame(1, MIXED, (decoder(0),), prompt_row=0), "prompt_row")
    # The prompt row fits the prompt capacity.
    refused(lambda: Frame(1, MIXED, (prefill(1, 65), decoder(0)), 0), "lanes")
    # Decode rows carry no tokens (the ranks hold the pending token).
    with pytest.raises(ProtocolError) as raised:
        FrameLane(0, 1, "decode", 0, (5,), 9, (), 1, None)
    assert raised.value.field == "prompt_tokens"


def test_only_mixed_programs_take_a_prompt_row():
    assert Frame(1, PREFILL, (prefill(1),)).prompt_row == -1
    message = refused(lambda: Frame(1, PREFILL, (prefill(1),), prompt_row=0), "prompt_row")
    assert "prefill" in message
    refused(lambda: Frame(1, DECODE, (decoder(0), decoder(1)), prompt_row=1), "prompt_row")
    # On the wire too.
    wire = Frame(1, PREFILL, (prefill(1),)).to_wire()
    wire["prompt_row"] = 0
    refused(lambda: Frame.from_wire(wire), "prompt_row")


# ---------------------------------------------------------------- engine frames


def live(slot: int, prompt_len: int = 10) -> Live:
    stream = RequestStream(
        None,  # type: ignore[arg-type]  # build_frame never reaches the engine
        slot,
        tuple(range(100, 100 + prompt_len)),
        8,
        SamplingParams(),
        False,
    )
    return Live(stream, RequestHandle(slot), slot, 1, (slot * 2, slot * 2 + 1))


def work(slot: int, phase: LanePhase, prompt_tokens: int = 0, output_start: int = 0) -> LaneWork:
    finishes = phase is LanePhase.DECODE or prompt_tokens == 10
    return LaneWork(
        RequestHandle(slot), slot, 1, phase, 0, prompt_tokens, output_start,
        1 if finishes else 0, 1.0, 1.0, 1.0,
    )  # fmt: skip


def plan(graph: GraphDescriptor, lanes: tuple[LaneWork, ...]) -> ScheduledPlan:
    return ScheduledPlan(
        1, graph, lanes, 0, SelectionReason.DISCOVERY, True, 0, 0, 1.0, 0.0, 1.0, 0
    )  # fmt: skip


def test_build_frame_sets_the_prompt_row_of_a_mixed_plan():
    assert GraphKind.MIXED in RUNNABLE_KINDS
    lanes = (
        work(2, LanePhase.DECODE, output_start=3),
        work(0, LanePhase.DECODE, output_start=1),
        work(1, LanePhase.PREFILL, prompt_tokens=10),
    )
    lives = [live(2), live(0), live(1)]
    frame = build_frame(plan(MIXED, lanes), 7, lives, {5, 2})
    assert frame.prompt_row == 2 and frame.program == MIXED
    assert [lane.phase for lane in frame.lanes] == ["decode", "decode", "prefill"]
    assert frame.lanes[2].prompt_tokens == tuple(range(100, 110))
    assert frame.lanes[2].max_tokens == 1 and frame.lanes[2].page_table == (2, 3)
    assert frame.lanes[0].position == 10 + 3 - 1 and frame.lanes[0].prompt_tokens == ()
    assert frame.release_slots == (5,)  # slot 2 runs in this frame
    assert decode(encode(frame)) == frame
    # Decode-only and prompt-only mixed plans.
    decoders = build_frame(plan(MIXED, lanes[:2]), 8, lives[:2], set())
    assert decoders.prompt_row == -1
    alone = build_frame(plan(MIXED, lanes[2:]), 9, lives[2:], set())
    assert alone.prompt_row == 0
    # Separate programs keep -1.
    assert build_frame(plan(PREFILL, lanes[2:]), 10, lives[2:], set()).prompt_row == -1
    assert build_frame(plan(DECODE, lanes[:2]), 11, lives[:2], set()).prompt_row == -1


def test_build_frame_refuses_two_prompt_rows_and_unrunnable_kinds():
    lanes = (work(0, LanePhase.PREFILL, 4), work(1, LanePhase.PREFILL, 4))
    with pytest.raises(EngineError, match="2 prefill lanes"):
        build_frame(plan(MIXED, lanes), 7, [live(0), live(1)], set())
    speculative = GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=2, proposal_depth=1)
    with pytest.raises(EngineError, match="cannot run speculative"):
        build_frame(plan(speculative, lanes[:1]), 7, [live(0)], set())
