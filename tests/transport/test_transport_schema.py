"""Message schema: round trips and every validation rule, each naming its field."""

from __future__ import annotations

import copy
import math
import struct
import subprocess
import sys
from typing import Any

import msgpack
import pytest

from runtime.transport.codec import decode, encode
from runtime.transport.schema import (
    MESSAGE_TYPES,
    Completion,
    Control,
    FrameLane,
    ProtocolError,
    SamplingParams,
    Tensor,
)
from tests.transport import examples

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
    assert envelope == {"v": 1, "t": name, "b": message.to_wire()}
    wire = msgpack.unpackb(msgpack.packb(message.to_wire(), use_bin_type=True), raw=False)
    assert type(message).from_wire(wire) == message


def test_every_message_type_has_an_example() -> None:
    assert set(examples.ALL) == set(MESSAGE_TYPES)


def test_sequences_are_tuples_and_wire_form_is_plain() -> None:
    frame = examples.frame()
    assert isinstance(frame.lanes, tuple)
    assert isinstance(frame.lanes[0].prompt_tokens, tuple)
    wire = frame.to_wire()
    assert wire["lanes"][0]["prompt_tokens"] == [1, 2, 3, 151_643]
    assert wire["program"] == examples.MIXED.to_wire()


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
        assert decode(encode(lane)).sampling == params
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
    completion = Completion(
        4, 0, 1, 10, lanes=examples.completion().lanes,
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
    from runtime.transport.schema import tensor_from_torch, tensor_to_torch

    for dtype in (torch.float32, torch.int32, torch.int64, torch.float16, torch.bfloat16):
        value = (torch.arange(24) - 5).to(dtype).reshape(2, 3, 4)[:, 1:]  # a non-contiguous view
        tensor = tensor_from_torch(value)
        assert tensor.shape == (2, 2, 4)
        assert torch.equal(tensor_to_torch(decode(encode(tensor))), value)
    assert tensor_from_torch(torch.ones(2, 3)) == Tensor.from_values("float32", (2, 3), [1.0] * 6)
    assert tensor_to_torch(Tensor("float32", (0, 3), b"")).shape == (0, 3)
    with pytest.raises(ProtocolError, match="dtype"):
        tensor_from_torch(torch.zeros(2, dtype=torch.float64))


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
    _case("FrameLane", "sampling.logprobs", 21, "sampling.logprobs"),
    _case("SamplingParams", "min_p", 0.1, "min_p"),  # unknown field
    _case("SamplingParams", "seed", None, "seed", drop=True),  # missing field
    # FrameLane (the prefill example)
    _case("FrameLane", "slot", -1, "slot"),
    _case("FrameLane", "slot", 64, "slot"),
    _case("FrameLane", "generation", 0, "generation"),
    _case("FrameLane", "phase", "verify", "phase"),
    _case("FrameLane", "phase", "decode", "prompt_tokens"),  # decode lanes carry no tokens
    _case("FrameLane", "prompt_start", -1, "prompt_start"),
    _case("FrameLane", "prompt_tokens", [1, -2], "prompt_tokens[1]"),
    _case("FrameLane", "prompt_tokens", [1, 2**31], "prompt_tokens[1]"),
    _case("FrameLane", "prompt_tokens", [1, True], "prompt_tokens[1]"),
    _case("FrameLane", "prompt_tokens", "abc", "prompt_tokens"),
    _case("FrameLane", "prompt_tokens", [], "prompt_tokens"),  # prefill needs tokens
    _case("FrameLane", "position", -1, "position"),
    _case("FrameLane", "page_table", [], "page_table"),
    _case("FrameLane", "page_table", [1, 1], "page_table"),
    _case("FrameLane", "page_table", [1, -1], "page_table[1]"),
    _case("FrameLane", "max_tokens", 2, "max_tokens"),
    _case("FrameLane", "sampling", [0.0, 1.0], "sampling"),
    _case("FrameLane", "sampling.top_p", 2.0, "sampling.top_p"),
    # Frame (mixed B=4, prompt capacity 64, lanes: prefill slot 3, decode slot 4)
    _case("Frame", "fence", -1, "fence"),
    _case("Frame", "fence", BIG, "fence"),
    _case("Frame", "program.kind", "bogus", "program"),
    _case("Frame", "program.batch_capacity", 3, "program"),
    _case("Frame", "program", "decode", "program"),
    _case("Frame", "lanes", {}, "lanes"),
    _case("Frame", "lanes.1.slot", 3, "lanes.slot"),  # duplicate slot
    _case("Frame", "lanes.0.prompt_tokens", list(range(65)), "lanes"),  # over prompt capacity
    _case("Frame", "lanes.1.max_tokens", 0, "lanes[1].max_tokens"),
    _case("Frame", "lanes.0", 7, "lanes[0]"),
    _case("Frame", "prompt_row", 2, "prompt_row"),
    _case("Frame", "prompt_row", -2, "prompt_row"),
    _case("Frame", "prompt_row", 1, "prompt_row"),  # a decode lane
    _case("Frame", "prompt_row", -1, "prompt_row"),  # the mixed frame's prefill lane unnamed
    _case("Frame", "lanes.1.prompt_tokens", [1], "lanes[1].prompt_tokens"),  # decode: none
    _case("Frame", "lanes.1", examples.prefill_lane(slot=4).to_wire(), "lanes"),  # 2 prefills
    _case("Frame", "release_slots", [64], "release_slots[0]"),
    _case("Frame", "release_slots", [1, 1], "release_slots"),
    _case("Frame", "release_slots", [4], "release_slots"),  # also runs in lanes
    # Tensor ([2, 3, 4] float32)
    _case("Tensor", "dtype", "float64", "dtype"),
    _case("Tensor", "shape", [2, -3, 4], "shape[1]"),
    _case("Tensor", "shape", [1] * 9, "shape"),
    _case("Tensor", "shape", [2, 3, 5], "data"),
    _case("Tensor", "data", b"\x00" * 95, "data"),
    _case("Tensor", "data", "x" * 96, "data"),
    # LaneResult
    _case("LaneResult", "slot", 64, "slot"),
    _case("LaneResult", "generation", 0, "generation"),
    _case("LaneResult", "tokens", [-1], "tokens[0]"),
    _case("LaneResult", "tokens", [], "finish_reason"),  # "stop" needs a token
    _case("LaneResult", "finish_reason", "length", "finish_reason"),
    _case("LaneResult", "finish_reason", 1, "finish_reason"),
    # Completion (rank 0 of 2)
    _case("Completion", "fence", -1, "fence"),
    _case("Completion", "rank", 2, "rank"),
    _case("Completion", "rank", 1, "lanes"),  # only rank 0 reports lanes
    _case("Completion", "world_size", 0, "world_size"),
    _case("Completion", "device_ns", -1, "device_ns"),
    _case("Completion", "device_ns", 1.5, "device_ns"),
    _case("Completion", "readiness_delay_ns", -1, "readiness_delay_ns"),
    _case("Completion", "lanes.1.slot", 3, "lanes.slot"),
    _case("Completion", "lanes.0.tokens", [1, -1], "lanes[0].tokens[1]"),
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
    packed = msgpack.packb({"v": 1, "t": name, "b": wire}, use_bin_type=True)
    with pytest.raises(ProtocolError) as raised:
        decode(packed)
    assert raised.value.field == f"{name}.{field}"


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: SamplingParams(temperature=-1.0), "temperature"),
        (lambda: Control("ping", rank=0, nonce=-5), "nonce"),
        (lambda: Completion(0, 1, 2, 5, sidecars={"c": examples.confidence()}), "sidecars"),
        (lambda: Completion(0, 0, 1, 5, lanes=[examples.decode_lane()]), "lanes[0]"),
        (lambda: Completion(0, 0, 1, 5, sidecars={"": examples.confidence()}), "sidecars"),
        (lambda: Tensor("float32", (2,), bytearray(7)), "data"),
    ],
)
def test_construction_validates_too(build: Any, field: str) -> None:
    with pytest.raises(ProtocolError) as raised:
        build()
    assert raised.value.field == field


def test_frame_lane_count_is_bounded_by_batch_capacity() -> None:
    frame = examples.frame().to_wire()
    frame["program"] = examples.DECODE.to_wire()  # B = 4, no prompt capacity
    frame["prompt_row"] = -1
    frame["lanes"] = [examples.decode_lane(slot).to_wire() for slot in range(5)]
    frame["release_slots"] = []
    with pytest.raises(ProtocolError) as raised:
        MESSAGE_TYPES["Frame"].from_wire(frame)
    assert raised.value.field == "lanes"
    frame["lanes"] = frame["lanes"][:4]
    assert len(MESSAGE_TYPES["Frame"].from_wire(frame).lanes) == 4


def test_error_completion_round_trips_and_carries_no_lanes():
    from runtime.transport.codec import decode, encode
    from runtime.transport.schema import Completion, LaneResult, ProtocolError

    c = Completion(7, 1, 2, 0, error="rejected: program decode B=16 unknown")
    assert decode(encode(c)) == c
    with pytest.raises(ProtocolError, match="error"):
        Completion(7, 0, 1, 0, lanes=(LaneResult(0, 1, (3,)),), error="boom")
    with pytest.raises(ProtocolError, match="error"):
        Completion(7, 0, 1, 0, error="x" * 5000)


def test_decode_lanes_may_leave_sampling_to_the_slot_but_prefill_lanes_may_not():
    from runtime.transport.schema import FrameLane, ProtocolError

    lane = FrameLane(2, 1, "decode", 0, (), 9, (), 1, None)
    assert FrameLane.from_wire(lane.to_wire()) == lane
    with pytest.raises(ProtocolError, match="sampling"):
        FrameLane(2, 1, "prefill", 0, (5,), 0, (1,), 1, None)


def test_empty_frame_carries_releases_but_no_prompt_row():
    from runtime.transport.schema import Frame, ProtocolError

    empty = Frame(9, examples.DECODE, (), release_slots=(1, 2))
    assert decode(encode(empty)) == empty and empty.lanes == ()
    with pytest.raises(ProtocolError) as raised:
        Frame(9, examples.DECODE, (), prompt_row=0)
    assert raised.value.field == "prompt_row"
