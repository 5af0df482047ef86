"""Rank -> coordinator: a rank's state, answering ``Control("inspect", nonce)``.

What an operator needs to see of a rank without a debugger: the slots in use
(generation, next KV position, pages held, whether a token is pending, the
sampling step), the prepared programs with their capture status, how many
frames ran and the last fence, and memory (host RSS; device allocated and
reserved, and the KV cache, where there is a device).  Slot fields are int64
columns, one entry per slot in use, as in completions.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from runtime.transport.columns import as_column, column, column_from_wire, column_to_wire
from runtime.transport.fields import (
    INT32_MAX,
    MAX_WORLD_SIZE,
    ProtocolError,
    check_fields,
    check_int,
    check_seq,
    check_str,
    set_field,
)

SLOT_COLUMNS = ("slot", "generation", "next_position", "page_count", "pending", "step")
MAX_PROGRAMS = 1 << 12


def _empty() -> array:
    return column()


@dataclass(frozen=True)
class RankStatus:
    rank: int
    world_size: int
    nonce: int
    device: str
    frames: int
    last_fence: int  # -1: none yet
    rss_bytes: int
    device_allocated_bytes: int  # 0 without a device
    device_reserved_bytes: int
    kv_cache_bytes: int
    programs: tuple[str, ...] = ()  # each prepared program, described
    captured: array = field(default_factory=_empty)  # 1: a CUDA graph, 0: eager
    slot: array = field(default_factory=_empty)
    generation: array = field(default_factory=_empty)
    next_position: array = field(default_factory=_empty)
    page_count: array = field(default_factory=_empty)
    pending: array = field(default_factory=_empty)
    step: array = field(default_factory=_empty)

    def __post_init__(self) -> None:
        world = check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        check_int("rank", self.rank, 0, world - 1)
        check_int("nonce", self.nonce)
        check_str("device", self.device, 64)
        check_int("frames", self.frames)
        check_int("last_fence", self.last_fence, -1)
        for name in ("rss_bytes", "device_allocated_bytes", "device_reserved_bytes"):
            check_int(name, getattr(self, name))
        check_int("kv_cache_bytes", self.kv_cache_bytes)
        programs = tuple(
            check_str(f"programs[{i}]", p, 128)
            for i, p in enumerate(check_seq("programs", self.programs, MAX_PROGRAMS))
        )
        set_field(self, "programs", programs)
        captured = as_column("captured", self.captured, MAX_PROGRAMS)
        if len(captured) != len(programs) or any(c not in (0, 1) for c in captured):
            raise ProtocolError("captured", "one 0/1 entry per program")
        set_field(self, "captured", captured)
        lanes = None
        for name in SLOT_COLUMNS:
            values = as_column(name, getattr(self, name), 1 << 12)
            if lanes is None:
                lanes = len(values)
            elif len(values) != lanes:
                raise ProtocolError(name, f"has {len(values)} entries for {lanes} slots")
            if values and (min(values) < 0 or max(values) > (1 << 62)):
                raise ProtocolError(name, "out of range")
            set_field(self, name, values)
        if self.slot and max(self.slot) > INT32_MAX:
            raise ProtocolError("slot", "out of range")

    def slots(self) -> list[dict[str, int]]:
        """One dict per slot in use (tools)."""
        return [
            {name: getattr(self, name)[i] for name in SLOT_COLUMNS} for i in range(len(self.slot))
        ]

    def to_json(self) -> dict[str, Any]:
        """A JSON object (``GET /debug/ranks``, ``flare ranks status``)."""
        out: dict[str, Any] = {
            name: getattr(self, name)
            for name in (
                "rank", "world_size", "device", "frames", "last_fence", "rss_bytes",
                "device_allocated_bytes", "device_reserved_bytes", "kv_cache_bytes",
            )
        }  # fmt: skip
        out["programs"] = [
            {"program": name, "captured": bool(flag)}
            for name, flag in zip(self.programs, self.captured)
        ]
        out["slots"] = self.slots()
        return out

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: getattr(self, name)
            for name in (
                "rank", "world_size", "nonce", "device", "frames", "last_fence", "rss_bytes",
                "device_allocated_bytes", "device_reserved_bytes", "kv_cache_bytes",
            )
        }  # fmt: skip
        out["programs"] = list(self.programs)
        out["captured"] = column_to_wire(self.captured)
        for name in SLOT_COLUMNS:
            out[name] = column_to_wire(getattr(self, name))
        return out

    @classmethod
    def from_wire(cls, data: Any) -> RankStatus:
        fields = dict(check_fields(cls, data))
        for name in ("captured", *SLOT_COLUMNS):
            fields[name] = column_from_wire(name, fields[name])
        return cls(**fields)
