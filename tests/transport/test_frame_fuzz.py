"""Frame fuzzing against the decoders and a live channel pair (issue 15).

Every message type the codec knows is encoded, then broken at the byte level
(bit flips, truncation, extension, insertion, overwrites, duplicated runs) and
at the field level (a node of the msgpack tree replaced by junk of every type,
NaN, infinities, negative and out-of-range numbers; keys deleted or added;
values wrapped in lists; list items dropped or repeated).  ``decode`` must
either refuse with :class:`ProtocolError` (never another exception, never a
hang) or return a valid message that survives a round trip, with no NaN or
infinity in a float field and every interval a non-negative integer.  Targeted
cases pin the reasons: wrong versions, intervals that are NaN, negative or of
the wrong type, sidecars of the wrong shape, dtype or byte length, and
oversized messages and length bombs.  Last, a real ZeroMQ channel pair (ipc,
in-process) keeps serving after a stream of junk in both directions: every
piece is rejected with a logged reason and counted, and the valid message sent
after it arrives.

Hypothesis runs derandomized: the same examples on every run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import threading
import time
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.transport import codec
from runtime.transport.api import TokenLogprobs
from runtime.transport.channels import MAX_SOCKET_MESSAGE_BYTES
from runtime.transport.codec import MESSAGE_TYPES, decode, encode
from runtime.transport.columns import column
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.fields import MAX_SEQUENCE, ProtocolError
from runtime.transport.liveness import MAX_REJECT_LOGS, CoordinatorLiveness, LivenessConfig
from runtime.transport.rank_channel import RankChannel
from runtime.transport.schema import (
    MESSAGE_TYPES as RANK_MESSAGE_TYPES,
)
from runtime.transport.schema import PROTOCOL_VERSION, Message
from runtime.transport.tensor import Tensor
from tests.support import transport_examples as examples
from tests.support.fuzz_strategies import (
    ENCODED,
    VALID,
    envelope,
    envelope_of,
    field_mutations,
    junk_values,
    mutate_bytes,
    mutated_bytes,
    pack,
)

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,  # the machine is shared; a hang shows as a test that never ends
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
INTERVALS = {
    "Completion": ("device_ns", "readiness_delay_ns", "launch_wait_ns"),
    "Frame": ("expected_ns",),
}


def _walk(value: Any, path: str):
    """(path, leaf) for every field of a message, nested messages and tuples included."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}[{key}]")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]")
    else:
        yield path, value


def _check_valid(message: Message) -> None:
    """What a receiver may rely on once ``decode`` returned ``message``."""
    assert type(message) in MESSAGE_TYPES.values()
    assert decode(encode(message)) == message  # a stable, valid message
    for path, leaf in _walk(message, type(message).__name__):
        if isinstance(leaf, float):
            # -inf is a legal log probability; nothing else is infinite or NaN.
            legal_inf = "logprob" in path and leaf == -math.inf
            assert math.isfinite(leaf) or legal_inf, (path, leaf)
    for name in INTERVALS.get(type(message).__name__, ()):
        value = getattr(message, name)
        assert type(value) is int and value >= 0, (name, value)
    if isinstance(message, Completion):
        assert all(type(t) is int and t >= 0 for t in (*message.host_times, *message.stage_ns))


def _decode_or_refuse(data: bytes) -> Message | None:
    try:
        message = decode(data)
    except ProtocolError as exc:
        assert exc.field and exc.reason  # the logged reason names where
        return None
    _check_valid(message)
    return message


# ---------------------------------------------------------------- hypothesis


@settings(FUZZ, max_examples=1500)
@given(case=mutated_bytes())
def test_bytes_broken_anywhere_are_refused_or_valid(case: tuple[str, bytes]) -> None:
    _decode_or_refuse(case[1])


@settings(FUZZ, max_examples=1000)
@given(case=field_mutations())
def test_fields_broken_anywhere_are_refused_or_valid(case: tuple[str, Any, Any]) -> None:
    _, tree, _ = case
    data = pack(tree)
    if data is not None:
        _decode_or_refuse(data)


@settings(FUZZ, max_examples=300)
@given(
    index=st.integers(0, len(VALID) - 1),
    version=st.one_of(junk_values, st.integers(-(2**63), 2**64 - 1)).filter(
        lambda v: not (type(v) is int and v == PROTOCOL_VERSION)
    ),
)
def test_any_other_version_is_refused(index: int, version: Any) -> None:
    tree = envelope_of(VALID[index])
    tree["v"] = version
    data = pack(tree)
    if data is None:
        return
    with pytest.raises(ProtocolError) as raised:
        decode(data)
    assert raised.value.field in ("v", "message"), raised.value  # "message": bad keys


@settings(FUZZ, max_examples=300)
@given(
    name=st.sampled_from([*sorted(INTERVALS["Completion"]), "host_times", "stage_ns"]),
    value=junk_values,
)
def test_completion_intervals_take_only_non_negative_integers(name: str, value: Any) -> None:
    tree = envelope_of(examples.completion())
    body = tree["b"]
    if name in ("host_times", "stage_ns"):
        body[name] = [0, 1, 2, 3, 4, 5][: 4 if name == "host_times" else 6]
        body[name][1] = value
    else:
        body[name] = value
    data = pack(tree)
    if data is None:
        return
    message = _decode_or_refuse(data)
    if message is not None:  # only a valid non-negative integer gets through
        assert type(value) is int and value >= 0


# ---------------------------------------------------------------- targeted cases

BAD_NUMBERS = [math.nan, math.inf, -math.inf, -1, -1.0, 1.5, True, "5", None, b"\x01", [1]]


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize(
    ("message", "name"),
    [(examples.completion, n) for n in INTERVALS["Completion"]]
    + [(examples.frame, "expected_ns"), (examples.completion, "fence"), (examples.frame, "fence")],
)
def test_nan_negative_and_wrong_typed_intervals_are_refused_by_name(
    message: Any, name: str, value: Any
) -> None:
    tree = envelope_of(message())
    tree["b"][name] = value
    with pytest.raises(ProtocolError) as raised:
        decode(pack(tree))
    assert raised.value.field.endswith(name), raised.value
    assert "must" in raised.value.reason


def _sidecar(**overrides: Any) -> dict[str, Any]:
    wire = examples.confidence().to_wire()  # float32 [2, 3, 4]
    wire.update(overrides)
    return wire


@pytest.mark.parametrize(
    ("sidecars", "field"),
    [
        ({"confidence": _sidecar(shape=[2, 3, 5])}, "sidecars[confidence].data"),
        ({"confidence": _sidecar(shape=[24, 1, 1, 1, 1, 1, 1, 1, 1])}, "shape"),
        ({"confidence": _sidecar(shape=[-2, -3, 4])}, "shape[0]"),
        ({"confidence": _sidecar(shape=[2**31, 0])}, "shape[0]"),
        ({"confidence": _sidecar(shape=[2.0, 3, 4])}, "shape[0]"),
        ({"confidence": _sidecar(shape="2x3x4")}, "shape"),
        ({"confidence": _sidecar(dtype="float64")}, "dtype"),
        ({"confidence": _sidecar(dtype="int64")}, "data"),  # 96 bytes are 12 int64s
        ({"confidence": _sidecar(data=b"\x00" * 95)}, "data"),
        ({"confidence": _sidecar(data=[0.0] * 24)}, "data"),
        ({"confidence": _sidecar(data="x" * 96)}, "data"),
        ({"confidence": {**_sidecar(), "extra": 1}}, "extra"),
        ({"confidence": [2, 3, 4]}, "sidecars[confidence]"),
        ({"": _sidecar()}, "sidecars"),
        ({"x" * 65: _sidecar()}, "sidecars"),
        ({f"s{i}": _sidecar() for i in range(17)}, "sidecars"),
        ([_sidecar()], "sidecars"),
    ],
)
def test_sidecars_of_the_wrong_shape_dtype_or_length_are_refused(sidecars: Any, field: str) -> None:
    tree = envelope_of(examples.completion())
    tree["b"]["sidecars"] = sidecars
    with pytest.raises(ProtocolError) as raised:
        decode(pack(tree))
    assert field in raised.value.field, raised.value


def test_sidecars_only_from_rank_0_and_never_on_an_error() -> None:
    tree = envelope_of(examples.completion())
    tree["b"].update(rank=1, slot=b"", generation=b"", token_count=b"", tokens=b"", finished=b"")
    tree["b"]["sidecars"] = {"logprobs": Tensor.from_values("float32", (1, 1), [0.0]).to_wire()}
    with pytest.raises(ProtocolError, match="only rank 0 reports"):
        decode(pack(tree))
    tree["b"]["rank"], tree["b"]["error"] = 0, "boom"
    with pytest.raises(ProtocolError, match="carries no lanes or sidecars"):
        decode(pack(tree))


@pytest.mark.parametrize("value", [math.nan, -math.nan, math.inf])
def test_log_probabilities_refuse_nan_and_positive_infinity(value: float) -> None:
    assert TokenLogprobs(-math.inf, (1,), (-math.inf,)).logprob == -math.inf  # legal
    with pytest.raises(ProtocolError, match="logprob"):
        TokenLogprobs(value)
    with pytest.raises(ProtocolError, match=r"top_logprobs\[1\]"):
        TokenLogprobs(-1.0, (1, 2), (-1.0, value))
    tree = envelope_of(TokenLogprobs(-0.5, (3,), (-0.5,)))
    tree["b"]["logprob"] = value
    with pytest.raises(ProtocolError, match="logprob"):
        decode(pack(tree))


def _frame_with_pages(count: int) -> bytes:
    tree = envelope_of(examples.decode_frame(1))
    tree["b"]["page_count"] = column([count]).tobytes()
    tree["b"]["pages"] = column(range(count)).tobytes()
    return pack(tree)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x00" * (codec.MAX_MESSAGE_BYTES + 1), "exceed the limit"),
        (b"\xc6\x7f\xff\xff\xff" + b"\x00" * 16, "malformed msgpack"),  # bin32 of 2 GiB
        (b"\xdb\x7f\xff\xff\xff" + b"a" * 16, "malformed msgpack"),  # str32 of 2 GiB
        (b"\xdd\x7f\xff\xff\xff" + b"\xc0" * 16, "malformed msgpack"),  # array32 of 2**31
        (b"\xdf\x7f\xff\xff\xff" + b"\xc0" * 16, "malformed msgpack"),  # map32 of 2**31
        (b"\xde\x04\x01" + b"\xa1a\xc0" * 1025, "malformed msgpack"),  # map16 above the cap
        (b"\x91" * 200_000 + b"\xc0", "malformed msgpack"),  # nesting bomb
        (b"\xc7\x00\x05", "extension type 5"),
        (envelope("Control", {"command": "x" * (codec.MAX_STR_LEN + 1)}), "malformed msgpack"),
        (_frame_with_pages(MAX_SEQUENCE + 1), "at most"),
    ],
    ids=[
        "over-64MiB",
        "bin32",
        "str32",
        "array32",
        "map32",
        "map-cap",
        "nesting",
        "ext",
        "long-str",
        "long-column",
    ],
)
def test_oversized_messages_and_length_bombs_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as raised:
        decode(data)
    assert reason in raised.value.reason


@pytest.mark.parametrize(
    "tree",
    [
        {"v": PROTOCOL_VERSION, "t": "Frame"},
        {"v": PROTOCOL_VERSION, "t": "Frame", "b": {}, "x": 1},
        {"v": PROTOCOL_VERSION, "t": "Pickle", "b": {}},
        {"v": PROTOCOL_VERSION, "t": "Frame", "b": {}},
        {
            "v": PROTOCOL_VERSION,
            "t": "Completion",
            "b": {**examples.completion().to_wire(), "forged": True},
        },
        [PROTOCOL_VERSION, "Frame", {}],
    ],
    ids=["missing-body", "extra-key", "unknown-type", "empty-body", "extra-field", "list"],
)
def test_envelopes_with_missing_or_extra_parts_are_refused(tree: Any) -> None:
    with pytest.raises(ProtocolError):
        decode(pack(tree))


def test_the_corpus_covers_every_message_type() -> None:
    assert {type(m).__name__ for m in VALID} == set(MESSAGE_TYPES)
    assert set(RANK_MESSAGE_TYPES) <= set(MESSAGE_TYPES)


# ---------------------------------------------------------------- a live channel pair


def _junk(seed: int, count: int, inbound: tuple[type, ...]) -> list[bytes]:
    """``count`` byte strings every receiver must refuse: mutated encodings that
    ``decode`` refuses, valid messages of the wrong direction, wrong versions."""
    rng = random.Random(seed)
    out = [
        b"",
        b"\x93not msgpack",
        envelope("Control", Control("ping").to_wire(), PROTOCOL_VERSION + 1),
        envelope("Control", Control("ping").to_wire(), math.nan),
    ]
    out += [encode(m) for m in VALID if not isinstance(m, inbound)][:6]
    while len(out) < count:
        data = mutate_bytes(rng.choice(ENCODED), rng, rng.randint(1, 3))
        try:
            decode(data)
        except ProtocolError:
            out.append(data)
    return out


@pytest.fixture
def channel_pair() -> Any:
    coordinator = CoordinatorChannel(1)
    rank = RankChannel(coordinator.endpoints, 0)
    waiter = threading.Thread(target=rank.handshake, kwargs={"timeout_ms": 10_000})
    waiter.start()
    coordinator.handshake(timeout_s=10.0)
    waiter.join(10.0)
    yield coordinator, rank
    rank.close()
    coordinator.close()


def test_channels_keep_serving_after_a_stream_of_junk(
    channel_pair: Any, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator, rank = channel_pair
    valid_frame = examples.frame()
    valid_completion = dataclasses.replace(examples.completion(), world_size=1)
    context = zmq.Context.instance()
    raw = context.socket(zmq.PUSH)  # a stranger on the completions endpoint
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(coordinator.endpoints.completions)
    try:
        with caplog.at_level(logging.WARNING, logger="runtime.transport"):
            # Frames direction: junk straight onto the coordinator's PUB socket.
            to_rank = _junk(1, 150, RankChannel.inbound)
            to_rank.append(encode(Control("ready", rank=0, nonce=1)))  # a rank's command
            for data in to_rank:
                coordinator._pub.send(data)
            coordinator._pub.send_multipart([encode(valid_frame), b"tail"])
            coordinator.publish(valid_frame)
            assert rank.recv(timeout_ms=10_000) == valid_frame
            assert rank.rejected == len(to_rank) + 1
            # Never silence: the rank answered each with an error control saying why.
            errors = [coordinator.recv(timeout_ms=10_000) for _ in range(rank.rejected)]
            assert all(isinstance(e, Control) and e.command == "error" for e in errors)
            assert {e.rank for e in errors} == {0} and all(e.reason for e in errors)
            assert "multipart message (2 parts)" in errors[-1].reason
            assert "protocol version" in errors[2].reason
            # Completions direction: junk from a stranger's PUSH, then a valid one (same
            # socket, so in order).
            to_coordinator = _junk(2, 150, CoordinatorChannel.inbound)
            wrong_world = dataclasses.replace(examples.completion(), world_size=2)
            to_coordinator += [encode(wrong_world), encode(Control("ready", rank=5, nonce=1))]
            for data in to_coordinator:
                raw.send(data)
            raw.send(encode(valid_completion))
            assert coordinator.recv(timeout_ms=10_000) == valid_completion
            assert coordinator.rejected == len(to_coordinator)
            # Both keep serving in both directions.
            coordinator.publish(Control("shutdown"))
            assert rank.recv(timeout_ms=10_000) == Control("shutdown")
            rank.send(valid_completion)
            assert coordinator.recv(timeout_ms=10_000) == valid_completion
            assert coordinator.recv(timeout_ms=0) is None and rank.recv(timeout_ms=0) is None
    finally:
        raw.close()
    rejected = [r.getMessage() for r in caplog.records if "rejected message" in r.getMessage()]
    assert len(rejected) == len(to_rank) + 1 + len(to_coordinator)
    assert any("multipart message (2 parts)" in text for text in rejected)
    assert any("protocol version" in text for text in rejected)
    assert any("says world size 2, expected 1" in text for text in rejected)
    assert any("unexpected Frame on this channel" in text for text in rejected)


def test_the_heartbeat_watcher_keeps_watching_after_a_stream_of_junk(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The coordinator's heartbeat thread (ROUTER) refuses junk from a stranger's
    DEALER, counts it and keeps going: a valid heartbeat after it is recorded,
    and the thread answers with its own heartbeats."""
    with contextlib.ExitStack() as stack:  # closed in reverse, the channel last
        channel = CoordinatorChannel(2, heartbeat=True)
        stack.callback(channel.close)
        gone: list[str] = []
        liveness = CoordinatorLiveness(
            channel.take_heartbeat_socket(), 2, LivenessConfig(0.05, 60.0),
            lambda rank, reason: gone.append(reason),
        )  # fmt: skip
        liveness.start()
        stack.callback(liveness.close)
        context = zmq.Context()
        stack.callback(context.term)
        raw = context.socket(zmq.DEALER)
        stack.callback(raw.close)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(channel.endpoints.heartbeat)
        junk = _junk(3, 60, (Control,))
        junk += [encode(Control("ping")), encode(Control("heartbeat", rank=5, nonce=1))]
        with caplog.at_level(logging.WARNING, logger="runtime.transport.liveness"):
            for data in junk:
                raw.send(data)
            raw.send_multipart([encode(Control("heartbeat", rank=1, nonce=1)), b"tail"])
            raw.send(encode(Control("heartbeat", rank=1, nonce=2)))
            deadline = time.monotonic() + 10.0
            while liveness.last_heartbeat_ns(1) is None:
                assert time.monotonic() < deadline, "the valid heartbeat after the junk was lost"
                time.sleep(0.01)
        logged = [r.getMessage() for r in caplog.records if "rejected message" in r.getMessage()]
        assert len(logged) == MAX_REJECT_LOGS  # the first ones, with their reasons
        assert "malformed msgpack" in logged[0] and "protocol version" in logged[2]
        assert liveness.rejected == len(junk) + 1 and liveness.alive
        assert liveness.heard == [1] and liveness.last_heartbeat_ns(0) is None
        assert raw.poll(10_000), "no heartbeat back from the coordinator"
        assert decode(raw.recv()).command == "heartbeat"
        assert not gone


def test_an_oversized_message_is_dropped_by_the_socket_and_the_channel_keeps_serving(
    channel_pair: Any,
) -> None:
    """Past ZMQ_MAXMSGSIZE the socket drops the sender's connection while the
    message arrives, before it is buffered: nothing reaches the decoder, and the
    valid messages of other peers (and of the same stranger, reconnected) still do."""
    coordinator, rank = channel_pair
    context = zmq.Context()
    raw = context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(coordinator.endpoints.completions)
    try:
        raw.send(b"\x00" * (MAX_SOCKET_MESSAGE_BYTES + 1))
        valid = dataclasses.replace(examples.completion(), world_size=1)
        rank.send(valid)
        assert coordinator.recv(timeout_ms=10_000) == valid
        for _ in range(50):  # the stranger reconnects; its valid message gets through
            raw.send(encode(valid))
            if coordinator.recv(timeout_ms=200) == valid:
                break
        else:
            raise AssertionError("the reconnected peer's valid message never arrived")
        # Queued behind it on the same pipe, the oversized message would have been
        # decoded (and rejected) first: ZeroMQ dropped it instead.
        assert coordinator.rejected == 0
    finally:
        raw.close()
        context.term()
