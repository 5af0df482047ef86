"""Field checks shared by the message schema: each raises ProtocolError naming the field."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1  # token ids, positions, page ids: int32 on the device
MAX_SEQUENCE = 1 << 20  # entries in one token list or page table
MAX_NAME_CHARS = 256
MAX_WORLD_SIZE = 4096  # ranks in one deployment
MAX_ERROR_CHARS = 4096  # the reason an error completion or control carries


class ProtocolError(ValueError):
    """A message is malformed.  ``field`` names where (``lanes[2].sampling.top_p``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def within(self, prefix: str) -> ProtocolError:
        """The same error, its field qualified by the enclosing field ``prefix``."""
        return ProtocolError(f"{prefix}.{self.field}", self.reason)


def check_int(name: str, value: Any, lo: int = 0, hi: int = INT64_MAX) -> int:
    if type(value) is not int:  # rejects bool and int subclasses
        raise ProtocolError(name, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ProtocolError(name, f"must lie in [{lo}, {hi}], got {value}")
    return value


def check_float(name: str, value: Any) -> float:
    if type(value) not in (int, float):
        raise ProtocolError(name, f"must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ProtocolError(name, f"must be finite, got {value}")
    return value


def check_str(name: str, value: Any, max_chars: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str):
        raise ProtocolError(name, f"must be a string, got {type(value).__name__}")
    if not 0 < len(value) <= max_chars:
        raise ProtocolError(name, f"must have 1..{max_chars} characters, got {len(value)}")
    return str.__str__(value)  # a plain str, even from a str-valued Enum


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ProtocolError(name, f"must be one of {list(choices)}, got {value!r}")
    return value if type(value) is str else choices[choices.index(value)]


def check_seq(name: str, value: Any, max_len: int) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(name, f"must be a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise ProtocolError(name, f"must have at most {max_len} entries, got {len(value)}")
    return tuple(value)


def check_ints(
    name: str, value: Any, lo: int, hi: int, max_len: int = MAX_SEQUENCE
) -> tuple[int, ...]:
    items = check_seq(name, value, max_len)
    # The fast path checks types and range in C; the slow one finds the culprit.
    if items and not (set(map(type, items)) == {int} and lo <= min(items) and max(items) <= hi):
        for i, item in enumerate(items):
            check_int(f"{name}[{i}]", item, lo, hi)
    return items


def check_unique(name: str, items: Sequence[int]) -> None:
    if len(set(items)) != len(items):
        dup = next(x for i, x in enumerate(items) if x in items[:i])
        raise ProtocolError(name, f"repeats {dup}")


def check_instances(name: str, value: Any, cls: type, max_len: int) -> tuple:
    items = check_seq(name, value, max_len)
    for i, item in enumerate(items):
        if not isinstance(item, cls):
            raise ProtocolError(f"{name}[{i}]", f"must be a {cls.__name__}")
    return items


def check_fields(cls: type, data: Any) -> Mapping[str, Any]:
    """Check that ``data`` is a map with exactly ``cls``'s fields."""
    if not isinstance(data, dict):
        raise ProtocolError(cls.__name__, f"must be a map, got {type(data).__name__}")
    names = cls.__dataclass_fields__  # type: ignore[attr-defined]
    if data.keys() == names.keys():
        return data
    for key in data:
        if key not in names:
            raise ProtocolError(str(key), f"unknown field of {cls.__name__}")
    for key in names:
        if key not in data:
            raise ProtocolError(key, f"missing field of {cls.__name__}")
    return data


def parse_nested(prefix: str, parse: Any, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ProtocolError(prefix, f"must be a map, got {type(data).__name__}")
    try:
        return parse(data)
    except ProtocolError as exc:
        raise exc.within(prefix) from None


def set_field(obj: object, name: str, value: Any) -> None:
    """Store a normalized value on a frozen dataclass (a no-op when unchanged)."""
    if getattr(obj, name) is not value:
        object.__setattr__(obj, name, value)
