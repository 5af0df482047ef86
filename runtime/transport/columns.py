"""Integer columns: one ``array('q')`` per field, little-endian int64 ``bin`` on the wire.

A columnar message (``Frame``, ``Completion``) stores each per-lane field as
one :class:`array.array` of typecode ``'q'`` (int64) instead of one object per
lane, so that decoding is one ``frombytes`` per column and validation is a few
whole-column operations (``min``, ``max``, ``sum``, ``len(set())``, ``count``)
done in C.  On the wire each column is a msgpack ``bin`` holding the values as
little-endian int64; a big-endian host byteswaps on the way in and out.

For the device side, a column is a writable buffer: ``memoryview(col)`` or
:func:`column_to_torch` (``torch.frombuffer``, no copy) read it in place.

This module imports no torch: :func:`column_to_torch` imports it when called.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from runtime.transport.fields import INT64_MAX, MAX_SEQUENCE, ProtocolError, check_ints

if TYPE_CHECKING:
    import torch

TYPECODE = "q"  # int64
ITEM_BYTES = 8
INT64_MIN = -INT64_MAX - 1
NATIVE_LITTLE = sys.byteorder == "little"

Column = array  # array('q'); kept as an alias so signatures say what they mean

# Constant columns and range masks by length, for the whole-column checks.
_MAX_CACHED_LENGTH = 256
_MAX_CACHED = 1024
_CONSTANTS: dict[tuple[int, int], bytes] = {}
_RANGE_MASKS: dict[tuple[int, int, int], tuple[int, int, int]] = {}


def column(values: Iterable[int] = ()) -> array:
    """A new int64 column of ``values``."""
    return array(TYPECODE, values)


def as_column(name: str, value: Any, max_len: int = MAX_SEQUENCE) -> array:
    """``value`` as an int64 column: an ``array('q')`` as is, a list or tuple of ints copied.

    Raises :class:`ProtocolError` naming ``name`` for anything else (bools and
    floats included) and for more than ``max_len`` entries.
    """
    if type(value) is array:
        if value.typecode != TYPECODE:
            raise ProtocolError(name, f"must be an int64 column ('q'), got {value.typecode!r}")
        if len(value) > max_len:
            raise ProtocolError(name, f"must have at most {max_len} entries, got {len(value)}")
        return value
    if isinstance(value, (list, tuple, range)):
        return array(TYPECODE, check_ints(name, tuple(value), INT64_MIN, INT64_MAX, max_len))
    raise ProtocolError(name, f"must be an int64 column, got {type(value).__name__}")


def column_to_wire(col: array, native_little: bool = NATIVE_LITTLE) -> bytes:
    """The column as little-endian int64 bytes (msgpack packs them as ``bin``).

    ``native_little``: the host's byte order; False byteswaps a copy (tests pass
    it to exercise the big-endian path on a little-endian machine).
    """
    if native_little:
        return col.tobytes()
    swapped = array(TYPECODE, col)
    swapped.byteswap()
    return swapped.tobytes()


def column_from_wire(
    name: str, data: Any, max_len: int = MAX_SEQUENCE, native_little: bool = NATIVE_LITTLE
) -> array:
    """The column in ``data`` (little-endian int64 bytes); ProtocolError naming ``name``."""
    if type(data) is not bytes:
        if not isinstance(data, (bytearray, memoryview)):
            raise ProtocolError(name, f"must be int64 bytes, got {type(data).__name__}")
        data = bytes(data)
    size = len(data)
    if size % ITEM_BYTES:
        raise ProtocolError(name, f"{size} bytes is not a whole number of int64 values")
    if size > max_len * ITEM_BYTES:
        raise ProtocolError(name, f"must have at most {max_len} entries, got {size // ITEM_BYTES}")
    col = array(TYPECODE, data)
    if not native_little:
        col.byteswap()
    return col


def constant(value: int, length: int) -> bytes:
    """The native bytes of a column of ``length`` entries all equal to ``value``."""
    key = (value, length)
    data = _CONSTANTS.get(key)
    if data is None:
        data = array(TYPECODE, (value,)).tobytes() * length
        if length <= _MAX_CACHED_LENGTH and len(_CONSTANTS) < _MAX_CACHED:
            _CONSTANTS[key] = data
    return data


def all_equal(col: array, value: int) -> bool:
    """Whether every entry of ``col`` is ``value`` (one bytes comparison)."""
    return col.tobytes() == constant(value, len(col))


def first_not(col: array, value: int) -> int:
    """Index of the first entry that is not ``value``; -1 when every entry is."""
    if all_equal(col, value):
        return -1
    return next(i for i, v in enumerate(col) if v != value)


def _lanes_constant(value: int, length: int) -> int:
    """``value`` (< 2**64) in each of ``length`` 64-bit lanes of one integer."""
    return int.from_bytes(value.to_bytes(ITEM_BYTES, "little") * length, "little")


def _in_range(col: array, lo: int, hi: int) -> bool:
    """Whether every value lies in [lo, hi], for 0 <= lo <= hi <= INT64_MAX.

    The column as one integer of 64-bit lanes: a lane is negative iff its top
    bit is set; ``lane + (INT64_MAX - hi)`` sets it iff ``lane > hi``; with the
    top bit forced on, ``lane - lo`` clears it iff ``lane < lo``.  No carry or
    borrow crosses lanes once the lanes are known non-negative.
    """
    n = len(col)
    key = (lo, hi, n)
    masks = _RANGE_MASKS.get(key)
    if masks is None:
        top = _lanes_constant(1 << 63, n)
        masks = (
            top,
            _lanes_constant(INT64_MAX - hi, n) if hi < INT64_MAX else 0,
            _lanes_constant(lo, n) if lo else 0,
        )
        if n <= _MAX_CACHED_LENGTH and len(_RANGE_MASKS) < _MAX_CACHED:
            _RANGE_MASKS[key] = masks
    top, over, under = masks
    value = int.from_bytes(col if NATIVE_LITTLE else column_to_wire(col), "little")
    if value & top:
        return False
    if over and (value + over) & top:
        return False
    return not under or ((value | top) - under) & top == top


def check_range(name: str, col: array, lo: int, hi: int) -> None:
    """Every value in [lo, hi]; else ProtocolError naming the first culprit, ``name[i]``."""
    if not col:
        return
    if not (
        _in_range(col, lo, hi) if 0 <= lo <= hi <= INT64_MAX else lo <= min(col) <= max(col) <= hi
    ):
        for i, value in enumerate(col):
            if not lo <= value <= hi:
                raise ProtocolError(f"{name}[{i}]", f"must lie in [{lo}, {hi}], got {value}")


def check_distinct(name: str, col: array | list[int]) -> None:
    """No value twice; else ProtocolError naming ``name`` and the first repeat."""
    if len(set(col)) != len(col):
        seen: set[int] = set()
        for value in col:
            if value in seen:
                raise ProtocolError(name, f"repeats {value}")
            seen.add(value)


def offsets(counts: array | list[int]) -> array:
    """Exclusive prefix sums with the total last: lane i's run is ``[out[i], out[i + 1])``."""
    return array(TYPECODE, accumulate(counts, initial=0))


def column_to_torch(col: array) -> torch.Tensor:
    """A CPU int64 tensor over ``col``'s memory (no copy; an empty column gives a new one).

    Keep ``col`` alive and unchanged while the tensor is in use.
    """
    import torch

    if not col:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(col, dtype=torch.int64)
