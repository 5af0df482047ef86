"""Checks of single JSON fields, each naming its field in the RequestError it raises:
integers (never booleans), finite numbers, booleans, valid Unicode text, token ids
in the vocabulary."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import ServingLimits


def json_object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(400, "body must be a JSON object", None)
    return body


def utf8(value: str, param: str) -> str:
    """``value`` if it is valid Unicode text (JSON can carry lone surrogates, which no
    tokenizer or client can take)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, f"{param} is not valid Unicode text", param) from None
    return value


def in_vocabulary(ids: list[int], limits: ServingLimits, param: str, label: str) -> tuple[int, ...]:
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError(
            400, f"{label} {bad} is outside the vocabulary [0, {limits.vocab_size})", param
        )
    return tuple(ids)


def is_int(value: Any) -> bool:
    return type(value) is int  # not bool, which JSON true would otherwise pass for


def int_field(obj: Mapping[str, Any], name: str, *, lo: int, hi: int | None = None) -> int | None:
    """An optional integer field in ``[lo, hi]``; None when absent or null."""
    value = obj.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise RequestError(400, f"{name} must be an integer, got {json_type(value)}", name)
    if value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise RequestError(400, f"{name} must be {bounds}, got {value}", name)
    return value


def float_field(obj: Mapping[str, Any], name: str, default: float) -> float:
    """An optional finite, non-negative number (int or float, not bool)."""
    value = obj.get(name)
    if value is None:
        return default
    if type(value) not in (int, float):
        raise RequestError(400, f"{name} must be a number, got {json_type(value)}", name)
    try:
        value = float(value)
    except OverflowError:  # a JSON integer beyond float range
        raise RequestError(400, f"{name} must be a finite number >= 0", name) from None
    if not math.isfinite(value) or value < 0:
        raise RequestError(400, f"{name} must be a finite number >= 0, got {value}", name)
    return value


def bool_field(obj: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    """An optional boolean field (false when absent or null)."""
    value = obj.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(
            400, f"{param or name} must be true or false, got {json_type(value)}", param or name
        )
    return value


def flag_field(obj: Mapping[str, Any], name: str, default: bool) -> bool:
    """An optional boolean field (``default`` when absent or null)."""
    return default if obj.get(name) is None else bool_field(obj, name)


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return names.get(type(value), "object" if isinstance(value, dict) else type(value).__name__)
