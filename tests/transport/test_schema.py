"""Message schema: round trips and every validation rule, each naming its field."""

from __future__ import annotations

import copy
import dataclasses
import math
import struct
import subprocess
import sys
from array import array
from typing import Any

import msgpack
import pytest

from runtime.transport.codec import decode, encode
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams
from runtime.transport.schema import MESSAGE_TYPES, PROTOCOL_VERSION
from runtime.transport.tensor import Tensor
from tests.support import transport_examples as examples


def col(*values: int) -> array:
    return array("q", values)


def raw(*values: int) -> bytes:
    """Values as a column on the wire: little-endian int64."""
    return struct.pack(f"<{len(values)}q", *values)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(examples.ALL))
def test_round_trip_through_codec(name: str) -> None:
    message = examples.ALL[name]()
    data = encode(message)
    assert isinstance(data, bytes)
    assert decode(data) == message
    assert type(decode(data)) is MESSAGE_TYPES[name]


@pytest.mark.parametrize("name", sorted(examples.ALL))
def test_round_trip_through_msgpack_bytes(name: str) -> None:
    message = examples.ALL[name]()
    envelope = msgpack.unpackb(encode(message), raw=False, strict_map_key=True)
    assert envelope == {"v": PROTOCOL_VERSION, "t": name, "b": message.to_wire()}
    wire = msgpack.unpackb(msgpack.packb(message.to_wire(), use_bin_type=True), raw=False)
    assert type(message).from_wire(wire) == message


def test_every_message_type_has_an_example() -> None:
    assert set(examples.ALL) == set(MESSAGE_TYPES)


def test_columns_are_int64_arrays_and_wire_form_is_little_endian_bytes() -> None:
    frame = examples.frame()
    assert PROTOCOL_VERSION >= 2  # columns since version 2
    assert frame.prompt_tokens == col(1, 2, 3, 151_643)
    assert isinstance(frame.lanes, tuple)
    assert frame.lanes[0].prompt_tokens == (1, 2, 3, 151_643)
    wire = frame.to_wire()
    assert wire["prompt_tokens"] == struct.pack("<4q", 1, 2, 3, 151_643)
    assert wire["slot"] == struct.pack("<2q", 3, 4)
    assert wire["sampling"] == [[0, examples.sampling().to_wire()]]
    assert wire["program"] == examples.MIXED.to_wire()
    assert list(wire) == [f.name for f in dataclasses.fields(Frame)]


def test_integer_temperature_becomes_float_and_greedy() -> None:
    params = SamplingParams(temperature=0, top_p=1, top_k=-1, seed=0)
    assert params.temperature == 0.0 and isinstance(params.temperature, float)
    assert params.greedy


def test_min_tokens_and_logprobs_defaults_bounds_and_round_trip() -> None:
    params = SamplingParams()
    assert (params.min_tokens, params.logprobs) == (0, -1)
    # Positional construction keeps its old meaning; the new fields come last.
    assert SamplingParams(0.5, 0.9, 10, 7) == SamplingParams(
        temperature=0.5, top_p=0.9, top_k=10, seed=7, min_tokens=0, logprobs=-1
    )
    for min_tokens, logprobs in [(0, -1), (1, 0), (2**31 - 1, 20), (17, 7)]:
        params = SamplingParams(temperature=0.3, min_tokens=min_tokens, logprobs=logprobs)
        wire = params.to_wire()
        assert (wire["min_tokens"], wire["logprobs"]) == (min_tokens, logprobs)
        assert decode(encode(params)) == params
        lane = FrameLane(0, 1, "prefill", 0, (4,), 0, (1,), 1, params)
        frame = Frame.from_lanes(1, examples.MIXED, [lane], prompt_row=0)
        assert decode(encode(frame)).lanes[0].sampling == params
    for bad in [-1, 2**31, True]:
        with pytest.raises(ProtocolError) as raised:
            SamplingParams(min_tokens=bad)
        assert raised.value.field == "min_tokens"
    for bad in [-2, 21, True, 1.0]:
        with pytest.raises(ProtocolError) as raised:
            SamplingParams(logprobs=bad)
        assert raised.value.field == "logprobs"


def test_logprob_sidecars_round_trip_in_a_completion() -> None:
    values = Tensor.from_values("float32", (2, 4), [-0.5, -0.5, -1.25, -3.0] * 2)
    ids = Tensor.from_values("int32", (2, 3), [7, 1, 9, 2, 2, 0])
    completion = Completion.from_results(
        4, 0, 1, 10, lanes=examples.completion().lane_results(),
        sidecars={"logprobs": values, "logprob_token_ids": ids},
    )  # fmt: skip
    carried = decode(encode(completion))
    assert carried == completion
    assert carried.sidecars["logprob_token_ids"].values() == [7, 1, 9, 2, 2, 0]
    assert carried.sidecars["logprobs"].values()[:4] == [-0.5, -0.5, -1.25, -3.0]


def test_str_enum_phase_is_stored_as_plain_str() -> None:
    from runtime.coordinator.plan import LanePhase

    lane = FrameLane(0, 1, LanePhase.DECODE, 0, (), 5, (1,), 1)
    assert type(lane.phase) is str and lane.phase == "decode"
    assert Frame.from_lanes(1, examples.DECODE, [lane]).phase == col(0)


# ---------------------------------------------------------------- tensors


def test_tensor_float32_sidecar_is_little_endian() -> None:
    values = [i * 0.25 - 1.0 for i in range(24)]
    tensor = examples.confidence()
    assert tensor.shape == (2, 3, 4) and tensor.numel == 24
    assert len(tensor.data) == 24 * 4
    assert tensor.data == b"".join(struct.pack("<f", v) for v in values)
    assert tensor.data[4:8] == b"\x00\x00\x40\xbf"  # -0.75 as little-endian IEEE 754
    assert tensor.values() == values
    carried = decode(encode(examples.completion())).sidecars["confidence"]
    assert carried == tensor and carried.values() == values


@pytest.mark.parametrize(
    ("dtype", "values", "raw"),
    [
        ("float32", [1.0], b"\x00\x00\x80\x3f"),
        ("int32", [-2], b"\xfe\xff\xff\xff"),
        ("int64", [258], b"\x02\x01\x00\x00\x00\x00\x00\x00"),
        ("float16", [1.0], b"\x00\x3c"),
        ("bfloat16", [1.0], b"\x80\x3f"),
    ],
)
def test_tensor_dtypes_pack_little_endian(dtype: str, values: list, raw: bytes) -> None:
    tensor = Tensor.from_values(dtype, (1,), values)
    assert tensor.data == raw
    assert tensor.values() == values
    assert decode(encode(tensor)) == tensor


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan() -> None:
    values = Tensor.from_values("bfloat16", (3,), [1.00390625, 1.01171875, math.nan]).values()
    assert values[:2] == [1.0, 1.015625]
    assert math.isnan(values[2])


def test_empty_and_scalar_tensors() -> None:
    assert Tensor("float32", (0, 4), b"").values() == []
    assert Tensor.from_values("int64", (), [5]).values() == [5]


def test_tensor_torch_helpers_round_trip() -> None:
    torch = pytest.importorskip("torch")
    from runtime.transport.tensor import tensor_from_torch, tensor_to_torch

    for dtype in (torch.float32, torch.int32, torch.int64, torch.float16, torch.bfloat16):
        value = (torch.arange(24) - 5).to(dtype).reshape(2, 3, 4)[:, 1:]  # a non-contiguous view
        tensor = tensor_from_torch(value)
        assert tensor.shape == (2, 2, 4)
        assert torch.equal(tensor_to_torch(decode(encode(tensor))), value)
    assert tensor_from_torch(torch.ones(2, 3)) == Tensor.from_values("float32", (2, 3), [1.0] * 6)
    assert tensor_to_torch(Tensor("float32", (0, 3), b"")).shape == (0, 3)
    with pytest.raises(ProtocolError, match="dtype"):
        tensor_from_torch(torch.zeros(2, dtype=torch.float64))


@pytest.mark.process
def test_schema_module_does_not_import_torch() -> None:
    code = (
        "import sys, runtime.transport.schema, runtime.transport.codec, "
        "runtime.transport.channels; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=9)


# ---------------------------------------------------------------- validation rules

BIG = 2**63


def _case(name: str, path: str, value: Any, field: str, *, drop: bool = False) -> Any:
    return pytest.param(name, path, value, field, drop, id=f"{name}-{path}-{value!r}"[:80])


# (message type, dotted path into the wire body, new value, field the error must name)
BAD = [
    # SamplingParams
    _case("SamplingParams", "temperature", -0.1, "temperature"),
    _case("SamplingParams", "temperature", math.nan, "temperature"),
    _case("SamplingParams", "temperature", math.inf, "temperature"),
    _case("SamplingParams", "temperature", "0.5", "temperature"),
    _case("SamplingParams", "temperature", True, "temperature"),
    _case("SamplingParams", "top_p", 0.0, "top_p"),
    _case("SamplingParams", "top_p", 1.5, "top_p"),
    _case("SamplingParams", "top_k", 0, "top_k"),
    _case("SamplingParams", "top_k", -2, "top_k"),
    _case("SamplingParams", "top_k", 1.5, "top_k"),
    _case("SamplingParams", "seed", -1, "seed"),
    _case("SamplingParams", "seed", BIG, "seed"),
    _case("SamplingParams", "seed", None, "seed"),
    _case("SamplingParams", "min_tokens", -1, "min_tokens"),
    _case("SamplingParams", "min_tokens", 2**31, "min_tokens"),
    _case("SamplingParams", "min_tokens", True, "min_tokens"),
    _case("SamplingParams", "min_tokens", 1.0, "min_tokens"),
    _case("SamplingParams", "min_tokens", None, "min_tokens"),
    _case("SamplingParams", "min_tokens", None, "min_tokens", drop=True),
    _case("SamplingParams", "logprobs", -2, "logprobs"),
    _case("SamplingParams", "logprobs", 21, "logprobs"),
    _case("SamplingParams", "logprobs", True, "logprobs"),
    _case("SamplingParams", "logprobs", False, "logprobs"),
    _case("SamplingParams", "logprobs", 5.0, "logprobs"),
    _case("SamplingParams", "logprobs", "5", "logprobs"),
    _case("SamplingParams", "logprobs", None, "logprobs", drop=True),
    _case("Frame", "sampling.0.1.logprobs", 21, "sampling[0].logprobs"),
    _case("SamplingParams", "min_p", 0.1, "min_p"),  # unknown field
    _case("SamplingParams", "seed", None, "seed", drop=True),  # missing field
    # Frame: mixed B=4, C=64; lane 0 prefills slot 3 (gen 2, 4 tokens at 0, pages 5 6),
    # lane 1 decodes slot 4 (gen 1, position 17, appends pages 7 0); releases 1 2.
    _case("Frame", "fence", -1, "fence"),
    _case("Frame", "fence", BIG, "fence"),
    _case("Frame", "program.kind", "bogus", "program"),
    _case("Frame", "program.batch_capacity", 3, "program"),
    _case("Frame", "program", "decode", "program"),
    _case("Frame", "lanes", [], "lanes"),  # a version-1 body
    _case("Frame", "slot", [3, 4], "slot"),  # a list, not int64 bytes
    _case("Frame", "slot", "abc", "slot"),
    _case("Frame", "slot", b"\x00" * 15, "slot"),  # not whole int64 values
    _case("Frame", "slot", raw(3, 3), "slot"),  # repeated
    _case("Frame", "slot", raw(3, 64), "slot[1]"),
    _case("Frame", "slot", raw(-1, 4), "slot[0]"),
    _case("Frame", "slot", raw(3), "generation"),  # columns of unequal length
    _case("Frame", "generation", raw(0, 1), "generation[0]"),
    _case("Frame", "generation", raw(2, -5), "generation[1]"),
    _case("Frame", "phase", raw(2, 0), "phase[0]"),
    _case("Frame", "phase", raw(1, -1), "phase[1]"),
    _case("Frame", "phase", raw(0, 0), "query_len[0]"),  # a decode lane feeding 4 tokens
    _case("Frame", "phase", raw(1, 1, 0), "phase"),  # 3 entries for 2 lanes
    _case("Frame", "position", raw(-1, 17), "position[0]"),
    _case("Frame", "position", raw(0, 2**31), "position[1]"),
    _case("Frame", "query_len", raw(0, 1), "query_len[0]"),
    _case("Frame", "query_len", raw(4, 2), "query_len[1]"),  # decode feeds exactly 1
    _case("Frame", "query_len", raw(5, 1), "prompt_tokens"),  # 4 tokens for a chunk of 5
    _case("Frame", "commits", raw(2, 1), "commits[0]"),
    _case("Frame", "commits", raw(1, 0), "commits[1]"),  # decode commits exactly 1
    _case("Frame", "prompt_start", raw(-1, 7), "prompt_start[0]"),
    _case("Frame", "prompt_start", raw(0, 2**31), "prompt_start[1]"),
    _case("Frame", "prompt_tokens", raw(1, 2, 3), "prompt_tokens"),
    _case("Frame", "prompt_tokens", raw(1, 2, 3, -1), "prompt_tokens[3]"),
    _case("Frame", "prompt_tokens", raw(1, 2, 3, 2**31), "prompt_tokens[3]"),
    _case("Frame", "prompt_tokens", [1, 2, 3, 4], "prompt_tokens"),
    _case("Frame", "page_count", raw(0, 4), "page_count[0]"),  # a new prefill needs a page
    _case("Frame", "page_count", raw(2, 1), "pages"),  # 4 pages for 3
    _case("Frame", "page_count", raw(-1, 5), "page_count[0]"),
    _case("Frame", "pages", raw(5, 5, 7, 0), "pages"),  # lane 0 appends page 5 twice
    _case("Frame", "pages", raw(5, -6, 7, 0), "pages[1]"),
    _case("Frame", "pages", raw(5, 6, 7), "pages"),
    _case("Frame", "sampling", [], "sampling"),  # the prefill lane's is missing
    _case("Frame", "sampling", "x", "sampling"),
    _case("Frame", "sampling.0", [0], "sampling[0]"),
    _case("Frame", "sampling.0.0", 1, "sampling"),  # names the decode lane
    _case("Frame", "sampling.0.0", True, "sampling[0][0]"),
    _case("Frame", "sampling.0.1", [0.0, 1.0], "sampling[0]"),
    _case("Frame", "sampling.0.1.top_p", 2.0, "sampling[0].top_p"),
    _case("Frame", "prompt_row", 2, "prompt_row"),
    _case("Frame", "prompt_row", -2, "prompt_row"),
    _case("Frame", "prompt_row", 1, "prompt_row"),  # a decode lane
    _case("Frame", "prompt_row", -1, "prompt_row"),  # the mixed frame's prefill lane unnamed
    _case("Frame", "release_slots", [64], "release_slots[0]"),
    _case("Frame", "release_slots", [1, 1], "release_slots"),
    _case("Frame", "release_slots", [4], "release_slots"),  # also runs in lanes
    _case("Frame", "expected_ns", -1, "expected_ns"),
    _case("Frame", "expected_ns", 1.5, "expected_ns"),
    _case("Frame", "expected_ns", None, "expected_ns", drop=True),
    # Tensor ([2, 3, 4] float32)
    _case("Tensor", "dtype", "float64", "dtype"),
    _case("Tensor", "shape", [2, -3, 4], "shape[1]"),
    _case("Tensor", "shape", [1] * 9, "shape"),
    _case("Tensor", "shape", [2, 3, 5], "data"),
    _case("Tensor", "data", b"\x00" * 95, "data"),
    _case("Tensor", "data", "x" * 96, "data"),
    # Completion (rank 0 of 2): slot 3 gen 2 commits 42 and stops; slot 4 gen 1 commits 7
    _case("Completion", "fence", -1, "fence"),
    _case("Completion", "rank", 2, "rank"),
    _case("Completion", "rank", 1, "slot"),  # only rank 0 reports lanes
    _case("Completion", "world_size", 0, "world_size"),
    _case("Completion", "device_ns", -1, "device_ns"),
    _case("Completion", "device_ns", 1.5, "device_ns"),
    _case("Completion", "readiness_delay_ns", -1, "readiness_delay_ns"),
    _case("Completion", "lanes", [], "lanes"),  # a version-1 body
    _case("Completion", "slot", raw(3, 3), "slot"),
    _case("Completion", "slot", raw(3, 64), "slot[1]"),
    _case("Completion", "slot", [3, 4], "slot"),
    _case("Completion", "generation", raw(0, 1), "generation[0]"),
    _case("Completion", "generation", raw(2), "generation"),
    _case("Completion", "token_count", raw(1, 2), "tokens"),
    _case("Completion", "token_count", raw(-1, 3), "token_count[0]"),
    _case("Completion", "token_count", raw(2**16 + 1, 0), "token_count[0]"),
    _case("Completion", "tokens", raw(42, -1), "tokens[1]"),
    _case("Completion", "tokens", raw(42), "tokens"),
    _case("Completion", "tokens", raw(42, 2**31), "tokens[1]"),
    _case("Completion", "finished", raw(2, 0), "finished[0]"),
    _case("Completion", "finished", raw(1, 0, 0), "finished"),
    _case("Completion", "token_count", raw(0, 2), "finished[0]"),  # "stop" needs a token
    _case("Completion", "sidecars", [], "sidecars"),
    _case("Completion", "sidecars.confidence.shape", [2, 3], "sidecars[confidence].data"),
    _case("Completion", "sidecars.confidence", b"raw", "sidecars[confidence]"),
    # CatalogReport (rank 1 of 2)
    _case("CatalogReport", "rank", -1, "rank"),
    _case("CatalogReport", "rank", 2, "rank"),
    _case("CatalogReport", "world_size", 0, "world_size"),
    _case("CatalogReport", "descriptors", [], "descriptors"),
    _case("CatalogReport", "descriptors.1", examples.DECODE.to_wire(), "descriptors"),
    _case("CatalogReport", "descriptors.0.batch_capacity", 3, "descriptors[0]"),
    _case("CatalogReport", "vocab_size", 0, "vocab_size"),
    _case("CatalogReport", "max_context", 0, "max_context"),
    _case("CatalogReport", "page_size", 0, "page_size"),
    _case("CatalogReport", "num_pages", -1, "num_pages"),
    _case("CatalogReport", "model_name", "", "model_name"),
    _case("CatalogReport", "model_name", 5, "model_name"),
    # Control (ready from rank 1)
    _case("Control", "command", "reboot", "command"),
    _case("Control", "rank", -1, "rank"),  # 'ready' comes from a rank
    _case("Control", "rank", -2, "rank"),
    _case("Control", "nonce", -1, "nonce"),
    _case("Control", "nonce", BIG, "nonce"),
    _case("Control", "count", -1, "count"),
    _case("Control", "count", 1 << 17, "count"),  # beyond MAX_PROFILE_FRAMES
]


def _mutate(wire: dict, path: str, value: Any, drop: bool) -> dict:
    wire = copy.deepcopy(wire)
    *parents, last = path.split(".")
    node: Any = wire
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    elif drop:
        del node[last]
    else:
        node[last] = value
    return wire


@pytest.mark.parametrize(("name", "path", "value", "field", "drop"), BAD)
def test_validation_names_the_field(name: str, path: str, value: Any, field: str, drop: bool):
    cls = MESSAGE_TYPES[name]
    wire = _mutate(examples.ALL[name]().to_wire(), path, value, drop)
    with pytest.raises(ProtocolError) as raised:
        cls.from_wire(wire)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ")
    # The same body inside an envelope is refused by the codec, naming type and field.
    packed = msgpack.packb({"v": PROTOCOL_VERSION, "t": name, "b": wire}, use_bin_type=True)
    with pytest.raises(ProtocolError) as raised:
        decode(packed)
    assert raised.value.field == f"{name}.{field}"


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: SamplingParams(temperature=-1.0), "temperature"),
        (lambda: Control("ping", rank=0, nonce=-5), "nonce"),
        (lambda: Control("profile", nonce=1, count=0), "count"),  # at least one frame
        (lambda: Control("profiled", nonce=1, count=3), "rank"),  # comes from a rank
        (lambda: Completion(0, 1, 2, 5, sidecars={"c": examples.confidence()}), "sidecars"),
        (lambda: Completion.from_results(0, 0, 1, 5, lanes=[examples.decode_lane()]), "lanes[0]"),
        (lambda: Completion(0, 0, 1, 5, sidecars={"": examples.confidence()}), "sidecars"),
        (lambda: Completion(0, 0, 1, 5, slot=[1], generation=[1], token_count=[0]), "finished"),
        (lambda: Completion(0, 0, 1, 5, slot=array("i", [1])), "slot"),  # int32, not int64
        (lambda: Completion(0, 0, 1, 5, tokens=(True,)), "tokens[0]"),
        (lambda: Tensor("float32", (2,), bytearray(7)), "data"),
        (lambda: Frame(0, examples.DECODE, slot=[0], generation=[1]), "phase"),
        (lambda: Frame(0, examples.DECODE, slot=[0.5]), "slot[0]"),
        (lambda: Frame(0, examples.DECODE, sampling=((0, None),)), "sampling[0][1]"),
        (lambda: Frame.from_lanes(0, examples.DECODE, [examples.sampling()]), "lanes[0]"),
        (lambda: FrameLane(0, 1, "verify", 0, (), 0, (), 1), "phase"),
        (lambda: FrameLane(0, 1, "decode", 0, (5,), 9, (), 1), "prompt_tokens"),
        (lambda: FrameLane(0, 1, "decode", 0, (), 9, (), 1, examples.sampling()), "sampling"),
        (lambda: FrameLane(0, 1, "prefill", 0, (5,), 0, (1,), 1), "sampling"),
        (lambda: FrameLane(0, 1, "prefill", 0, (5,), 0, (-1,), 1, examples.sampling()), "pages[0]"),
    ],
)
def test_construction_validates_too(build: Any, field: str) -> None:
    with pytest.raises(ProtocolError) as raised:
        build()
    assert raised.value.field == field


def test_frame_lane_count_is_bounded_by_batch_capacity() -> None:
    lanes = [examples.decode_lane(slot) for slot in range(5)]
    lanes = [dataclasses.replace(lane, pages=()) for lane in lanes]
    with pytest.raises(ProtocolError) as raised:
        Frame.from_lanes(1, examples.DECODE, lanes)  # B = 4
    assert raised.value.field == "slot" and "batch_capacity 4" in raised.value.reason
    assert Frame.from_lanes(1, examples.DECODE, lanes[:4]).num_lanes == 4


def test_error_completion_round_trips_and_carries_no_lanes():
    c = Completion(7, 1, 2, 0, error="rejected: program decode B=16 unknown")
    assert decode(encode(c)) == c and c.num_lanes == 0 and c.lane_results() == ()
    with pytest.raises(ProtocolError, match="error"):
        Completion.from_results(7, 0, 1, 0, lanes=(examples.lane_result(),), error="boom")
    with pytest.raises(ProtocolError, match="error"):
        Completion(7, 0, 1, 0, error="x" * 5000)


def test_decode_lanes_leave_sampling_to_the_slot_and_prefill_lanes_carry_theirs():
    frame = examples.frame()
    assert frame.sampling == ((0, examples.sampling()),)
    assert [lane.sampling for lane in frame.lanes] == [examples.sampling(), None]
    assert Frame.from_lanes(1, examples.MIXED, frame.lanes, 0) == dataclasses.replace(
        frame, fence=1, release_slots=(), expected_ns=0
    )


def test_empty_frame_carries_releases_but_no_prompt_row():
    empty = Frame(9, examples.DECODE, release_slots=(1, 2))
    assert decode(encode(empty)) == empty and empty.lanes == () and empty.num_lanes == 0
    with pytest.raises(ProtocolError) as raised:
        Frame(9, examples.DECODE, prompt_row=0)
    assert raised.value.field == "prompt_row"
