"""Every message between the coordinator and the ranks, as frozen dataclasses.

One dataclass per message.  Construction validates every field (type, range and
the consistency of lengths) and raises :class:`ProtocolError` naming the field,
so an invalid message can neither be built by a sender nor accepted by a
receiver.  ``to_wire()`` gives plain msgpack-able maps; ``from_wire()`` checks
the map's keys exactly (every field is required, no unknown field is allowed),
converts nested messages and constructs, which validates.

Sequences are stored as tuples; sidecar tensors travel as raw little-endian
bytes with dtype and shape.  Integers on the wire are bounded so that a rank can
copy them into int32/int64 device buffers without overflow.

This module imports no torch: the torch conversions at the bottom import it
only when called.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.catalog import (
    MAX_BATCH_CAPACITY,
    CatalogError,
    GraphDescriptor,
    GraphKind,
    validate_catalog,
)
from runtime.transport.fields import (
    INT32_MAX,
    ProtocolError,
    check_choice,
    check_fields,
    check_float,
    check_instances,
    check_int,
    check_ints,
    check_seq,
    check_str,
    check_unique,
    parse_nested,
    set_field,
)

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1

MAX_SLOTS = MAX_BATCH_CAPACITY  # slots are 0..63
MAX_WORLD_SIZE = 4096
MAX_LANE_TOKENS = 1 << 16  # tokens one lane result may carry
MAX_DESCRIPTORS = 1 << 12
MAX_SIDECARS = 16
MAX_TENSOR_NDIM = 8
MAX_LOGPROBS = 20  # top log probabilities a lane may ask for (SamplingParams.logprobs)

PHASES = ("prefill", "decode")
FINISH_REASONS = ("stop",)
CONTROL_COMMANDS = ("shutdown", "ping", "ready")
COORDINATOR_RANK = -1


# ------------------------------------------------------------------ requests


MAX_LOGIT_BIAS = 300  # token entries of SamplingParams.logit_bias (OpenAI's bound)
LOGIT_BIAS_LIMIT = 100.0  # |bias| bound, as OpenAI and vLLM take it
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| bound (OpenAI's range)


@dataclass(frozen=True)
class SamplingParams:
    """Per-lane sampling.  ``temperature`` 0 is greedy; ``top_k`` -1 is unlimited.

    ``min_tokens``: the model's EOS ids cannot be sampled until the request has
    produced this many tokens (vLLM's ``min_tokens``).  ``logprobs``: -1 for
    none, else 0..:data:`MAX_LOGPROBS`: rank 0 returns the sampled token's log
    probability and this many top tokens with theirs (``Completion.sidecars``),
    from ``log_softmax`` of the raw logits (before logit bias, penalties,
    temperature, top-k, top-p).

    Logit adjustments, with vLLM's semantics and in vLLM's order (bias, then
    repetition, then frequency and presence), applied before temperature (so
    a greedy request takes the argmax of the adjusted logits; the log
    probabilities stay those of the raw logits): ``logit_bias``
    ((token id, bias) pairs, bias in [-100, 100], at most
    :data:`MAX_LOGIT_BIAS`, ids distinct) is added; ``presence_penalty`` and
    ``frequency_penalty`` (in [-2, 2]) subtract ``presence * [count > 0] +
    frequency * count`` over the tokens the request has generated;
    ``repetition_penalty`` (> 0, 1 = off) divides positive and multiplies
    negative logits of every token seen in the prompt or the output.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    min_tokens: int = 0
    logprobs: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        temperature = check_float("temperature", self.temperature)
        if temperature < 0:
            raise ProtocolError("temperature", f"must be >= 0, got {temperature}")
        top_p = check_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ProtocolError("top_p", f"must lie in (0, 1], got {top_p}")
        top_k = check_int("top_k", self.top_k, -1, INT32_MAX)
        if top_k == 0:
            raise ProtocolError("top_k", "must be -1 (unlimited) or >= 1, got 0")
        check_int("seed", self.seed)
        check_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        check_int("logprobs", self.logprobs, -1, MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_float(name, getattr(self, name))
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ProtocolError(name, f"must lie in [-2, 2], got {value}")
            set_field(self, name, value)
        repetition = check_float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise ProtocolError("repetition_penalty", f"must be > 0, got {repetition}")
        set_field(self, "repetition_penalty", repetition)
        set_field(self, "logit_bias", _logit_bias(self.logit_bias))
        set_field(self, "temperature", temperature)
        set_field(self, "top_p", top_p)

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit adjustment (bias or penalty) is on."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "min_tokens": self.min_tokens,
            "logprobs": self.logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": [[token, bias] for token, bias in self.logit_bias],
        }

    @classmethod
    def from_wire(cls, data: Any) -> SamplingParams:
        return cls(**check_fields(cls, data))


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """Validated (token id, bias) pairs, ids distinct, in the order given."""
    pairs = check_seq("logit_bias", value, MAX_LOGIT_BIAS)
    out: list[tuple[int, float]] = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ProtocolError(f"logit_bias[{i}]", "must be a (token id, bias) pair")
        token = check_int(f"logit_bias[{i}][0]", pair[0], 0, INT32_MAX)
        bias = check_float(f"logit_bias[{i}][1]", pair[1])
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ProtocolError(f"logit_bias[{i}][1]", f"must lie in [-100, 100], got {bias}")
        out.append((token, bias))
    check_unique("logit_bias", [token for token, _ in out])
    return tuple(out)


@dataclass(frozen=True)
class FrameLane:
    """One request's row of a frame.

    ``generation``: the slot's request epoch; a new generation replaces the
    slot's rank-side state.  ``prompt_start``/``prompt_tokens``: the prompt
    extent a prefill row consumes (decode rows carry no tokens: the ranks keep
    each slot's pending token).  ``position``: KV position of the first token
    the lane writes.  ``page_table``: the slot's KV pages, distinct; required
    on prefill lanes, and may be empty on decode lanes, where the ranks use the
    table the slot's prefill gave them (so steady decode frames stay small).
    ``max_tokens``: tokens the lane commits, 0 for a prefill chunk short of the
    prompt end, else 1 (always 1 for decode).  ``sampling``: required on
    prefill lanes; None on decode lanes means the slot's settings.
    """

    slot: int
    generation: int
    phase: str
    prompt_start: int
    prompt_tokens: tuple[int, ...]
    position: int
    page_table: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams | None = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        check_int("slot", self.slot, 0, MAX_SLOTS - 1)
        check_int("generation", self.generation, 1)
        phase = check_choice("phase", self.phase, PHASES)
        check_int("prompt_start", self.prompt_start, 0, INT32_MAX)
        tokens = check_ints("prompt_tokens", self.prompt_tokens, 0, INT32_MAX)
        check_int("position", self.position, 0, INT32_MAX)
        pages = check_ints("page_table", self.page_table, 0, INT32_MAX)
        max_tokens = check_int("max_tokens", self.max_tokens, 0, 1)
        if self.sampling is None:
            if phase == "prefill":
                raise ProtocolError("sampling", "a prefill lane needs its SamplingParams")
        elif not isinstance(self.sampling, SamplingParams):
            raise ProtocolError("sampling", "must be a SamplingParams or None")
        if phase == "prefill" and not tokens:
            raise ProtocolError("prompt_tokens", "a prefill lane needs at least one token")
        if phase == "decode" and tokens:
            raise ProtocolError("prompt_tokens", f"a decode lane carries none, got {len(tokens)}")
        if phase == "decode" and max_tokens != 1:
            raise ProtocolError("max_tokens", "a decode lane commits exactly 1 token")
        if phase == "prefill" and not pages:
            raise ProtocolError("page_table", "a prefill lane needs at least one page")
        check_unique("page_table", pages)
        set_field(self, "phase", phase)
        set_field(self, "prompt_tokens", tokens)
        set_field(self, "page_table", pages)

    def to_wire(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "generation": self.generation,
            "phase": self.phase,
            "prompt_start": self.prompt_start,
            "prompt_tokens": list(self.prompt_tokens),
            "position": self.position,
            "page_table": list(self.page_table),
            "max_tokens": self.max_tokens,
            "sampling": None if self.sampling is None else self.sampling.to_wire(),
        }

    @classmethod
    def from_wire(cls, data: Any) -> FrameLane:
        fields = dict(check_fields(cls, data))
        if fields["sampling"] is not None:
            fields["sampling"] = parse_nested(
                "sampling", SamplingParams.from_wire, fields["sampling"]
            )
        return cls(**fields)


def _program(data: Any) -> GraphDescriptor:
    try:
        return GraphDescriptor.from_wire(data)
    except (CatalogError, TypeError, ValueError) as exc:
        raise ProtocolError("program", str(exc)) from None


@dataclass(frozen=True)
class Frame:
    """Coordinator -> ranks: run ``program`` on ``lanes``.

    ``lanes``: up to ``program.batch_capacity`` rows with distinct slots; their
    prompt tokens fit ``program.prompt_capacity`` (so decode-only programs take
    no prefill lanes).  A frame with no lanes is an *empty frame*: the ranks
    check it, apply its releases and answer without running the program (the
    coordinator measures its round trip with one).  ``prompt_row``: index of
    the prompt (prefill) lane of a mixed program, -1 for none.  A mixed frame
    has at most one prefill lane and ``prompt_row`` names exactly it (-1 when
    there is none); its other lanes are decode lanes, which carry no tokens,
    and the prompt row's tokens fit ``prompt_capacity``.  Every other program
    takes ``prompt_row`` -1.  ``release_slots``: slots whose rank-side state
    may be dropped, distinct and disjoint from the lanes' slots.
    """

    fence: int
    program: GraphDescriptor
    lanes: tuple[FrameLane, ...]
    prompt_row: int = -1
    release_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_int("fence", self.fence)
        if not isinstance(self.program, GraphDescriptor):
            raise ProtocolError("program", "must be a GraphDescriptor")
        capacity = self.program.batch_capacity
        lanes = check_instances("lanes", self.lanes, FrameLane, capacity)
        slots = [lane.slot for lane in lanes]
        check_unique("lanes.slot", slots)
        prompt_tokens = sum(len(lane.prompt_tokens) for lane in lanes)
        if prompt_tokens > self.program.prompt_capacity:
            raise ProtocolError(
                "lanes",
                f"{prompt_tokens} prompt tokens exceed the program's prompt_capacity "
                f"{self.program.prompt_capacity}",
            )
        row = check_int("prompt_row", self.prompt_row, -1, len(lanes) - 1)
        if row >= 0 and lanes[row].phase != "prefill":
            raise ProtocolError("prompt_row", f"lane {row} is not a prefill lane")
        if self.program.kind is GraphKind.MIXED:
            prefill = [i for i, lane in enumerate(lanes) if lane.phase == "prefill"]
            if len(prefill) > 1:
                raise ProtocolError(
                    "lanes", f"a mixed frame has at most one prefill lane, got lanes {prefill}"
                )
            if row != (prefill[0] if prefill else -1):
                raise ProtocolError(
                    "prompt_row",
                    f"must name the prefill lane ({prefill[0] if prefill else -1}), got {row}",
                )
        elif row != -1:
            kind = self.program.kind.value
            raise ProtocolError("prompt_row", f"only mixed programs have one, not {kind}")
        released = check_ints("release_slots", self.release_slots, 0, MAX_SLOTS - 1, MAX_SLOTS)
        check_unique("release_slots", released)
        overlap = set(released) & set(slots)
        if overlap:
            raise ProtocolError("release_slots", f"slot(s) {sorted(overlap)} also run in lanes")
        set_field(self, "lanes", lanes)
        set_field(self, "release_slots", released)

    def to_wire(self) -> dict[str, Any]:
        return {
            "fence": self.fence,
            "program": self.program.to_wire(),
            "lanes": [lane.to_wire() for lane in self.lanes],
            "prompt_row": self.prompt_row,
            "release_slots": list(self.release_slots),
        }

    @classmethod
    def from_wire(cls, data: Any) -> Frame:
        fields = dict(check_fields(cls, data))
        fields["program"] = _program(fields["program"])
        lanes = check_seq("lanes", fields["lanes"], MAX_BATCH_CAPACITY)
        fields["lanes"] = tuple(
            parse_nested(f"lanes[{i}]", FrameLane.from_wire, lane) for i, lane in enumerate(lanes)
        )
        return cls(**fields)


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
    """One lane's committed tokens; mirrors ``CompletionRecord``."""

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

    def to_wire(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "generation": self.generation,
            "tokens": list(self.tokens),
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_wire(cls, data: Any) -> LaneResult:
        return cls(**check_fields(cls, data))


MAX_ERROR_CHARS = 4096  # an error completion's reason


@dataclass(frozen=True)
class Completion:
    """Rank -> coordinator: one rank finished frame ``fence``.

    ``device_ns``: the rank's replay interval; ``readiness_delay_ns``: exposed
    input-readiness stall within it.  Only rank 0 sends ``lanes`` (in the
    frame's lane order, distinct slots) and ``sidecars`` (e.g. "confidence",
    "survival"); the other ranks send neither.

    Log probabilities: when at least one lane of the frame has
    ``sampling.logprobs >= 0``, rank 0 adds, with ``R`` = the frame's lane count
    and ``K`` = the largest ``logprobs`` a lane asked for, ``sidecars["logprobs"]``
    (float32, shape ``(R, 1 + K)``: per lane the sampled token's log probability,
    then the top-K log probabilities, descending) and
    ``sidecars["logprob_token_ids"]`` (int32, shape ``(R, K)``: the top-K token
    ids, in the same order).  Row ``i`` is lane ``i``; rows of lanes that asked
    for fewer (or none), and of prefill chunks that commit no token, hold
    whatever was computed and are to be ignored.  Frames where no lane asks
    carry neither.

    ``error``: the rank could not run the frame (it names why); such a
    completion carries no lanes, and the coordinator must not assume the ranks'
    state advanced.
    """

    fence: int
    rank: int
    world_size: int
    device_ns: int
    readiness_delay_ns: int = 0
    lanes: tuple[LaneResult, ...] = ()
    sidecars: Mapping[str, Tensor] = field(default_factory=dict)
    error: str | None = None

    def __post_init__(self) -> None:
        check_int("fence", self.fence)
        world_size = check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        rank = check_int("rank", self.rank, 0, world_size - 1)
        check_int("device_ns", self.device_ns)
        check_int("readiness_delay_ns", self.readiness_delay_ns)
        lanes = check_instances("lanes", self.lanes, LaneResult, MAX_BATCH_CAPACITY)
        check_unique("lanes.slot", [lane.slot for lane in lanes])
        if not isinstance(self.sidecars, Mapping):
            raise ProtocolError("sidecars", "must be a map of name to Tensor")
        if len(self.sidecars) > MAX_SIDECARS:
            raise ProtocolError("sidecars", f"at most {MAX_SIDECARS}, got {len(self.sidecars)}")
        for name, tensor in self.sidecars.items():
            check_str("sidecars", name, 64)
            if not isinstance(tensor, Tensor):
                raise ProtocolError(f"sidecars[{name}]", "must be a Tensor")
        if rank != 0 and lanes:
            raise ProtocolError("lanes", f"only rank 0 reports lanes, rank {rank} sent some")
        if rank != 0 and self.sidecars:
            raise ProtocolError("sidecars", f"only rank 0 reports sidecars, rank {rank} sent some")
        if self.error is not None:
            check_str("error", self.error, MAX_ERROR_CHARS)
            if lanes or self.sidecars:
                raise ProtocolError("error", "an error completion carries no lanes or sidecars")
        set_field(self, "lanes", lanes)
        set_field(self, "sidecars", dict(self.sidecars))

    def to_wire(self) -> dict[str, Any]:
        return {
            "fence": self.fence,
            "rank": self.rank,
            "world_size": self.world_size,
            "device_ns": self.device_ns,
            "readiness_delay_ns": self.readiness_delay_ns,
            "lanes": [lane.to_wire() for lane in self.lanes],
            "sidecars": {name: t.to_wire() for name, t in self.sidecars.items()},
            "error": self.error,
        }

    @classmethod
    def from_wire(cls, data: Any) -> Completion:
        fields = dict(check_fields(cls, data))
        lanes = check_seq("lanes", fields["lanes"], MAX_BATCH_CAPACITY)
        fields["lanes"] = tuple(
            parse_nested(f"lanes[{i}]", LaneResult.from_wire, lane) for i, lane in enumerate(lanes)
        )
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


@dataclass(frozen=True)
class CatalogReport:
    """Rank -> coordinator after capture: the prepared programs and model facts."""

    rank: int
    world_size: int
    descriptors: tuple[GraphDescriptor, ...]
    vocab_size: int
    max_context: int
    page_size: int
    num_pages: int
    model_name: str

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
    ``shutdown`` asks the ranks to leave their loop.
    """

    command: str
    rank: int = COORDINATOR_RANK
    nonce: int = 0

    def __post_init__(self) -> None:
        command = check_choice("command", self.command, CONTROL_COMMANDS)
        rank = check_int("rank", self.rank, COORDINATOR_RANK, MAX_WORLD_SIZE - 1)
        if command == "ready" and rank < 0:
            raise ProtocolError("rank", "'ready' comes from a rank (>= 0)")
        check_int("nonce", self.nonce)
        set_field(self, "command", command)

    def to_wire(self) -> dict[str, Any]:
        return {"command": self.command, "rank": self.rank, "nonce": self.nonce}

    @classmethod
    def from_wire(cls, data: Any) -> Control:
        return cls(**check_fields(cls, data))


Message = (
    SamplingParams | FrameLane | Frame | Tensor | LaneResult | Completion | CatalogReport | Control
)
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (
        SamplingParams,
        FrameLane,
        Frame,
        Tensor,
        LaneResult,
        Completion,
        CatalogReport,
        Control,
    )
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
