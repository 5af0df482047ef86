"""msgpack envelope for every transport message; never pickle.

Wire form: one msgpack map ``{"v": PROTOCOL_VERSION, "t": type name, "b": body}``
where ``body`` is the message's ``to_wire()`` map.  Decoding refuses anything
else with :class:`ProtocolError` and a reason: bytes over
:data:`MAX_MESSAGE_BYTES`, bytes that are not exactly one msgpack object
(pickles included), another version, an unknown type name, or a body that its
schema rejects.  msgpack extension types are refused, map keys must be strings
(``strict_map_key``), and every string, binary, array and map length is capped
before anything is allocated.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack

from runtime.transport.api import API_MESSAGE_TYPES, ApiMessage
from runtime.transport.fields import ProtocolError
from runtime.transport.schema import MESSAGE_TYPES as RANK_MESSAGE_TYPES
from runtime.transport.schema import PROTOCOL_VERSION, Message

# Rank messages (schema) and frontend messages (api) share the envelope.
WireMessage = Message | ApiMessage
MESSAGE_TYPES: dict[str, type[WireMessage]] = {**RANK_MESSAGE_TYPES, **API_MESSAGE_TYPES}

logger = logging.getLogger("runtime.transport")

MAX_MESSAGE_BYTES = 64 << 20  # a frame of a long prompt is 8 bytes per token (int64 columns)
MAX_STR_LEN = 1 << 16
MAX_BIN_LEN = MAX_MESSAGE_BYTES
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 1 << 10

_ENVELOPE_KEYS = frozenset({"v", "t", "b"})


def encode(message: WireMessage) -> bytes:
    """The envelope of an (already validated) message, as msgpack bytes."""
    name = type(message).__name__
    if MESSAGE_TYPES.get(name) is not type(message):
        raise TypeError(f"not a transport message: {type(message).__name__}")
    envelope = {"v": PROTOCOL_VERSION, "t": name, "b": message.to_wire()}
    data = msgpack.packb(envelope, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:  # the receiver's socket would drop it unseen
        raise ProtocolError(
            "message", f"{name} of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}"
        )
    return data


def unpack(data: bytes | bytearray | memoryview) -> Any:
    """One msgpack object from ``data`` with every length capped; ProtocolError otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("message", f"must be bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError("message", f"{size} bytes exceed the limit of {MAX_MESSAGE_BYTES}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=MAX_STR_LEN,
            max_bin_len=MAX_BIN_LEN,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
            ext_hook=_refuse_ext,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError("message", f"malformed msgpack ({type(exc).__name__}: {exc})") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("message", f"msgpack extension type {code} is not allowed")


def decode(data: bytes | bytearray | memoryview) -> WireMessage:
    """The message in ``data``; ProtocolError with the reason for anything malformed."""
    envelope = unpack(data)
    if not isinstance(envelope, dict):
        raise ProtocolError("message", f"envelope must be a map, got {type(envelope).__name__}")
    if set(envelope) != _ENVELOPE_KEYS:
        raise ProtocolError("message", f"envelope keys must be v, t, b; got {sorted(envelope)}")
    version = envelope["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            "v", f"protocol version {version!r}, this build speaks {PROTOCOL_VERSION}"
        )
    name = envelope["t"]
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError("t", f"unknown message type {name!r}")
    body = envelope["b"]
    if not isinstance(body, dict):
        raise ProtocolError("b", f"{name} body must be a map, got {type(body).__name__}")
    try:
        return cls.from_wire(body)
    except ProtocolError as exc:
        raise exc.within(name) from None
    except Exception as exc:  # a schema bug must not take the receiver down
        raise ProtocolError(name, f"invalid body ({type(exc).__name__}: {exc})") from None


def decode_or_log(data: bytes | bytearray | memoryview, source: str) -> WireMessage | None:
    """``decode``, or None after a logged warning naming ``source`` and the reason."""
    try:
        return decode(data)
    except ProtocolError as exc:
        logger.warning("rejected message from %s: %s", source, exc)
        return None
