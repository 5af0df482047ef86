"""Rank -> coordinator: :class:`Completion`, one rank's answer to one frame.

Lane results travel as int64 columns (:mod:`runtime.transport.columns`, protocol
version 2); :class:`LaneResult` is a per-lane view of them for tests and
consumers, not a message.  Sidecar tensors (:mod:`runtime.transport.tensor`)
travel beside them.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.catalog import MAX_BATCH_CAPACITY
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
    MAX_ERROR_CHARS,
    MAX_WORLD_SIZE,
    ProtocolError,
    check_choice,
    check_fields,
    check_instances,
    check_int,
    check_ints,
    check_str,
    parse_nested,
    set_field,
)
from runtime.transport.frame_lane import MAX_SLOTS
from runtime.transport.tensor import Tensor

MAX_LANE_TOKENS = 1 << 16  # tokens one lane result may carry
MAX_SIDECARS = 16
FINISH_REASONS = ("stop",)
# Sidecars every rank of a speculative round publishes (valid probabilities;
# rank 0's drive the coordinator): the rest are rank 0's alone.
PEER_SIDECARS = frozenset({"confidence", "survival"})
MAX_TIMESTAMP = (1 << 63) - 1
# The rank's host stages, in order (Completion.stage_ns; the debugging tools' names).
STAGE_NAMES = ("receive", "validate", "pack", "launch", "wait", "publish")


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

    Prompt log probabilities (protocol version 9): a scored prefill's rank 0
    adds, with ``N`` = the frame's packed prompt tokens (the sum of its lanes'
    ``query_len``, in lane order) and ``K`` = the frame's ``score_k``,
    ``sidecars["prompt_logprobs"]`` (float32, ``(N, 1 + K)``: per prompt
    position the log probability of the next prompt token, then the top-K,
    descending) and ``sidecars["prompt_logprob_token_ids"]`` (int32,
    ``(N, K)``).  The row of a chunk's last position whose ``score_next`` is -1
    (the prompt's end: no next prompt token) holds 0 first, to be ignored.

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
