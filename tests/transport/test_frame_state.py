"""State lanes (protocol version 7): phase 2 in RESTORE and SNAPSHOT programs only,
feeding and committing nothing; restore rows carry a record and their settings
(RESTORE programs only), terminal rows neither.  Round trips through the codec,
per-lane views, and every refusal naming its field."""

from __future__ import annotations

import dataclasses
from array import array

import msgpack
import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.transport import PROTOCOL_VERSION
from runtime.transport.codec import decode, encode
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
