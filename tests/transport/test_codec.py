"""The msgpack envelope: everything that is not a valid, current message is refused."""

from __future__ import annotations

import logging
import pickle
from typing import Any

import msgpack
import pytest

from runtime.transport import codec
from runtime.transport.codec import decode, decode_or_log, encode
from runtime.transport.control import Control
from runtime.transport.fields import ProtocolError
from runtime.transport.schema import PROTOCOL_VERSION
from tests.support import transport_examples as examples


def _envelope(**overrides: Any) -> bytes:
    envelope = {"v": PROTOCOL_VERSION, "t": "Control", "b": examples.control().to_wire()}
    envelope.update(overrides)
    return msgpack.packb(envelope, use_bin_type=True)


def _refused(data: Any, field: str, reason: str) -> None:
    with pytest.raises(ProtocolError) as raised:
        decode(data)
    assert raised.value.field == field
    assert reason in raised.value.reason


def test_envelope_shape() -> None:
    assert msgpack.unpackb(encode(examples.control())) == {
        "v": PROTOCOL_VERSION,
        "t": "Control",
        "b": {"command": "ready", "rank": 1, "nonce": 12345, "count": 0, "reason": ""},
    }
    assert decode(_envelope()) == examples.control()
    assert decode(bytearray(_envelope())) == examples.control()
    assert decode(memoryview(_envelope())) == examples.control()


@pytest.mark.parametrize(
    "version",
    [
        0,
        PROTOCOL_VERSION - 1,
        PROTOCOL_VERSION + 1,
        -1,
        str(PROTOCOL_VERSION),
        float(PROTOCOL_VERSION),
        True,
        None,
    ],
)
def test_wrong_version_is_refused(version: Any) -> None:
    _refused(_envelope(v=version), "v", "protocol version")


@pytest.mark.parametrize("name", ["Bogus", "control", "", 3, None, "__class__", "ProtocolError"])
def test_unknown_type_is_refused(name: Any) -> None:
    _refused(_envelope(t=name), "t", "unknown message type")


@pytest.mark.parametrize(
    "envelope",
    [
        [1, "Control", {}],
        {"v": PROTOCOL_VERSION, "t": "Control"},
        {"v": PROTOCOL_VERSION, "t": "Control", "b": {}, "x": 0},
        "Control",
        None,
    ],
)
def test_malformed_envelope_is_refused(envelope: Any) -> None:
    _refused(msgpack.packb(envelope), "message", "envelope")


@pytest.mark.parametrize("body", [[], "x", None, b"\x00"])
def test_body_must_be_a_map(body: Any) -> None:
    _refused(_envelope(b=body), "b", "body must be a map")


def test_every_truncation_is_refused() -> None:
    data = encode(examples.completion())
    for end in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:end])


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"hello world", b"\x00" * 8, _envelope() + b"\x00"],
    ids=["empty", "never-used-byte", "text", "zeros", "trailing-bytes"],
)
def test_non_msgpack_is_refused(data: bytes) -> None:
    with pytest.raises(ProtocolError) as raised:
        decode(data)
    assert raised.value.field in ("message", "b")


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize(
    "payload",
    [
        examples.control(),
        {"v": PROTOCOL_VERSION, "t": "Control", "b": examples.control().to_wire()},
    ],
    ids=["dataclass", "envelope-dict"],
)
def test_pickle_payload_is_refused(payload: Any, protocol: int) -> None:
    with pytest.raises(ProtocolError):
        decode(pickle.dumps(payload, protocol=protocol))


def test_extension_types_are_refused() -> None:
    _refused(msgpack.packb(msgpack.ExtType(5, b"abc")), "message", "max_ext_len")
    _refused(_envelope(b=msgpack.ExtType(5, b"")), "message", "extension type 5")


def test_non_string_map_keys_are_refused() -> None:
    _refused(msgpack.packb({1: "a"}), "message", "map key")


def test_deep_nesting_is_refused() -> None:
    with pytest.raises(ProtocolError):
        decode(b"\x91" * 100_000)


def test_oversized_message_is_refused_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(examples.completion())
    monkeypatch.setattr(codec, "MAX_MESSAGE_BYTES", len(data) - 1)
    _refused(data, "message", "exceed the limit")


def test_an_oversized_message_is_refused_by_the_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiving socket drops a message over the limit unseen (ZMQ_MAXMSGSIZE):
    the sender must learn it instead, naming the type and the size."""
    size = len(encode(examples.completion()))
    monkeypatch.setattr(codec, "MAX_MESSAGE_BYTES", size - 1)
    with pytest.raises(ProtocolError, match=f"Completion of {size} bytes exceeds the limit"):
        encode(examples.completion())


def test_length_caps_apply() -> None:
    _refused(msgpack.packb(["x"] * (codec.MAX_ARRAY_LEN + 1)), "message", "max_array_len")


def test_not_bytes_is_refused() -> None:
    _refused("text", "message", "must be bytes")


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(TypeError):
        encode({"command": "ping"})  # type: ignore[arg-type]


def test_decode_or_log_warns_with_reason(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="runtime.transport"):
        assert decode_or_log(_envelope(v=PROTOCOL_VERSION + 1), "test peer") is None
        assert decode_or_log(encode(Control("ping")), "test peer") == Control("ping")
    (record,) = caplog.records
    assert record.name == "runtime.transport"
    assert (
        "test peer" in record.getMessage()
        and f"protocol version {PROTOCOL_VERSION + 1}" in record.getMessage()
    )
