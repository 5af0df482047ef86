"""The frame's ``copies`` and ``restores`` (protocol version 6): round trips through
the codec, per-lane views, and every refusal naming its field."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.transport import PROTOCOL_VERSION
from runtime.transport import Restore as ExportedRestore
from runtime.transport.codec import decode, encode
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams
from tests.support import transport_examples as examples

PREFILL = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
MIXED = GraphDescriptor(GraphKind.MIXED, 4, prompt_capacity=64)
RECORD = Restore((1, 2, 3, 4, 5, 6), output_start=4)


def restored_lane(slot: int = 3, restore: Restore | None = RECORD) -> FrameLane:
    """Slot ``slot`` resumes at position 4 over an attached page: its chunk is tokens[4:]."""
    return FrameLane(slot, 2, "prefill", 4, (5, 6), 4, (7, 8), 1, SamplingParams(), restore)


def decoder(slot: int) -> FrameLane:
    return FrameLane(slot, 1, "decode", 0, (), 9, (), 1)


def refused(build, field: str) -> str:
    with pytest.raises(ProtocolError) as raised:
        build()
    assert raised.value.field == field, raised.value
    return str(raised.value)


def test_protocol_version_and_export():
    assert PROTOCOL_VERSION >= 6
    assert ExportedRestore is Restore


def test_frames_with_copies_and_restores_round_trip():
    frame = Frame.from_lanes(
        5, MIXED, [decoder(0), restored_lane(3)], prompt_row=1, copies=[(2, 8), (9, 11)]
    )
    assert frame.copies == ((2, 8), (9, 11))
    assert frame.restores == ((1, RECORD),)
    back = decode(encode(frame))
    assert back == frame
    assert back.lanes[1].restore == RECORD and back.lanes[0].restore is None
    assert back.restores[0][1].step == 2  # two outputs already emitted
    wire = msgpack.unpackb(encode(frame))["b"]
    assert wire["copies"] == [[2, 8], [9, 11]]
    assert wire["restores"] == [[1, {"tokens": [1, 2, 3, 4, 5, 6], "output_start": 4}]]
    # An empty frame carries copies; a frame without them carries empty lists.
    empty = Frame(6, PREFILL, copies=((1, 2),))
    assert decode(encode(empty)) == empty
    plain = examples.frame()
    assert plain.copies == () and plain.restores == ()
    assert decode(encode(plain)) == plain
    # A restore with nothing emitted, position 0: legal.
    fresh = Restore((4, 5), 2)
    assert fresh.step == 0
    lane = FrameLane(1, 1, "prefill", 0, (4, 5), 0, (3,), 1, SamplingParams(), fresh)
    assert decode(encode(Frame.from_lanes(7, PREFILL, [lane]))).restores == ((0, fresh),)


def test_restore_records_are_validated():
    refused(lambda: Restore((1, -1), 0), "tokens[1]")
    refused(lambda: Restore((1, 2**31), 0), "tokens[1]")
    refused(lambda: Restore((1, 2), 3), "output_start")
    refused(lambda: Restore((1, 2), -1), "output_start")
    refused(lambda: Restore([1, 2.0], 0), "tokens[1]")
    refused(lambda: Restore.from_wire({"tokens": [1]}), "output_start")
    refused(lambda: Restore.from_wire({"tokens": [1], "output_start": 0, "x": 1}), "x")
    assert Restore([3, 4], 1).tokens == (3, 4)  # a list is stored as a tuple


@pytest.mark.parametrize(
    ("copies", "field"),
    [
        (((1, 1),), "copies[0]"),  # onto itself
        (((1, 2), (3, 2)), "copies"),  # a destination twice
        (((1, 2), (2, 3)), "copies"),  # 2 is a source and a destination
        (((1, -1),), "copies[0][1]"),
        (((2**31, 1),), "copies[0][0]"),
        (((1, 2, 3),), "copies[0]"),
        ((1,), "copies[0]"),
        (5, "copies"),
    ],
)
def test_bad_copies_are_refused(copies, field):
    frame = Frame.from_lanes(1, PREFILL, [restored_lane()])
    refused(lambda: dataclasses.replace(frame, copies=copies), field)
    wire = dataclasses.replace(frame).to_wire()
    wire["copies"] = [list(p) if isinstance(p, tuple) else p for p in copies] if copies != 5 else 5
    with pytest.raises(ProtocolError) as raised:
        Frame.from_wire(wire)
    assert raised.value.field.startswith("copies")


def test_bad_restores_are_refused():
    frame = Frame.from_lanes(1, MIXED, [decoder(0), restored_lane(3)], prompt_row=1)
    assert "not a prefill lane" in refused(
        lambda: dataclasses.replace(frame, restores=((0, RECORD),)), "restores"
    )
    refused(lambda: dataclasses.replace(frame, restores=((4, RECORD),)), "restores")
    assert "two restore records" in refused(
        lambda: dataclasses.replace(frame, restores=((1, RECORD), (1, RECORD))), "restores"
    )
    refused(lambda: dataclasses.replace(frame, restores=((1, (1, 2)),)), "restores[0][1]")
    refused(lambda: dataclasses.replace(frame, restores=((-1, RECORD),)), "restores[0][0]")
    refused(lambda: dataclasses.replace(frame, restores=((1,),)), "restores[0]")
    refused(lambda: dataclasses.replace(frame, restores=7), "restores")
    # An empty frame has no lane to restore.
    refused(lambda: Frame(2, PREFILL, restores=((0, RECORD),)), "restores")
    # On the wire: the record's own fields, qualified.
    wire = frame.to_wire()
    wire["restores"] = [[1, {"tokens": [1, -2], "output_start": 0}]]
    refused(lambda: Frame.from_wire(wire), "restores[0].tokens[1]")
    wire["restores"] = [[1, {"tokens": [1, 2], "output_start": 5}]]
    refused(lambda: Frame.from_wire(wire), "restores[0].output_start")
    wire["restores"] = None
    refused(lambda: Frame.from_wire(wire), "restores")
    del wire["restores"]
    refused(lambda: Frame.from_wire(wire), "restores")
    # Through the codec, the error names the message too.
    wire = frame.to_wire()
    wire["copies"] = [[3, 3]]
    envelope = {"v": PROTOCOL_VERSION, "t": "Frame", "b": wire}
    refused(lambda: decode(msgpack.packb(envelope, use_bin_type=True)), "Frame.copies[0]")


def test_lane_views_keep_restores_on_prefill_lanes_only():
    refused(lambda: FrameLane(0, 1, "decode", 0, (), 4, (), 1, None, RECORD), "restore")
    refused(
        lambda: FrameLane(0, 1, "prefill", 0, (1,), 0, (1,), 1, SamplingParams(), (1, 2)),
        "restore",
    )
