"""What crosses the pipe between the frontend and a preprocessing worker: frames
(a msgpack header and a raw payload) and the frozen dataclasses they carry, every
field checked on the way in (nothing is pickled across processes)."""

from __future__ import annotations

import dataclasses
import struct
import types
import typing
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack

from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import GenerationRequest, ServingLimits
from runtime.image_spans import ImageSpanError, check_spans

MAX_FRAME_BYTES = 1 << 30
FRAME = struct.Struct(">II")  # header length, payload length; then msgpack header, payload


class WireError(ValueError):
    """A worker's answer that does not check out."""


def _union_args(tp: Any) -> tuple | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _encode(tp: Any, value: Any) -> Any:
    """``value`` (of dataclass field type ``tp``) as msgpack takes it: int tuples as
    packed 64-bit arrays, other tuples as lists."""
    args = _union_args(tp)
    if args is not None:
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _encode(inner, value)
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)
        if len(inner) == 2 and inner[1] is Ellipsis:
            if inner[0] is int:
                return array("q", value).tobytes()
            return [_encode(inner[0], v) for v in value]
        return [_encode(t, v) for t, v in zip(inner, value)]
    if tp in (int, float, bool, str, bytes):
        return value
    if dataclasses.is_dataclass(tp):
        return to_wire(value)
    raise TypeError(f"no wire form for {tp!r}")


def _decode(tp: Any, value: Any, name: str) -> Any:
    """The inverse of :func:`_encode`, checking every type (WireError naming ``name``)."""
    args = _union_args(tp)
    if args is not None:
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value, name)
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)
        if len(inner) == 2 and inner[1] is Ellipsis:
            if inner[0] is int:
                if not isinstance(value, bytes) or len(value) % 8:
                    raise WireError(f"{name}: expected packed 64-bit ints")
                return tuple(array("q", value))
            if not isinstance(value, (list, tuple)):
                raise WireError(f"{name}: expected a list")
            return tuple(_decode(inner[0], v, name) for v in value)
        if not isinstance(value, (list, tuple)) or len(value) != len(inner):
            raise WireError(f"{name}: expected {len(inner)} items")
        return tuple(_decode(t, v, name) for t, v in zip(inner, value))
    if tp is float and type(value) in (int, float):
        return float(value)
    if tp in (int, bool, str, bytes) and type(value) is tp:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_wire(tp, value)
    raise WireError(f"{name}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_HINTS: dict[type, dict[str, Any]] = {}


def to_wire(obj: Any) -> dict[str, Any]:
    """A frozen dataclass (GenerationRequest, ServingLimits, ...) as a msgpack map;
    a field that is a dataclass (PreparedImage, ImageLimits) is a nested map, bytes
    stay bytes (an image's pixels: shape and dtype are fields beside them)."""
    cls = type(obj)
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, _hints(cls))
    return {f.name: _encode(hints[f.name], getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def from_wire(cls: type, data: Any) -> Any:
    """``cls`` from :func:`to_wire`'s map, every field checked (missing ones take
    their defaults); WireError when something does not check out."""
    if not isinstance(data, dict):
        raise WireError(f"{cls.__name__}: expected a map")
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, _hints(cls))
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise WireError(f"{cls.__name__}: unknown fields {sorted(map(str, unknown))}")
    values = {name: _decode(hints[name], value, name) for name, value in data.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise WireError(f"{cls.__name__}: {exc}") from None


def requests_to_wire(reqs: Sequence[GenerationRequest]) -> list[dict[str, Any]]:
    return [to_wire(r) for r in reqs]


def requests_from_wire(data: Any, limits: ServingLimits) -> list[GenerationRequest]:
    """A worker's requests, checked: every field's type, and the token ids in the
    vocabulary and within the context."""
    if not isinstance(data, (list, tuple)) or not data:
        raise WireError("requests: expected a non-empty list")
    out = []
    for item in data:
        req = from_wire(GenerationRequest, item)
        ids = req.prompt_token_ids
        if not ids or len(ids) >= max(limits.max_context, 1) + 1:
            raise WireError("prompt_token_ids: empty, or longer than the context")
        if min(ids) < 0 or max(ids) >= limits.vocab_size:
            raise WireError("prompt_token_ids: outside the vocabulary")
        _check_images(req, limits)
        out.append(req)
    return out


def _check_images(req: GenerationRequest, limits: ServingLimits) -> None:
    """A request's images: only for a model that takes them, within the count, each
    one's hash that of its pixels (PreparedImage checked shape, dtype, size), and
    one span per image: its digest the image's hash, in order, disjoint, inside the
    prompt, over the model's image token."""
    if not req.images and not req.image_spans:
        return
    if limits.image_tokens is None:
        raise WireError("images: the served model does not accept images")
    if len(req.images) > limits.images.max_images_per_prompt:
        raise WireError("images: more than the limit per request")
    if not all(image.hash_matches() for image in req.images):
        raise WireError("images: an image's hash is not that of its pixels")
    spans = req.image_spans
    if [s.digest for s in spans] != [i.image_hash for i in req.images]:
        raise WireError("image_spans: not one per image, with its hash")
    try:
        check_spans(spans, len(req.prompt_token_ids))
    except ImageSpanError as exc:
        raise WireError(f"image_spans: {exc}") from None
    tokens = limits.image_tokens
    for span in spans:
        held = req.prompt_token_ids[span.start : span.end]
        if span.length != tokens.tokens_per_image or set(held) != {tokens.image_token_id}:
            raise WireError("image_spans: a span is not the image's image tokens")


def error_to_wire(exc: RequestError) -> dict[str, Any]:
    return {
        "status": exc.status,
        "message": exc.message,
        "param": exc.param,
        "type": exc.type,
        "code": exc.code,
    }


def error_from_wire(data: Any) -> RequestError:
    if not isinstance(data, dict):
        raise WireError("error: expected a map")
    status = data.get("status")
    if type(status) is not int or not 400 <= status < 600:
        raise WireError("error: bad status")
    message, kind = data.get("message"), data.get("type")
    if not isinstance(message, str) or not isinstance(kind, str):
        raise WireError("error: bad message or type")
    param, code = data.get("param"), data.get("code")
    if not (param is None or isinstance(param, str)) or not (code is None or isinstance(code, str)):
        raise WireError("error: bad param or code")
    return RequestError(status, message, param, kind, code=code)


Body = bytes | Sequence[bytes]  # a body whole, or in the chunks it arrived in


def body_size(body: Body) -> int:
    return len(body) if isinstance(body, bytes) else sum(len(chunk) for chunk in body)


def body_bytes(body: Body) -> bytes:
    return body if isinstance(body, bytes) else b"".join(body)


def pack_frame(header: dict[str, Any], payload: bytes = b"") -> list[bytes]:
    head = msgpack.packb(header, use_bin_type=True)
    return [FRAME.pack(len(head), len(payload)), head, payload]


def unpack_header(data: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("the header is not a map")
    return header
