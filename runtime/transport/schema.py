"""Every message between the coordinator and the ranks, as frozen dataclasses.

One dataclass per message.  Construction validates every field (type, range and
the consistency of lengths) and raises :class:`ProtocolError` naming the field,
so an invalid message can neither be built by a sender nor accepted by a
receiver.  ``to_wire()`` gives plain msgpack-able maps; ``from_wire()`` checks
the map's keys exactly (every field is required, no unknown field is allowed),
converts nested messages and constructs, which validates.

Protocol version 2: the per-lane data of :class:`Frame` (``frame.py``) and of
:class:`Completion` travel as int64 columns (``columns.py``: ``array('q')``
here, little-endian msgpack ``bin`` on the wire).  :class:`FrameLane` and
:class:`LaneResult` are per-lane views of them for tests and consumers; they
are not messages.  Protocol version 6 adds the frame's ``copies`` and
``restores`` (``restore.py``: page copies and restored rows for prefix reuse
and preemption).  Protocol version 7 adds the state lanes (phase 2,
``PHASE_STATE``) of RESTORE and SNAPSHOT programs: restore rows and terminal
rows that feed and commit nothing (``frame.py``).  Protocol version 8 adds
the start-up identity to :class:`CatalogReport` (``runtime/identity.py``:
model digests, dtype, device type, code version, KV bytes per page).
Sequences are stored as
tuples; sidecar tensors travel as raw little-endian bytes with dtype and shape.
Integers on the wire are bounded so that a rank can copy them into int32/int64
device buffers without overflow.

This module imports no torch: the torch conversions at the bottom import it
only when called.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.catalog import MAX_BATCH_CAPACITY, CatalogError, GraphDescriptor, validate_catalog
from runtime.identity import DEVICE_TYPES, DTYPE_NAMES, is_digest
from runtime.transport.columns import (
    LaneRanges,
    all_equal,
    as_column,
    check_distinct,
    check_range,
    column,
    column_from_wire,
    column_to_wire,
    offsets,
)
from runtime.transport.fields import (
    INT32_MAX,
    INT64_MAX,
    ProtocolError,
    check_choice,
    check_fields,
    check_instances,
    check_int,
    check_ints,
    check_seq,
    check_str,
    parse_nested,
    set_field,
)
from runtime.transport.frame import (
    FRAME_COLUMNS,
    LANE_COLUMNS,
    MAX_SLOTS,
    PHASE_DECODE,
    PHASE_NAMES,
    PHASE_PREFILL,
    PHASE_STATE,
    STATE_KINDS,
    Frame,
    FrameLane,
)
from runtime.transport.inspection import RankStatus
from runtime.transport.restore import Restore
from runtime.transport.sampling import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    PENALTY_LIMIT,
    SamplingParams,
)

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 8

MAX_WORLD_SIZE = 4096
MAX_LANE_TOKENS = 1 << 16  # tokens one lane result may carry
MAX_DESCRIPTORS = 1 << 12
MAX_SIDECARS = 16
MAX_TENSOR_NDIM = 8

FINISH_REASONS = ("stop",)
CONTROL_COMMANDS = (
    "shutdown", "ping", "ready", "inspect", "profile", "profiled", "heartbeat", "error",
)  # fmt: skip
RANK_COMMANDS = ("ready", "profiled", "error")  # sent by a rank
MAX_PROFILE_FRAMES = 1 << 16
COORDINATOR_RANK = -1
# Sidecars every rank of a speculative round publishes (valid probabilities;
# rank 0's drive the coordinator): the rest are rank 0's alone.
PEER_SIDECARS = frozenset({"confidence", "survival"})

# Re-exported: the frame and sampling modules were split out of this one.
__all__ = [
    "COORDINATOR_RANK",
    "FRAME_COLUMNS",
    "LANE_COLUMNS",
    "LOGIT_BIAS_LIMIT",
    "MAX_LANE_TOKENS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_SLOTS",
    "MAX_WORLD_SIZE",
    "MESSAGE_TYPES",
    "PENALTY_LIMIT",
    "PHASE_DECODE",
    "PHASE_NAMES",
    "PHASE_PREFILL",
    "PHASE_STATE",
    "PROTOCOL_VERSION",
    "RESULT_COLUMNS",
    "STATE_KINDS",
    "CatalogReport",
    "Completion",
    "Control",
    "Frame",
    "FrameLane",
    "LaneResult",
    "Message",
    "ProtocolError",
    "RankStatus",
    "Restore",
    "SamplingParams",
    "Tensor",
    "tensor_from_torch",
    "tensor_to_torch",
]


# ------------------------------------------------------------------ tensors

# dtype -> (itemsize, struct code or None for bfloat16)
DTYPES: dict[str, tuple[int, str | None]] = {
    "float32": (4, "f"),
    "int32": (4, "i"),
    "int64": (8, "q"),
    "float16": (2, "e"),
    "bfloat16": (2, None),
}
_FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})


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
        dtype = check_choice("dtype", self.dtype, tuple(DTYPES))
        shape = check_ints("shape", self.shape, 0, INT32_MAX, MAX_TENSOR_NDIM)
        data = self.data
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise ProtocolError("data", f"must be bytes, got {type(data).__name__}")
        expected = math.prod(shape) * DTYPES[dtype][0]
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
        dtype = check_choice("dtype", dtype, tuple(DTYPES))
        items = list(values)
        shape = check_ints("shape", shape, 0, INT32_MAX, MAX_TENSOR_NDIM)
        if len(items) != math.prod(shape):
            raise ProtocolError("data", f"{len(items)} values for shape {list(shape)}")
        code = DTYPES[dtype][1]
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
        code = DTYPES[self.dtype][1]
        if code is None:
            bits = struct.unpack(f"<{n}H", self.data)
            return [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]
        return list(struct.unpack(f"<{n}{code}", self.data))

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, data: Any) -> Tensor:
        return cls(**check_fields(cls, data))


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class LaneResult:
    """One lane's committed tokens (a view of a :class:`Completion`), as ``CompletionRecord``."""

    slot: int
    generation: int
    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        check_int("slot", self.slot, 0, MAX_SLOTS - 1)
        check_int("generation", self.generation, 1)
        tokens = check_ints("tokens", self.tokens, 0, INT32_MAX, MAX_LANE_TOKENS)
        if self.finish_reason is not None:
            reason = check_choice("finish_reason", self.finish_reason, FINISH_REASONS)
            if not tokens:
                raise ProtocolError("finish_reason", f"{reason!r} needs at least one token")
            set_field(self, "finish_reason", reason)
        set_field(self, "tokens", tokens)


MAX_ERROR_CHARS = 4096  # an error completion's reason
MAX_TIMESTAMP = (1 << 63) - 1
# The rank's host stages, in order (Completion.stage_ns; the debugging tools' names).
STAGE_NAMES = ("receive", "validate", "pack", "launch", "wait", "publish")

RESULT_COLUMNS = ("slot", "generation", "token_count", "tokens", "finished")
_RESULT_RANGES = LaneRanges(
    ("slot", 0, MAX_SLOTS - 1),
    ("generation", 1, INT64_MAX),
    ("token_count", 0, MAX_LANE_TOKENS),
    ("finished", 0, 1),
)


def _empty() -> array:
    return column()


@dataclass(frozen=True)
class Completion:
    """Rank -> coordinator: one rank finished frame ``fence``.

    ``device_ns``: the rank's replay interval; ``readiness_delay_ns``: exposed
    input-readiness stall within it.  Only rank 0 sends lane results and
    sidecars, except a speculative round's ``confidence`` and ``survival``
    (:data:`PEER_SIDECARS`), which every rank sends (protocol version 5).

    Lane results are int64 columns (``array('q')``; lists of ints are
    converted), one entry per lane of the frame in its lane order: ``slot``
    (distinct), ``generation``, ``token_count`` (tokens the lane committed, 0
    or more), ``finished`` (1: "stop", the lane sampled an EOS, which needs a
    token; else 0), and the flat ``tokens`` (every lane's committed tokens in
    lane order, ``sum(token_count)`` of them).  :meth:`lane_results` gives
    per-lane views, :meth:`from_results` builds from them.

    Log probabilities: when at least one lane of the frame has
    ``sampling.logprobs >= 0``, rank 0 adds, with ``R`` = the frame's lane count
    and ``K`` = the largest ``logprobs`` a lane asked for, ``sidecars["logprobs"]``
    (float32, shape ``(R, 1 + K)``: per lane the sampled token's log probability,
    then the top-K log probabilities, descending) and
    ``sidecars["logprob_token_ids"]`` (int32, shape ``(R, K)``: the top-K token
    ids, in the same order).  Row ``i`` is lane ``i``; rows of lanes that asked
    for fewer (or none), and of prefill chunks that commit no token, hold
    whatever was computed and are to be ignored.  Frames where no lane asks
    carry neither.  A speculative round's log probabilities have one row per
    emitted token instead (``T`` = ``sum(token_count)`` rows, in lane order):
    ``(T, 1 + K)`` and ``(T, K)``.

    ``error``: the rank could not run the frame (it names why); such a
    completion carries no lanes, and the coordinator must not assume the ranks'
    state advanced.

    Diagnostics, from every rank (issue 11): ``launch_wait_ns``, the part of
    ``device_ns`` this rank spent waiting for the others at the frame's first
    collective (its own launch to the moment that collective released it; 0
    at TP=1 or when not measured), which the cost sample leaves out;
    ``host_times``: (received, launched, ended, published) on the rank's
    ``time.monotonic_ns`` clock, or empty; ``stage_ns``: the host time of the
    stages receive, validate, pack, launch, wait and publish, or empty (the
    previous frame's publish is reported, this one's is not over yet);
    ``token_crc``: CRC-32 of the rank's sampled tokens (little-endian int64)
    when the ranks check each other (``--check-ranks``), else -1.
    """

    fence: int
    rank: int
    world_size: int
    device_ns: int
    readiness_delay_ns: int = 0
    slot: array = field(default_factory=_empty)
    generation: array = field(default_factory=_empty)
    token_count: array = field(default_factory=_empty)
    tokens: array = field(default_factory=_empty)
    finished: array = field(default_factory=_empty)
    sidecars: Mapping[str, Tensor] = field(default_factory=dict)
    error: str | None = None
    launch_wait_ns: int = 0
    host_times: tuple[int, ...] = ()
    stage_ns: tuple[int, ...] = ()
    token_crc: int = -1

    def __post_init__(self) -> None:
        check_int("fence", self.fence)
        world_size = check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        rank = check_int("rank", self.rank, 0, world_size - 1)
        check_int("device_ns", self.device_ns)
        check_int("readiness_delay_ns", self.readiness_delay_ns)
        wait = check_int("launch_wait_ns", self.launch_wait_ns)
        if wait > self.device_ns:
            raise ProtocolError("launch_wait_ns", f"{wait} exceeds device_ns {self.device_ns}")
        times = check_ints("host_times", self.host_times, 0, MAX_TIMESTAMP, 4)
        if len(times) not in (0, 4) or list(times) != sorted(times):
            raise ProtocolError("host_times", "must be empty or 4 non-decreasing timestamps")
        stages = check_ints("stage_ns", self.stage_ns, 0, MAX_TIMESTAMP, len(STAGE_NAMES))
        if len(stages) not in (0, len(STAGE_NAMES)):
            raise ProtocolError("stage_ns", f"must be empty or {len(STAGE_NAMES)} durations")
        check_int("token_crc", self.token_crc, -1, 0xFFFFFFFF)
        set_field(self, "host_times", times)
        set_field(self, "stage_ns", stages)
        for name in RESULT_COLUMNS:
            value = getattr(self, name)
            if type(value) is not array or value.typecode != "q":
                set_field(self, name, as_column(name, value))
        lanes = self._check_lanes()
        if not isinstance(self.sidecars, Mapping):
            raise ProtocolError("sidecars", "must be a map of name to Tensor")
        if len(self.sidecars) > MAX_SIDECARS:
            raise ProtocolError("sidecars", f"at most {MAX_SIDECARS}, got {len(self.sidecars)}")
        for name, tensor in self.sidecars.items():
            check_str("sidecars", name, 64)
            if not isinstance(tensor, Tensor):
                raise ProtocolError(f"sidecars[{name}]", "must be a Tensor")
        if rank != 0 and lanes:
            raise ProtocolError("slot", f"only rank 0 reports lanes, rank {rank} sent {lanes}")
        if rank != 0 and set(self.sidecars) - PEER_SIDECARS:
            other = sorted(set(self.sidecars) - PEER_SIDECARS)
            raise ProtocolError("sidecars", f"only rank 0 reports {other}, rank {rank} sent them")
        if self.error is not None:
            check_str("error", self.error, MAX_ERROR_CHARS)
            if lanes or self.sidecars:
                raise ProtocolError("error", "an error completion carries no lanes or sidecars")
        set_field(self, "sidecars", dict(self.sidecars))

    def _check_lanes(self) -> int:
        """The result columns' lengths and ranges; the number of lanes."""
        lanes = len(self.slot)
        if lanes > MAX_BATCH_CAPACITY:
            raise ProtocolError("slot", f"at most {MAX_BATCH_CAPACITY} lanes, got {lanes}")
        for name in ("generation", "token_count", "finished"):
            if len(getattr(self, name)) != lanes:
                raise ProtocolError(
                    name, f"has {len(getattr(self, name))} entries for {lanes} lanes"
                )
        if lanes:
            _RESULT_RANGES.check((self.slot, self.generation, self.token_count, self.finished))
            check_distinct("slot", self.slot)
            if not all_equal(self.finished, 0):
                for i, (done, count) in enumerate(zip(self.finished, self.token_count)):
                    if done and not count:
                        raise ProtocolError(f"finished[{i}]", "'stop' needs at least one token")
        total = sum(self.token_count)
        if len(self.tokens) != total:
            raise ProtocolError(
                "tokens", f"has {len(self.tokens)} tokens, token_count sums to {total}"
            )
        check_range("tokens", self.tokens, 0, INT32_MAX)
        return lanes

    @property
    def num_lanes(self) -> int:
        return len(self.slot)

    def lane_results(self) -> tuple[LaneResult, ...]:
        """Every lane as a :class:`LaneResult`, in lane order."""
        bounds = offsets(self.token_count)
        return tuple(
            LaneResult(
                self.slot[i],
                self.generation[i],
                tuple(self.tokens[bounds[i] : bounds[i + 1]]),
                "stop" if self.finished[i] else None,
            )
            for i in range(len(self.slot))
        )

    @classmethod
    def from_results(
        cls,
        fence: int,
        rank: int,
        world_size: int,
        device_ns: int,
        readiness_delay_ns: int = 0,
        lanes: Sequence[LaneResult] = (),
        sidecars: Mapping[str, Tensor] | None = None,
        error: str | None = None,
    ) -> Completion:
        """The completion of per-lane views (tests and simple ranks)."""
        lanes = check_instances("lanes", lanes, LaneResult, MAX_BATCH_CAPACITY)
        return cls(
            fence,
            rank,
            world_size,
            device_ns,
            readiness_delay_ns,
            slot=column(lane.slot for lane in lanes),
            generation=column(lane.generation for lane in lanes),
            token_count=column(len(lane.tokens) for lane in lanes),
            tokens=column(t for lane in lanes for t in lane.tokens),
            finished=column(lane.finish_reason is not None for lane in lanes),
            sidecars={} if sidecars is None else sidecars,
            error=error,
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "fence": self.fence,
            "rank": self.rank,
            "world_size": self.world_size,
            "device_ns": self.device_ns,
            "readiness_delay_ns": self.readiness_delay_ns,
            "slot": column_to_wire(self.slot),
            "generation": column_to_wire(self.generation),
            "token_count": column_to_wire(self.token_count),
            "tokens": column_to_wire(self.tokens),
            "finished": column_to_wire(self.finished),
            "sidecars": {name: t.to_wire() for name, t in self.sidecars.items()},
            "error": self.error,
            "launch_wait_ns": self.launch_wait_ns,
            "host_times": list(self.host_times),
            "stage_ns": list(self.stage_ns),
            "token_crc": self.token_crc,
        }

    @classmethod
    def from_wire(cls, data: Any) -> Completion:
        fields = dict(check_fields(cls, data))
        for name in RESULT_COLUMNS:
            fields[name] = column_from_wire(name, fields[name])
        sidecars = fields["sidecars"]
        if not isinstance(sidecars, dict):
            raise ProtocolError("sidecars", "must be a map of name to Tensor")
        if len(sidecars) > MAX_SIDECARS:
            raise ProtocolError("sidecars", f"at most {MAX_SIDECARS}, got {len(sidecars)}")
        fields["sidecars"] = {
            check_str("sidecars", name, 64): parse_nested(
                f"sidecars[{name}]", Tensor.from_wire, tensor
            )
            for name, tensor in sidecars.items()
        }
        return cls(**fields)


# ------------------------------------------------------------------ start-up and control


_DIGEST_FIELDS = (
    "config_digest",
    "tokenizer_digest",
    "weights_digest",
    "weights_full_digest",
    "draft_digest",
)
_REQUIRED_DIGESTS = ("config_digest", "weights_digest")


@dataclass(frozen=True)
class CatalogReport:
    """Rank -> coordinator after capture: the prepared programs and model facts.

    ``model_name`` is for display; the ranks must agree on the rest
    (``runtime/coordinator/engine/startup.py``): the identity fields are those
    of :mod:`runtime.identity` (digests are SHA-256 hex; "" = not computed),
    ``kv_page_bytes`` the KV cache bytes of one page on this rank (target and
    draft), ``draft_digest`` one digest of the draft model's identity ("" = no
    draft).
    """

    rank: int
    world_size: int
    descriptors: tuple[GraphDescriptor, ...]
    vocab_size: int
    max_context: int
    page_size: int
    num_pages: int
    model_name: str
    kv_page_bytes: int
    dtype: str
    device_type: str
    protocol_version: int
    code_version: str
    config_digest: str
    tokenizer_digest: str
    weights_digest: str
    weights_full_digest: str
    draft_digest: str

    def __post_init__(self) -> None:
        world_size = check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        check_int("rank", self.rank, 0, world_size - 1)
        descriptors = check_instances(
            "descriptors", self.descriptors, GraphDescriptor, MAX_DESCRIPTORS
        )
        if not descriptors:
            raise ProtocolError("descriptors", "a catalog needs at least one program")
        try:
            validate_catalog(list(descriptors))
        except CatalogError as exc:
            raise ProtocolError("descriptors", str(exc)) from None
        check_int("vocab_size", self.vocab_size, 1, INT32_MAX)
        check_int("max_context", self.max_context, 1, INT32_MAX)
        check_int("page_size", self.page_size, 1, INT32_MAX)
        check_int("num_pages", self.num_pages, 1, INT32_MAX)
        set_field(self, "model_name", check_str("model_name", self.model_name))
        set_field(self, "descriptors", descriptors)
        check_int("kv_page_bytes", self.kv_page_bytes, 0, INT64_MAX)
        set_field(self, "dtype", check_choice("dtype", self.dtype, DTYPE_NAMES))
        set_field(self, "device_type", check_choice("device_type", self.device_type, DEVICE_TYPES))
        check_int("protocol_version", self.protocol_version, 1, INT32_MAX)
        set_field(self, "code_version", check_str("code_version", self.code_version, 128))
        for name in _DIGEST_FIELDS:
            value = getattr(self, name)
            if not (is_digest(value) or (value == "" and name not in _REQUIRED_DIGESTS)):
                wanted = "a SHA-256 hex digest"
                if name not in _REQUIRED_DIGESTS:
                    wanted += " or ''"
                raise ProtocolError(name, f"must be {wanted}, got {value!r:.80}")
            set_field(self, name, str.__str__(value))

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "descriptors": [d.to_wire() for d in self.descriptors],
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "model_name": self.model_name,
            "kv_page_bytes": self.kv_page_bytes,
            "dtype": self.dtype,
            "device_type": self.device_type,
            "protocol_version": self.protocol_version,
            "code_version": self.code_version,
            **{name: getattr(self, name) for name in _DIGEST_FIELDS},
        }

    @classmethod
    def from_wire(cls, data: Any) -> CatalogReport:
        fields = dict(check_fields(cls, data))
        descriptors = check_seq("descriptors", fields["descriptors"], MAX_DESCRIPTORS)
        parsed = []
        for i, item in enumerate(descriptors):
            try:
                parsed.append(GraphDescriptor.from_wire(item))
            except (CatalogError, TypeError, ValueError) as exc:
                raise ProtocolError(f"descriptors[{i}]", str(exc)) from None
        fields["descriptors"] = tuple(parsed)
        return cls(**fields)


@dataclass(frozen=True)
class Control:
    """Out-of-band commands.  ``rank`` is -1 from the coordinator.

    ``ping`` (coordinator, nonce) is answered by ``ready`` (rank, same nonce);
    ``inspect`` (coordinator, nonce) by a
    :class:`~runtime.transport.inspection.RankStatus` with the same nonce;
    ``profile`` (coordinator, nonce, ``count`` frames) asks every rank to run
    ``torch.profiler`` over its next ``count`` frames and write the trace
    (:mod:`runtime.ranks.profiling`); each answers ``profiled`` (rank, same
    nonce, ``count``: the frames profiled, 0 if the trace could not be written);
    ``shutdown`` asks the ranks to leave their loop.

    Liveness (protocol version 8, :mod:`runtime.transport.liveness`):
    ``heartbeat`` travels both ways on the heartbeat sockets only (coordinator:
    rank -1; a rank: its rank; ``nonce``: the sender's sequence number);
    ``error`` (rank, ``reason``) tells the coordinator that this rank received
    a message it could not even decode (malformed, wrong version, wrong type),
    so a frame may be lost: the coordinator fails the frames in flight naming
    the rank.  ``reason``: at most :data:`MAX_ERROR_CHARS` characters, required
    for ``error``, empty for every other command.
    """

    command: str
    rank: int = COORDINATOR_RANK
    nonce: int = 0
    count: int = 0  # profile: frames to profile; profiled: frames profiled
    reason: str = ""  # error: why the rank could not decode a message

    def __post_init__(self) -> None:
        command = check_choice("command", self.command, CONTROL_COMMANDS)
        rank = check_int("rank", self.rank, COORDINATOR_RANK, MAX_WORLD_SIZE - 1)
        if command in RANK_COMMANDS and rank < 0:
            raise ProtocolError("rank", f"{command!r} comes from a rank (>= 0)")
        check_int("nonce", self.nonce)
        low = 1 if command == "profile" else 0
        check_int("count", self.count, low, MAX_PROFILE_FRAMES)
        reason = self.reason
        if not isinstance(reason, str):
            raise ProtocolError("reason", f"must be a string, got {type(reason).__name__}")
        if len(reason) > MAX_ERROR_CHARS:
            raise ProtocolError(
                "reason", f"at most {MAX_ERROR_CHARS} characters, got {len(reason)}"
            )
        reason = str.__str__(reason)
        if command == "error" and not reason:
            raise ProtocolError("reason", "an error control says why")
        if command != "error" and reason:
            raise ProtocolError("reason", f"only an error control carries one, not {command!r}")
        set_field(self, "command", command)
        set_field(self, "reason", reason)

    def to_wire(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "rank": self.rank,
            "nonce": self.nonce,
            "count": self.count,
            "reason": self.reason,
        }

    @classmethod
    def from_wire(cls, data: Any) -> Control:
        return cls(**check_fields(cls, data))


Message = SamplingParams | Frame | Tensor | Completion | CatalogReport | Control | RankStatus
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (SamplingParams, Frame, Tensor, Completion, CatalogReport, Control, RankStatus)
}


# ------------------------------------------------------------------ optional torch helpers


def tensor_from_torch(value: torch.Tensor) -> Tensor:
    """Copy a torch tensor (any device) into a wire :class:`Tensor`."""
    import torch

    if sys.byteorder != "little":
        raise NotImplementedError("tensor_from_torch assumes a little-endian host")
    names = {getattr(torch, name): name for name in DTYPES}
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
