"""Integer columns: one ``array('q')`` per field, little-endian int64 ``bin`` on the wire.

A columnar message (``Frame``, ``Completion``) stores each per-lane field as
one :class:`array.array` of typecode ``'q'`` (int64) instead of one object per
lane, so that decoding is one copy of the bytes per column and validation is a
few whole-column operations done in C: range checks of every lane column at
once as one big integer of 64-bit lanes (:class:`LaneRanges`,
:func:`check_range`), constant columns as one bytes comparison
(:func:`all_equal`), ``len(set())``, ``sum``, slicing.  On the wire each column
is a msgpack ``bin`` holding the values as little-endian int64; a big-endian
host byteswaps on the way in and out.

For the device side, a column is a writable buffer: ``memoryview(col)``,
``numpy.frombuffer(col, dtype=numpy.int64)`` or :func:`column_to_torch`
(``torch.frombuffer``) read it in place, without a copy.

This module imports no torch: :func:`column_to_torch` imports it when called.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
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
_RANGE_MASKS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}


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
    size = len(data) if type(data) is bytes else -1
    if native_little and size >= 0 and not size % ITEM_BYTES and size <= max_len * ITEM_BYTES:
        return array(TYPECODE, data)  # the common case, checked in one line
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


def _lanes(value: int, length: int) -> bytes:
    """``length`` 64-bit little-endian lanes holding ``value`` (< 2**64)."""
    return value.to_bytes(ITEM_BYTES, "little") * length


def _masks(bounds: Sequence[tuple[int, int]], lengths: Sequence[int]) -> tuple[int, int, int, int]:
    """The lane masks of :func:`_outside` for columns of ``lengths`` bounded by ``bounds``.

    A lane lies in [lo, hi] (0 <= lo <= hi <= INT64_MAX) iff, as a 64-bit lane
    of one big integer: it has no bit in ``outside`` (every bit above ``hi``
    when ``hi + 1`` is a power of two, else the sign bit); ``lane + over``
    (``INT64_MAX - hi``, or 0) leaves the top bit clear; and with the top bit
    forced on, ``lane - under`` (``lo``) leaves it set.  No carry or borrow
    crosses lanes once every lane is known non-negative.
    """
    parts: tuple[list[bytes], list[bytes], list[bytes]] = ([], [], [])
    for (lo, hi), n in zip(bounds, lengths, strict=True):
        power = hi & (hi + 1) == 0  # hi = 2**k - 1
        parts[0].append(_lanes(~hi & (2**64 - 1) if power else 1 << 63, n))
        parts[1].append(_lanes(0 if power else INT64_MAX - hi, n))
        parts[2].append(_lanes(lo, n))
    outside, over, under = (int.from_bytes(b"".join(p), "little") for p in parts)
    top = int.from_bytes(_lanes(1 << 63, sum(lengths)), "little")
    return outside, over, top, under


def _outside(value: int, masks: tuple[int, int, int, int]) -> bool:
    """Whether some lane of ``value`` lies outside its bounds (see :func:`_masks`)."""
    outside, over, top, under = masks
    if value & outside:
        return True
    if over and (value + over) & top:
        return True
    return bool(under) and ((value | top) - under) & top != top


def _as_int(cols: Sequence[array]) -> int:
    """The columns back to back as one integer of little-endian 64-bit lanes."""
    if NATIVE_LITTLE:
        return int.from_bytes(b"".join(cols), "little")
    return int.from_bytes(b"".join(map(column_to_wire, cols)), "little")


def check_range(name: str, col: array, lo: int, hi: int) -> None:
    """Every value in [lo, hi]; else ProtocolError naming the first culprit, ``name[i]``."""
    if not col:
        return
    if 0 <= lo <= hi <= INT64_MAX:
        key = (lo, hi, len(col))
        masks = _RANGE_MASKS.get(key)
        if masks is None:
            masks = _masks(((lo, hi),), (len(col),))
            if len(col) <= _MAX_CACHED_LENGTH and len(_RANGE_MASKS) < _MAX_CACHED:
                _RANGE_MASKS[key] = masks
        ok = not _outside(_as_int((col,)), masks)
    else:
        ok = lo <= min(col) <= max(col) <= hi
    if not ok:
        for i, value in enumerate(col):
            if not lo <= value <= hi:
                raise ProtocolError(f"{name}[{i}]", f"must lie in [{lo}, {hi}], got {value}")


class LaneRanges:
    """Range checks of several columns of one length (a message's lanes) in one pass.

    ``bounds``: (name, lo, hi) per column, 0 <= lo <= hi <= INT64_MAX.  The
    columns are joined into one big integer and checked with three lane-wise
    operations; only when that fails is each column scanned, to name the
    culprit as ``name[i]``.
    """

    def __init__(self, *bounds: tuple[str, int, int]) -> None:
        for _, lo, hi in bounds:
            if not 0 <= lo <= hi <= INT64_MAX:
                raise ValueError(f"bounds [{lo}, {hi}] outside [0, INT64_MAX]")
        self.bounds = bounds
        self._masks: dict[int, tuple[int, int, int, int]] = {}

    def check(self, cols: Sequence[array]) -> None:
        """Check ``cols`` (one per bound, in order, all of the same length)."""
        n = len(cols[0])
        masks = self._masks.get(n)
        if masks is None:
            masks = _masks([(lo, hi) for _, lo, hi in self.bounds], [n] * len(self.bounds))
            if n <= _MAX_CACHED_LENGTH:
                self._masks[n] = masks
        if _outside(_as_int(cols), masks):
            for (name, lo, hi), col in zip(self.bounds, cols, strict=True):
                check_range(name, col, lo, hi)


def check_distinct(name: str, col: Sequence[int]) -> None:
    """No value twice; else ProtocolError naming ``name`` and the first repeat."""
    if len(set(col)) != len(col):
        seen: set[int] = set()
        for value in col:
            if value in seen:
                raise ProtocolError(name, f"repeats {value}")
            seen.add(value)


def offsets(counts: Iterable[int]) -> array:
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
