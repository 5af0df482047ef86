"""Messages between the HTTP frontend and the coordinator, as frozen dataclasses.

The frontend tokenizes, detokenizes and speaks HTTP; the coordinator schedules.
Between them travel, in the same msgpack envelope as the rank messages
(:mod:`runtime.transport.codec`), validated on construction and on receipt:

frontend -> coordinator
    :class:`Submit` (a tokenized request), :class:`Cancel`, :class:`Publish`
    (output through ``fence`` became visible to the client at ``at_ns``, the
    host's monotonic clock: the scheduler's output-age cost runs on it), and
    :class:`StatusQuery`.
coordinator -> frontend
    :class:`Output` (the tokens one completed frame committed for a request,
    with their log probabilities when asked; the last one carries the finish
    reason), :class:`Status` (serving state and metric values) and
    :class:`Heartbeat` (sent every ``--heartbeat-interval`` seconds by a thread
    of its own: a frontend that hears nothing for ``--heartbeat-timeout``
    seconds treats the coordinator as stuck).

``request_id`` is chosen by the frontend (unique among its live requests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, ClassVar, TypeVar

from runtime.transport.completion import MAX_LANE_TOKENS
from runtime.transport.fields import (
    INT32_MAX,
    MAX_ERROR_CHARS,
    MAX_SEQUENCE,
    ProtocolError,
    check_choice,
    check_fields,
    check_float,
    check_int,
    check_ints,
    check_seq,
    check_str,
    parse_nested,
    set_field,
)
from runtime.transport.images import MAX_IMAGES, SubmitImage, check_images
from runtime.transport.sampling import MAX_LOGPROBS, SamplingParams

OUTPUT_FINISH_REASONS = ("stop", "length", "cancelled", "aborted", "error", "refused")
MAX_STATUS_VALUES = 1024
MAX_NAME = 256
MAX_SALT_CHARS = 256


def _check_bool(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise ProtocolError(name, f"must be a bool, got {type(value).__name__}")
    return value


def _check_error(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_ERROR_CHARS:
        raise ProtocolError("error", f"must be None or a string of at most {MAX_ERROR_CHARS}")
    return value


def _check_map(name: str, value: Any, kind: type) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolError(name, f"must be a map, got {type(value).__name__}")
    if len(value) > MAX_STATUS_VALUES:
        raise ProtocolError(name, f"has {len(value)} entries, at most {MAX_STATUS_VALUES}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        check_str(f"{name} key", key, MAX_NAME)
        if kind is int:
            out[key] = check_int(f"{name}[{key}]", item)
        else:
            out[key] = check_float(f"{name}[{key}]", item)
    return out


# ------------------------------------------------------------------ frontend -> coordinator


@dataclass(frozen=True)
class Submit:
    """A tokenized request.  ``ignore_eos``: run to ``max_tokens`` past eos tokens.

    ``group``: the admission group, the HTTP request this is a choice of (None:
    a group of its own); the scheduler admits round-robin across groups.
    ``cache_salt``: prefix-cache pages are shared only between requests with
    equal salts (a tenant's).  ``message_endpoints``: each chat message's end
    in ``prompt_token_ids`` (increasing, within the prompt): checkpoint anchors.
    ``prompt_logprobs``: -1, or score the prompt (runs on scored prefill
    programs, docs/scored-prefill.md) and return each prompt token's log
    probability with this many top alternatives (0..MAX_LOGPROBS); then
    ``max_tokens`` may be 0 (the prompt alone).  ``images``: the prompt's images
    in prompt order (:class:`~runtime.transport.images.SubmitImage`: each one's
    span of image tokens, digest and float32 pixels), checked against the prompt
    (spans in order, disjoint, inside it; digests recomputed from the pixels).
    """

    request_id: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    group: int | None = None
    cache_salt: str = ""
    message_endpoints: tuple[int, ...] = ()
    prompt_logprobs: int = -1
    images: tuple[SubmitImage, ...] = ()

    def __post_init__(self) -> None:
        check_int("request_id", self.request_id)
        prompt = check_ints("prompt_token_ids", self.prompt_token_ids, 0, INT32_MAX, MAX_SEQUENCE)
        if not prompt:
            raise ProtocolError("prompt_token_ids", "needs at least one token")
        scored = check_int("prompt_logprobs", self.prompt_logprobs, -1, MAX_LOGPROBS) >= 0
        check_int("max_tokens", self.max_tokens, 0 if scored else 1, INT32_MAX)
        if not isinstance(self.sampling, SamplingParams):
            raise ProtocolError("sampling", "must be a SamplingParams")
        _check_bool("ignore_eos", self.ignore_eos)
        if self.group is not None:
            check_int("group", self.group)
        if self.cache_salt != "":  # "" is no salt
            check_str("cache_salt", self.cache_salt, MAX_SALT_CHARS)
        ends = check_ints("message_endpoints", self.message_endpoints, 1, len(prompt), 4096)
        if any(a >= b for a, b in pairwise(ends)):
            raise ProtocolError("message_endpoints", "must be strictly increasing")
        set_field(self, "prompt_token_ids", prompt)
        set_field(self, "message_endpoints", ends)
        set_field(self, "images", check_images(self.images, prompt))

    def to_wire(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "max_tokens": self.max_tokens,
            "sampling": self.sampling.to_wire(),
            "ignore_eos": self.ignore_eos,
            "group": self.group,
            "cache_salt": self.cache_salt,
            "message_endpoints": list(self.message_endpoints),
            "prompt_logprobs": self.prompt_logprobs,
            "images": [image.to_wire() for image in self.images],
        }

    @classmethod
    def from_wire(cls, data: Any) -> Submit:
        fields = dict(check_fields(cls, data))
        fields["sampling"] = parse_nested("sampling", SamplingParams.from_wire, fields["sampling"])
        images = check_seq("images", fields["images"], MAX_IMAGES)
        fields["images"] = tuple(
            parse_nested(f"images[{i}]", SubmitImage.from_wire, item)
            for i, item in enumerate(images)
        )
        return cls(**fields)


_M = TypeVar("_M", bound="_Counters")


class _Counters:
    """A message whose every field is an integer in [0, 2**63): each is checked in
    field order, and the wire map holds them by name in that order."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            check_int(name, getattr(self, name))

    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_wire(cls: type[_M], data: Any) -> _M:
        return cls(**check_fields(cls, data))


@dataclass(frozen=True)
class Cancel(_Counters):
    """Stop a request (its client went away, or a stop string ended it)."""

    request_id: int


@dataclass(frozen=True)
class Publish(_Counters):
    """The request's output through ``fence`` became visible at ``at_ns`` (monotonic ns)."""

    request_id: int
    fence: int
    at_ns: int


@dataclass(frozen=True)
class StatusQuery(_Counters):
    """Ask for a :class:`Status` carrying the same ``nonce``."""

    nonce: int


# ------------------------------------------------------------------ coordinator -> frontend


@dataclass(frozen=True)
class TokenLogprobs:
    """One committed token's log probability and the top alternatives, best first."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if type(self.logprob) not in (int, float):
            raise ProtocolError("logprob", f"must be a number, got {type(self.logprob).__name__}")
        if not self.logprob < math.inf:  # NaN fails too
            raise ProtocolError("logprob", f"must be a log probability, got {self.logprob}")
        ids = check_ints("top_token_ids", self.top_token_ids, 0, INT32_MAX, MAX_LOGPROBS)
        values = check_seq("top_logprobs", self.top_logprobs, MAX_LOGPROBS)
        if len(values) != len(ids):
            raise ProtocolError("top_logprobs", f"{len(values)} values for {len(ids)} token ids")
        for i, value in enumerate(values):
            if type(value) not in (int, float) or not value < math.inf:
                raise ProtocolError(f"top_logprobs[{i}]", f"must be a log probability, got {value}")
        # -inf is a legal log probability; NaN and +inf are not.
        set_field(self, "logprob", float(self.logprob))
        set_field(self, "top_token_ids", ids)
        set_field(self, "top_logprobs", tuple(float(v) for v in values))

    def to_wire(self) -> dict[str, Any]:
        return {
            "logprob": self.logprob,
            "top_token_ids": list(self.top_token_ids),
            "top_logprobs": list(self.top_logprobs),
        }

    @classmethod
    def from_wire(cls, data: Any) -> TokenLogprobs:
        return cls(**check_fields(cls, data))


@dataclass(frozen=True)
class Output:
    """Tokens frame ``fence`` committed for a request (possibly none, when finishing).

    ``finish_reason`` is set on the request's last output: "stop" (an eos
    token), "length", "cancelled", "aborted" (the engine stopped), "error"
    (the engine failed; ``error`` says why) or "refused" (the request cannot
    run, e.g. it needs more KV pages than the ranks hold; ``error`` says why).
    ``logprobs``: one entry per token when the request asked for them, else
    empty.  ``cached_tokens``: prompt tokens the request found in the prefix
    cache (usage's ``prompt_tokens_details.cached_tokens``).
    ``prompt_logprobs``: for a request submitted with ``prompt_logprobs >= 0``,
    on its first output (its first tokens, or its finish when it has none):
    one entry per prompt token after the first (the first has no context),
    in prompt order: the token's log probability and the top alternatives at
    its position; else empty.
    """

    request_id: int
    fence: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    def __post_init__(self) -> None:
        check_int("request_id", self.request_id)
        check_int("fence", self.fence)
        tokens = check_ints("token_ids", self.token_ids, 0, INT32_MAX, MAX_LANE_TOKENS)
        if self.finish_reason is not None:
            check_choice("finish_reason", self.finish_reason, OUTPUT_FINISH_REASONS)
        error = _check_error(self.error)
        if error is not None and self.finish_reason not in ("error", "refused"):
            raise ProtocolError("error", "only an 'error' or 'refused' output carries one")
        logprobs = check_seq("logprobs", self.logprobs, MAX_LANE_TOKENS)
        for i, item in enumerate(logprobs):
            if not isinstance(item, TokenLogprobs):
                raise ProtocolError(f"logprobs[{i}]", "must be a TokenLogprobs")
        if logprobs and len(logprobs) != len(tokens):
            raise ProtocolError("logprobs", f"{len(logprobs)} entries for {len(tokens)} tokens")
        check_int("cached_tokens", self.cached_tokens, 0, INT32_MAX)
        scores = check_seq("prompt_logprobs", self.prompt_logprobs, MAX_SEQUENCE)
        for i, item in enumerate(scores):
            if not isinstance(item, TokenLogprobs):
                raise ProtocolError(f"prompt_logprobs[{i}]", "must be a TokenLogprobs")
        set_field(self, "token_ids", tokens)
        set_field(self, "logprobs", logprobs)
        set_field(self, "prompt_logprobs", scores)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_wire(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "fence": self.fence,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "error": self.error,
            "logprobs": [item.to_wire() for item in self.logprobs],
            "cached_tokens": self.cached_tokens,
            "prompt_logprobs": [item.to_wire() for item in self.prompt_logprobs],
        }

    @classmethod
    def from_wire(cls, data: Any) -> Output:
        fields = dict(check_fields(cls, data))
        items = check_seq("logprobs", fields["logprobs"], MAX_LANE_TOKENS)
        fields["logprobs"] = tuple(
            parse_nested(f"logprobs[{i}]", TokenLogprobs.from_wire, item)
            for i, item in enumerate(items)
        )
        scores = check_seq("prompt_logprobs", fields["prompt_logprobs"], MAX_SEQUENCE)
        fields["prompt_logprobs"] = tuple(
            parse_nested(f"prompt_logprobs[{i}]", TokenLogprobs.from_wire, item)
            for i, item in enumerate(scores)
        )
        return cls(**fields)


@dataclass(frozen=True)
class Status:
    """The coordinator's state, answering a :class:`StatusQuery` with its ``nonce``.

    ``serving``: the engine runs and accepts requests.  ``values``: metric
    values by name (counters and gauges, see ``runtime.coordinator.engine.bridge``);
    ``graph_estimates_ns``: each program's current duration estimate.
    """

    nonce: int
    serving: bool
    model_name: str
    vocab_size: int
    max_context: int
    tensor_parallel_size: int
    max_concurrency: int
    kv_tokens: int = 1  # tokens the KV cache holds (pages x page size)
    values: Mapping[str, float] = field(default_factory=dict)
    graph_estimates_ns: Mapping[str, int] = field(default_factory=dict)
    error: str | None = None

    def __post_init__(self) -> None:
        check_int("nonce", self.nonce)
        _check_bool("serving", self.serving)
        check_str("model_name", self.model_name, MAX_NAME)
        check_int("vocab_size", self.vocab_size, 1, INT32_MAX)
        check_int("max_context", self.max_context, 1, INT32_MAX)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, INT32_MAX)
        check_int("max_concurrency", self.max_concurrency, 1, INT32_MAX)
        check_int("kv_tokens", self.kv_tokens, 1, INT32_MAX)
        set_field(self, "values", _check_map("values", self.values, float))
        estimates = _check_map("graph_estimates_ns", self.graph_estimates_ns, int)
        set_field(self, "graph_estimates_ns", estimates)
        _check_error(self.error)

    def to_wire(self) -> dict[str, Any]:
        return {
            "nonce": self.nonce,
            "serving": self.serving,
            "model_name": self.model_name,
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_concurrency": self.max_concurrency,
            "kv_tokens": self.kv_tokens,
            "values": dict(self.values),
            "graph_estimates_ns": dict(self.graph_estimates_ns),
            "error": self.error,
        }

    @classmethod
    def from_wire(cls, data: Any) -> Status:
        return cls(**check_fields(cls, data))


@dataclass(frozen=True)
class Heartbeat:
    """The coordinator is alive: ``seq`` counts its heartbeats from 1; ``serving``:
    its engine accepts requests (False: stopping or failed; a :class:`Status`
    says why)."""

    seq: int
    serving: bool

    def __post_init__(self) -> None:
        check_int("seq", self.seq)
        _check_bool("serving", self.serving)

    def to_wire(self) -> dict[str, Any]:
        return {"seq": self.seq, "serving": self.serving}

    @classmethod
    def from_wire(cls, data: Any) -> Heartbeat:
        return cls(**check_fields(cls, data))


ApiMessage = Submit | Cancel | Publish | StatusQuery | TokenLogprobs | Output | Status | Heartbeat
API_MESSAGE_TYPES: dict[str, type[ApiMessage]] = {
    cls.__name__: cls
    for cls in (Submit, Cancel, Publish, StatusQuery, TokenLogprobs, Output, Status, Heartbeat)
}
