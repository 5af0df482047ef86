"""Sidecar tensors: :class:`Tensor`, a dense tensor as raw little-endian bytes.

A completion carries its sidecars (log probabilities, a speculative round's
confidence and survival, ...) as tensors of dtype and shape with their bytes.
This module imports no torch: the torch conversions at the bottom import it
only when called.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.transport.fields import (
    INT32_MAX,
    ProtocolError,
    check_choice,
    check_fields,
    check_ints,
    set_field,
)

if TYPE_CHECKING:
    import torch

MAX_TENSOR_NDIM = 8

# dtype -> (itemsize, struct code or None for bfloat16)
WIRE_DTYPES: dict[str, tuple[int, str | None]] = {
    "float32": (4, "f"),
    "int32": (4, "i"),
    "int64": (8, "q"),
    "float16": (2, "e"),
    "bfloat16": (2, None),
}


def _to_bfloat16_bits(value: float) -> int:
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    if math.isnan(value):
        return 0x7FC0
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even


@dataclass(frozen=True)
class Tensor:
    """A dense row-major tensor as raw little-endian bytes (a sidecar)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        dtype = check_choice("dtype", self.dtype, tuple(WIRE_DTYPES))
        shape = check_ints("shape", self.shape, 0, INT32_MAX, MAX_TENSOR_NDIM)
        data = self.data
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise ProtocolError("data", f"must be bytes, got {type(data).__name__}")
        expected = math.prod(shape) * WIRE_DTYPES[dtype][0]
        if len(data) != expected:
            raise ProtocolError(
                "data", f"{len(data)} bytes for {dtype} shape {list(shape)}, need {expected}"
            )
        set_field(self, "dtype", dtype)
        set_field(self, "shape", shape)
        set_field(self, "data", data)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_values(cls, dtype: str, shape: Sequence[int], values: Iterable[float]) -> Tensor:
        """Pack flat row-major ``values`` (Python numbers) little-endian."""
        dtype = check_choice("dtype", dtype, tuple(WIRE_DTYPES))
        items = list(values)
        shape = check_ints("shape", shape, 0, INT32_MAX, MAX_TENSOR_NDIM)
        if len(items) != math.prod(shape):
            raise ProtocolError("data", f"{len(items)} values for shape {list(shape)}")
        code = WIRE_DTYPES[dtype][1]
        try:
            if code is None:
                data = struct.pack(f"<{len(items)}H", *map(_to_bfloat16_bits, items))
            else:
                data = struct.pack(f"<{len(items)}{code}", *items)
        except (struct.error, OverflowError, TypeError) as exc:
            raise ProtocolError("data", f"cannot pack as {dtype}: {exc}") from None
        return cls(dtype, shape, data)

    def values(self) -> list[float] | list[int]:
        """The flat row-major values as Python numbers."""
        n = self.numel
        code = WIRE_DTYPES[self.dtype][1]
        if code is None:
            bits = struct.unpack(f"<{n}H", self.data)
            return [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]
        return list(struct.unpack(f"<{n}{code}", self.data))

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, data: Any) -> Tensor:
        return cls(**check_fields(cls, data))


# ------------------------------------------------------------------ optional torch helpers


def tensor_from_torch(value: torch.Tensor) -> Tensor:
    """Copy a torch tensor (any device) into a wire :class:`Tensor`."""
    import torch

    if sys.byteorder != "little":
        raise NotImplementedError("tensor_from_torch assumes a little-endian host")
    names = {getattr(torch, name): name for name in WIRE_DTYPES}
    if value.dtype not in names:
        raise ProtocolError("dtype", f"unsupported torch dtype {value.dtype}")
    flat = value.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    try:
        data = raw.numpy().tobytes()
    except (RuntimeError, ImportError):  # torch built without numpy
        data = bytes(raw.tolist())
    return Tensor(names[value.dtype], tuple(value.shape), data)


def tensor_to_torch(tensor: Tensor) -> torch.Tensor:
    """A new CPU torch tensor holding ``tensor``'s values."""
    import torch

    if sys.byteorder != "little":
        raise NotImplementedError("tensor_to_torch assumes a little-endian host")
    dtype = getattr(torch, tensor.dtype)
    if not tensor.data:
        return torch.empty(tensor.shape, dtype=dtype)
    return torch.frombuffer(bytearray(tensor.data), dtype=dtype).reshape(tensor.shape)
