"""The frame's rules (runtime/transport/frame_checks.py).

State lanes (protocol version 7): phase 2 in RESTORE and SNAPSHOT programs only,
feeding and committing nothing; restore rows carry a record and their settings
(RESTORE programs only), terminal rows neither.  Round trips through the codec,
per-lane views, and every refusal naming its field.

Frame roles: a mixed frame's one prompt row, and the engine building it from a plan."""

from __future__ import annotations

import dataclasses
from array import array

import msgpack
import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.engine.config import EngineError
from runtime.coordinator.engine.frames import (
    RUNNABLE_KINDS,
    Live,
    build_frame,
    mark_pages_sent,
)
from runtime.coordinator.engine.stream import RequestStream
from runtime.coordinator.plan import LanePhase, LaneWork, ScheduledPlan, SelectionReason
from runtime.coordinator.requests import RequestHandle
from runtime.transport import PROTOCOL_VERSION
from runtime.transport.codec import decode, encode
from runtime.transport.columns import column
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import PHASE_NAMES, PHASE_STATE, STATE_KINDS, FrameLane
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams

RESTORE = GraphDescriptor(GraphKind.RESTORE, 4)
SNAPSHOT = GraphDescriptor(GraphKind.SNAPSHOT, 2)
DECODE = GraphDescriptor(GraphKind.DECODE, 4)
PREFILL = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
MIXED = GraphDescriptor(GraphKind.MIXED, 4, prompt_capacity=64)
SPECULATIVE = GraphDescriptor(GraphKind.SPECULATIVE, 4, 4, 3)
RECORD = Restore((1, 2, 3, 4, 5, 6), output_start=4)
SETTINGS = SamplingParams(temperature=0.5, seed=3)


def refused(build, field: str) -> str:
    with pytest.raises(ProtocolError) as raised:
        build()
    assert raised.value.field == field, raised.value
    return str(raised.value)


def restore_row(slot: int = 3, position: int = 5) -> FrameLane:
    return FrameLane(slot, 2, "state", position, (), position, (7, 8), 0, SETTINGS, RECORD)


def terminal_row(slot: int = 1) -> FrameLane:
    return FrameLane(slot, 1, "state", 9, (), 9, (), 0)


def state_frame(program=RESTORE, **columns) -> Frame:
    """A RESTORE frame of a restore row (lane 0) and a terminal row (lane 1),
    columns replaced as given."""
    base = Frame.from_lanes(4, RESTORE, [restore_row(), terminal_row()], copies=((2, 7),))
    return dataclasses.replace(base, program=program, **columns)


def test_version_and_phase_codes():
    assert PROTOCOL_VERSION >= 7  # 7: state lanes; 8: the start-up identity
    assert PHASE_STATE == 2 and PHASE_NAMES[PHASE_STATE] == "state"
    assert frozenset({GraphKind.RESTORE, GraphKind.SNAPSHOT}) == STATE_KINDS


def test_state_frames_round_trip():
    frame = state_frame()
    assert list(frame.phase) == [2, 2]
    assert list(frame.query_len) == [0, 0] and list(frame.commits) == [0, 0]
    assert frame.sampling == ((0, SETTINGS),) and frame.restores == ((0, RECORD),)
    back = decode(encode(frame))
    assert back == frame
    restored, terminal = back.lanes
    assert restored == restore_row() and terminal == terminal_row()
    assert restored.query_len == 0 and terminal.restore is None and terminal.sampling is None
    wire = msgpack.unpackb(encode(frame))["b"]
    assert wire["restores"] == [[0, {"tokens": [1, 2, 3, 4, 5, 6], "output_start": 4}]]
    # Snapshot frames of terminal rows; an empty state frame.
    snap = Frame.from_lanes(5, SNAPSHOT, [terminal_row(0), terminal_row(1)], release_slots=(4,))
    assert decode(encode(snap)) == snap
    empty = Frame(6, SNAPSHOT, release_slots=(2,))
    assert decode(encode(empty)) == empty
    # Terminal rows only in a RESTORE program (its spare rows), and a lone restore row.
    assert decode(encode(Frame.from_lanes(7, RESTORE, [terminal_row()]))).num_lanes == 1
    assert Frame.from_lanes(8, RESTORE, [restore_row(0, 0)]).restores == ((0, RECORD),)


def test_state_lanes_only_in_state_programs_and_only_state_lanes_there():
    decoder = FrameLane(0, 1, "decode", 0, (), 9, (), 1)
    # A state lane in another program: the phase is refused.
    for program in (DECODE, MIXED, SPECULATIVE):
        message = refused(
            lambda p=program: Frame.from_lanes(1, p, [decoder, terminal_row()]), "phase[1]"
        )
        assert "[0, 1]" in message
    refused(lambda: Frame.from_lanes(1, DECODE, [terminal_row()]), "phase[0]")
    refused(lambda: Frame.from_lanes(1, PREFILL, [restore_row(0)]), "phase[0]")
    # Another lane in a state program.
    for program in (RESTORE, SNAPSHOT):
        refused(lambda p=program: Frame.from_lanes(1, p, [terminal_row(2), decoder]), "phase[1]")
        refused(lambda p=program: Frame.from_lanes(1, p, [decoder]), "phase[0]")
    prefill = FrameLane(0, 1, "prefill", 0, (1, 2), 0, (3,), 1, SETTINGS)
    refused(lambda: Frame.from_lanes(1, RESTORE, [prefill]), "phase[0]")


def test_state_lanes_feed_and_commit_nothing():
    refused(lambda: state_frame(query_len=array("q", [0, 1])), "query_len[1]")
    refused(lambda: state_frame(commits=array("q", [1, 0])), "commits[0]")
    # Prompt tokens in a state frame (no lane feeds any).
    refused(lambda: state_frame(prompt_tokens=array("q", [5])), "prompt_tokens")
    # Past the program's rows.
    small = GraphDescriptor(GraphKind.RESTORE, 1)
    refused(lambda: state_frame(small), "slot")


def test_records_and_settings_of_state_frames():
    # A record in a SNAPSHOT program.
    message = refused(lambda: state_frame(SNAPSHOT), "restores")
    assert "restore program" in message
    # Settings name exactly the restore rows.
    refused(lambda: state_frame(sampling=()), "sampling")
    refused(lambda: state_frame(sampling=((0, SETTINGS), (1, SETTINGS))), "sampling")
    refused(lambda: state_frame(restores=(), sampling=((0, SETTINGS),)), "sampling")
    refused(lambda: state_frame(restores=((1, RECORD),)), "sampling")
    refused(lambda: state_frame(restores=((0, RECORD), (0, RECORD))), "restores")
    refused(lambda: state_frame(restores=((0, "x"),)), "restores[0][1]")
    refused(lambda: state_frame(restores=((7, RECORD),)), "restores")
    # Wire forms are checked alike.
    wire = msgpack.unpackb(encode(state_frame()))["b"]
    wire["sampling"] = []
    refused(lambda: Frame.from_wire(wire), "sampling")


def test_state_lane_views_are_checked():
    refused(lambda: FrameLane(0, 1, "state", 0, (1,), 0, (), 0), "prompt_tokens")
    refused(lambda: FrameLane(0, 1, "state", 0, (), 0, (), 1), "commits")
    refused(lambda: FrameLane(0, 1, "state", 0, (), 0, (), 0, SETTINGS), "sampling")
    refused(lambda: FrameLane(0, 1, "state", 0, (), 0, (), 0, None, RECORD), "sampling")
    refused(lambda: FrameLane(0, 1, "state", 0, (), 0, (), 0, "x", RECORD), "sampling")
    refused(lambda: FrameLane(0, 1, "decode", 0, (), 0, (), 1, None, RECORD), "restore")
    refused(lambda: FrameLane(0, 1, "stat", 0, (), 0, (), 0), "phase")


# ------------------------------------------------------------------ frame roles


def prefill(slot: int, tokens: int = 4) -> FrameLane:
    return FrameLane(slot, 1, "prefill", 0, tuple(range(tokens)), 0, (slot,), 1, SamplingParams())


def decoder(slot: int) -> FrameLane:
    return FrameLane(slot, 1, "decode", 0, (), 9, (), 1, None)


def frame(lanes: tuple[FrameLane, ...], prompt_row: int = -1, program=MIXED) -> Frame:
    return Frame.from_lanes(1, program, lanes, prompt_row)


def test_mixed_frames_have_at_most_one_prompt_row_and_name_it():
    ok = [
        frame((decoder(0), prefill(1), decoder(2)), prompt_row=1),
        frame((prefill(1, 64),), prompt_row=0),  # a prompt-only population
        frame((decoder(0), decoder(2)), prompt_row=-1),  # decode only
        frame((), prompt_row=-1),  # empty
    ]
    for made in ok:
        assert decode(encode(made)) == made
    both = (prefill(1), decoder(0), prefill(2))
    assert "one prefill lane at most" in refused(lambda: frame(both, 0), "phase")
    refused(lambda: frame(both, -1), "phase")
    lanes = (decoder(0), prefill(1), decoder(2))
    refused(lambda: frame(lanes, prompt_row=0), "prompt_row")  # a decode lane
    refused(lambda: frame(lanes, prompt_row=2), "prompt_row")
    refused(lambda: frame(lanes, prompt_row=-1), "prompt_row")  # left unnamed
    refused(lambda: frame(lanes, prompt_row=3), "prompt_row")  # no such lane
    refused(lambda: frame((decoder(0),), prompt_row=0), "prompt_row")
    # The prompt row fits the prompt capacity.
    refused(lambda: frame((prefill(1, 65), decoder(0)), 0), "prompt_tokens")
    # Decode rows carry no tokens (the ranks hold the pending token).
    with pytest.raises(ProtocolError) as raised:
        FrameLane(0, 1, "decode", 0, (5,), 9, (), 1, None)
    assert raised.value.field == "prompt_tokens"


def test_only_mixed_programs_take_a_prompt_row():
    assert frame((prefill(1),), program=PREFILL).prompt_row == -1
    message = refused(lambda: frame((prefill(1),), 0, PREFILL), "prompt_row")
    assert "prefill" in message
    refused(lambda: frame((decoder(0), decoder(1)), 1, DECODE), "prompt_row")
    # On the wire too.
    wire = frame((prefill(1),), program=PREFILL).to_wire()
    wire["prompt_row"] = 0
    refused(lambda: Frame.from_wire(wire), "prompt_row")


# ---------------------------------------------------------------- engine frames


def live(slot: int, prompt_len: int = 10, sent: bool = False) -> Live:
    """A request resident in ``slot`` (generation 1) holding pages 2 slot and 2 slot + 1."""
    stream = RequestStream(
        None,  # type: ignore[arg-type]  # build_frame never reaches the engine
        slot,
        tuple(range(100, 100 + prompt_len)),
        8,
        SamplingParams(),
        False,
    )
    made = Live(stream, RequestHandle(slot))
    made.reside(slot, 1, None)
    made.pages = [slot * 2, slot * 2 + 1]
    if sent:
        mark_pages_sent([made])
    return made


def work(
    slot: int, phase: LanePhase, prompt_tokens: int = 0, output_start: int = 0, start: int = 0
) -> LaneWork:
    finishes = phase is LanePhase.DECODE or start + prompt_tokens == 10
    return LaneWork(
        RequestHandle(slot), slot, 1, phase, start, prompt_tokens, output_start,
        1 if finishes else 0, 1.0, 1.0, 1.0,
    )  # fmt: skip


def plan(graph: GraphDescriptor, lanes: tuple[LaneWork, ...], estimate: int = 0) -> ScheduledPlan:
    return ScheduledPlan(
        1, graph, lanes, estimate, SelectionReason.DISCOVERY, True, 0, 0, 1.0, 0.0, 1.0, 0
    )  # fmt: skip


def test_build_frame_sets_the_prompt_row_of_a_mixed_plan():
    assert GraphKind.MIXED in RUNNABLE_KINDS
    lanes = (
        work(2, LanePhase.DECODE, output_start=3),
        work(0, LanePhase.DECODE, output_start=1),
        work(1, LanePhase.PREFILL, prompt_tokens=10),
    )
    lives = [live(2, sent=True), live(0, sent=True), live(1)]
    made = build_frame(plan(MIXED, lanes, estimate=750_000), 7, lives, {5, 2})
    assert made.prompt_row == 2 and made.program == MIXED
    assert made.phase == column([0, 0, 1]) and made.query_len == column([1, 1, 10])
    assert made.prompt_tokens == column(range(100, 110))
    assert made.sampling == ((2, SamplingParams()),)
    assert made.lanes[2].commits == 1 and made.lanes[2].pages == (2, 3)
    assert made.page_count == column([0, 0, 2])  # the decoders' tables were sent before
    assert made.position[0] == 10 + 3 - 1 and made.lanes[0].prompt_tokens == ()
    assert made.release_slots == (5,)  # slot 2 runs in this frame
    assert made.expected_ns == 750_000  # the plan's estimate
    assert decode(encode(made)) == made
    # Decode-only and prompt-only mixed plans.
    decoders = build_frame(plan(MIXED, lanes[:2]), 8, lives[:2], set())
    assert decoders.prompt_row == -1 and decoders.expected_ns == 0
    alone = build_frame(plan(MIXED, lanes[2:]), 9, lives[2:], set())
    assert alone.prompt_row == 0
    # Separate programs keep -1.
    assert build_frame(plan(PREFILL, lanes[2:]), 10, lives[2:], set()).prompt_row == -1
    assert build_frame(plan(DECODE, lanes[:2]), 11, lives[:2], set()).prompt_row == -1


def test_pages_go_out_once_per_generation():
    request = live(1)
    first = plan(PREFILL, (work(1, LanePhase.PREFILL, prompt_tokens=4),))
    made = build_frame(first, 1, [request], set())
    assert made.page_count == column([2]) and made.pages == column([2, 3])
    # Building alone marks nothing: a frame that never left sends the table again.
    assert build_frame(first, 1, [request], set()).pages == column([2, 3])
    mark_pages_sent([request])
    later = (work(1, LanePhase.PREFILL, prompt_tokens=6, start=4),)
    chunk = build_frame(plan(PREFILL, later), 2, [request], set())
    assert chunk.page_count == column([0]) and chunk.pages == column()
    assert chunk.position == column([4]) and chunk.prompt_tokens == column(range(104, 110))
    decoding = build_frame(plan(DECODE, (work(1, LanePhase.DECODE),)), 3, [request], set())
    assert decoding.page_count == column([0])
    # The slot's next tenant (a new generation) starts an empty table on the ranks.
    request.reside(1, 2, None)
    request.pages = [9, 4, 7]
    lane = LaneWork(
        RequestHandle(1), 1, 2, LanePhase.PREFILL, 0, 4, 0, 0, 1.0, 1.0, 1.0
    )  # fmt: skip
    fresh = build_frame(plan(PREFILL, (lane,)), 4, [request], set())
    assert fresh.generation == column([2]) and fresh.pages == column([9, 4, 7])


def test_build_frame_refuses_two_prompt_rows_and_unrunnable_kinds():
    lanes = (work(0, LanePhase.PREFILL, 4), work(1, LanePhase.PREFILL, 4))
    with pytest.raises(EngineError, match="2 prefill lanes"):
        build_frame(plan(MIXED, lanes), 7, [live(0), live(1)], set())
    init = GraphDescriptor(GraphKind.INIT, 1)
    with pytest.raises(EngineError, match="cannot run init"):
        build_frame(plan(init, lanes[:1]), 7, [live(0)], set())
    vision = GraphDescriptor(GraphKind.VISION, 1)  # a vision plan names its images
    with pytest.raises(EngineError, match="a vision plan with no images"):
        build_frame(plan(vision, lanes[:1]), 7, [live(0)], set())


def test_a_speculative_round_carries_each_lanes_query_length():
    import dataclasses

    program = GraphDescriptor(
        GraphKind.SPECULATIVE, 4, token_capacity=4, proposal_depth=3, target_capacity=6
    )
    lanes = (
        dataclasses.replace(work(0, LanePhase.DECODE, output_start=2), max_tokens=4),
        dataclasses.replace(work(1, LanePhase.DECODE, output_start=5), max_tokens=2),
    )
    built = build_frame(plan(program, lanes), 7, [live(0), live(1)], set())
    assert list(built.query_len) == [4, 2] and list(built.commits) == [4, 2]
    assert list(built.position) == [11, 14]  # prompt 10 + output_start - 1
    assert decode(encode(built)) == built
    too_many = (lanes[0], dataclasses.replace(lanes[1], max_tokens=3))  # 7 rows > P = 6
    with pytest.raises(ProtocolError, match="above P = 6"):
        build_frame(plan(program, too_many), 7, [live(0), live(1)], set())
    deep = (dataclasses.replace(lanes[0], max_tokens=5),)  # beyond W = D + 1 = 4
    with pytest.raises(ProtocolError, match="query_len"):
        build_frame(plan(program, deep), 7, [live(0)], set())
    ceilings = dataclasses.replace(program, device_allocated=True)  # ceilings may exceed P
    built = build_frame(plan(ceilings, too_many), 7, [live(0), live(1)], set())
    assert list(built.query_len) == [4, 3]
