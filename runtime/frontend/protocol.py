"""Validation of ``POST /v1/completions`` and ``POST /v1/chat/completions`` bodies.

``parse_completion(body, limits, tokenizer)`` and ``parse_chat(body, limits, tokenizer,
template)`` turn a decoded JSON body into a frozen ``GenerationRequest`` (prompt token
ids plus everything the engine and the response writer need), or raise ``RequestError``
with the HTTP status and the OpenAI error body (``to_json()``), naming the bad field in
``param``. Plain code rather than pydantic: each check names its field exactly, and
booleans are never taken for integers.

Accepted fields (null means "not given"; unknown fields are ignored, as OpenAI does):

- ``model``: the served model's name (default); another name is a 404
  ``model_not_found`` naming ``model``.
- completions ``prompt``: a non-empty string, a list of one string, or a non-empty list
  of token ids in ``[0, vocab_size)``. Text is encoded with the tokenizer's special
  tokens (a BOS where the tokenizer adds one). ``parse_completions`` also takes a
  batch: a list of such prompts (strings or token-id lists), one request each.
- chat ``messages``: a non-empty list of ``{"role": "system"|"user"|"assistant",
  "content": str | [{"type": "text", "text": str}, ...]}``; text parts are joined with
  "\\n" (as vLLM does). The prompt is the chat template's rendering.
- ``max_tokens`` (chat also ``max_completion_tokens``, which wins): an int >= 1. Default:
  the rest of the context, capped by ``ServingLimits.default_max_tokens`` when set.
- ``temperature`` (finite, >= 0, default 1.0; 0 is greedy), ``top_p`` (0 < p <= 1),
  ``top_k`` (int >= -1; 0 and -1 disable it and are returned as -1), ``seed`` (0 <= seed
  < 2**63, or null for a random one), ``n`` (1..16).
- ``stop``: a non-empty string or a list of at most 16; ``stop_token_ids``: ids in
  ``[0, vocab_size)``.
- completions ``logprobs``: int 0..20, the number of top alternatives per token; chat
  ``logprobs: bool`` with ``top_logprobs`` 0..20 (which needs ``logprobs: true``). Both
  end up as ``GenerationRequest.logprobs`` (None: no logprobs).
- ``stream``, ``stream_options.include_usage`` (stream_options only with stream: true),
  ``ignore_eos`` (vLLM), ``min_tokens`` (0..max_tokens, vLLM); ``echo: true`` is refused.

Context: a prompt that leaves no room for one output token (``len(prompt) >=
max_context``) is an error naming ``prompt`` (``messages`` for chat); prompt plus an
explicit ``max_tokens`` over ``max_context`` is an error naming the max-tokens field.
Both carry the code ``context_length_exceeded``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.frontend.chat import ROLES, ChatMessage, ChatTemplate, ChatTemplateError

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP",
    "Encoder",
    "GenerationRequest",
    "RequestError",
    "ServingLimits",
    "parse_chat",
    "parse_completion",
    "parse_completions",
]

MAX_N = 16
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_STOP = 16
MAX_LOGPROBS = 20
_SEED_END = 2**63


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None,
        type: str = "invalid_request_error",
        *,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def to_json(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class ServingLimits:
    """What the server serves: checked against every request.

    ``default_max_tokens``: the max_tokens of a request that gives none, capped by the
    rest of the context; None means the rest of the context (OpenAI's legacy completions
    used 16).
    """

    model_name: str
    vocab_size: int
    max_context: int
    default_max_tokens: int | None = None
    kv_tokens: int | None = None  # tokens the KV cache holds for one request (pages x size)

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        for name in ("vocab_size", "max_context"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.default_max_tokens is not None and (
            type(self.default_max_tokens) is not int or self.default_max_tokens < 1
        ):
            raise ValueError(
                "default_max_tokens must be a positive int or None, "
                f"got {self.default_max_tokens!r}"
            )


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, ready for ``engine.submit``.

    ``prompt``: the prompt text (chat: the rendered template), None when the client sent
    token ids. ``top_k`` -1 is disabled; ``seed`` None asks the server for a random one;
    ``logprobs`` None means no logprobs, k >= 0 the sampled token's plus the top k.
    """

    model: str
    prompt_token_ids: tuple[int, ...]
    prompt: str | None
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0


class Encoder(Protocol):
    """What validation needs of a tokenizer (``ModelTokenizer`` is one)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...


def parse_completion(body: object, limits: ServingLimits, tokenizer: Encoder) -> GenerationRequest:
    """Validate a ``/v1/completions`` body; RequestError on any invalid field."""
    obj = _object(body)
    model = _model(obj, limits)
    prompt = _completion_prompt(obj.get("prompt"), limits)
    fields = _common(obj, limits)
    max_tokens = _int(obj, "max_tokens", lo=1)
    logprobs = _int(obj, "logprobs", lo=0, hi=MAX_LOGPROBS)
    if isinstance(prompt, str):
        text, ids = prompt, tuple(tokenizer.encode(prompt))
    else:
        text, ids = None, prompt
    return _build(model, ids, text, "prompt", max_tokens, "max_tokens", logprobs, fields, limits)


def parse_completions(
    body: object, limits: ServingLimits, tokenizer: Encoder
) -> list[GenerationRequest]:
    """A ``/v1/completions`` body whose prompt may be a batch: a list of strings or a
    list of token-id lists (vLLM and OpenAI accept both).  One request per prompt,
    each checked like a single one; an error names ``prompt[i]``."""
    obj = _object(body)
    prompts = obj.get("prompt")
    batched = (
        isinstance(prompts, list)
        and len(prompts) > 0
        and all(isinstance(p, (str, list)) for p in prompts)
        and not (len(prompts) == 1 and isinstance(prompts[0], str))
    )
    if not batched:
        return [parse_completion(obj, limits, tokenizer)]
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(
            400, f"prompt takes at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt"
        )
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(parse_completion({**obj, "prompt": prompt}, limits, tokenizer))
        except RequestError as exc:
            param = f"prompt[{i}]" if exc.param == "prompt" else exc.param
            message = f"prompt[{i}]: {exc.message}" if exc.param == "prompt" else exc.message
            raise RequestError(exc.status, message, param, exc.type, code=exc.code) from None
    return out


def parse_chat(
    body: object, limits: ServingLimits, tokenizer: Encoder, template: ChatTemplate
) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and render its prompt with ``template``."""
    obj = _object(body)
    model = _model(obj, limits)
    messages = _messages(obj.get("messages"))
    fields = _common(obj, limits)
    max_completion = _int(obj, "max_completion_tokens", lo=1)
    max_plain = _int(obj, "max_tokens", lo=1)
    if max_completion is not None:
        max_tokens, max_param = max_completion, "max_completion_tokens"
    else:
        max_tokens, max_param = max_plain, "max_tokens"
    top_logprobs = _int(obj, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    logprobs: int | None = None
    if _bool(obj, "logprobs"):
        logprobs = top_logprobs or 0
    elif top_logprobs is not None:
        raise RequestError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    try:
        text = template.render(messages)
    except ChatTemplateError as exc:
        raise RequestError(400, str(exc), "messages") from exc
    ids = tuple(tokenizer.encode(text, add_special_tokens=template.add_special_tokens))
    return _build(model, ids, text, "messages", max_tokens, max_param, logprobs, fields, limits)


# -- shared fields --------------------------------------------------------------------


def _build(
    model: str,
    ids: tuple[int, ...],
    text: str | None,
    prompt_param: str,
    max_tokens: int | None,
    max_param: str,
    logprobs: int | None,
    fields: dict[str, Any],
    limits: ServingLimits,
) -> GenerationRequest:
    """Apply the context checks and the max_tokens default; assemble the request."""
    if not ids:
        raise RequestError(400, "the prompt encodes to no tokens", prompt_param)
    context = limits.max_context
    limit = f"This model's maximum context length is {context} tokens"
    if limits.kv_tokens is not None and limits.kv_tokens < context:
        context = limits.kv_tokens  # the KV cache, not the model, is the tighter limit
        limit = f"The KV cache holds {context} tokens for one request"
    room = context - len(ids)
    if room < 1:
        raise RequestError(
            400,
            f"{limit}; the prompt has {len(ids)} tokens, leaving no room to generate",
            prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = (
            room if limits.default_max_tokens is None else min(room, limits.default_max_tokens)
        )
    elif max_tokens > room:
        raise RequestError(
            400,
            f"{limit}; the prompt has "
            f"{len(ids)} tokens and {max_param} asks for {max_tokens} more "
            f"(at most {room} fit)",
            max_param,
            code="context_length_exceeded",
        )
    if fields["min_tokens"] > max_tokens:
        raise RequestError(
            400,
            f"min_tokens ({fields['min_tokens']}) must not exceed max_tokens ({max_tokens})",
            "min_tokens",
        )
    return GenerationRequest(
        model=model,
        prompt_token_ids=ids,
        prompt=text,
        max_tokens=max_tokens,
        logprobs=logprobs,
        **fields,
    )


def _common(obj: Mapping[str, Any], limits: ServingLimits) -> dict[str, Any]:
    """The fields both endpoints share (everything but prompt, max_tokens, logprobs)."""
    if _bool(obj, "echo"):
        raise RequestError(400, "echo is not supported", "echo")
    top_k = _int(obj, "top_k", lo=-1)
    seed = _int(obj, "seed", lo=0, hi=_SEED_END - 1)
    stream = _bool(obj, "stream")
    options = obj.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError(400, "stream_options must be an object", "stream_options")
        if not stream:
            raise RequestError(
                400, "stream_options is only allowed when stream is true", "stream_options"
            )
        include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    top_p = _float(obj, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p must lie in (0, 1], got {top_p}", "top_p")
    n = _int(obj, "n", lo=1, hi=MAX_N)
    return {
        "temperature": _float(obj, "temperature", 1.0),
        "top_p": top_p,
        "top_k": -1 if top_k in (None, 0) else top_k,
        "seed": seed,
        "n": 1 if n is None else n,
        "stop": _stop(obj.get("stop")),
        "stop_token_ids": _stop_token_ids(obj.get("stop_token_ids"), limits),
        "stream": stream,
        "include_usage": include_usage,
        "ignore_eos": _bool(obj, "ignore_eos"),
        "min_tokens": _int(obj, "min_tokens", lo=0) or 0,
    }


def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(400, "body must be a JSON object", None)
    return body


def _model(obj: Mapping[str, Any], limits: ServingLimits) -> str:
    model = obj.get("model")
    if model is None:
        return limits.model_name
    if not isinstance(model, str):
        raise RequestError(400, "model must be a string", "model")
    if model != limits.model_name:
        raise RequestError(
            404,
            f"The model {model!r} does not exist; this server serves {limits.model_name!r}",
            "model",
            code="model_not_found",
        )
    return model


def _completion_prompt(value: Any, limits: ServingLimits) -> str | tuple[int, ...]:
    """The prompt text, or its token ids checked against the vocabulary."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if value is None:
        raise RequestError(400, "prompt is required", "prompt")
    if isinstance(value, (str, list)) and not value:
        raise RequestError(400, "prompt must not be empty", "prompt")
    if isinstance(value, str):
        return _utf8(value, "prompt")
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise RequestError(
            400,
            "prompt must be a string, a list of token ids, or a list of such prompts",
            "prompt",
        )
    return _in_vocabulary(value, limits, "prompt", "prompt token id")


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if value is None:
        raise RequestError(400, "messages is required", "messages")
    if not isinstance(value, list):
        raise RequestError(400, "messages must be a list", "messages")
    if not value:
        raise RequestError(400, "messages must not be empty", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(400, f"{where} must be an object", where)
        role = message.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise RequestError(
                400,
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                f"{where}.role",
            )
        out.append(ChatMessage(role, _content(message.get("content"), f"{where}.content")))
    return tuple(out)


def _utf8(value: str, param: str) -> str:
    """``value`` if it is valid Unicode text (JSON can carry lone surrogates, which no
    tokenizer or client can take)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, f"{param} is not valid Unicode text", param) from None
    return value


def _content(value: Any, where: str) -> str:
    """Message content: a string, or a non-empty list of text parts joined by newlines."""
    if isinstance(value, str):
        return _utf8(value, where)
    if not isinstance(value, list) or not value:
        raise RequestError(
            400, f"{where} must be a string or a non-empty list of text parts", where
        )
    texts = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(
                400,
                f"{at} must be a {{'type': 'text', 'text': ...}} part, got {kind!r}",
                f"{at}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(400, f"{at}.text must be a string", f"{at}.text")
        texts.append(_utf8(text, f"{at}.text"))
    return "\n".join(texts)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(400, "stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(400, f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    if not all(stops):
        raise RequestError(400, "stop strings must not be empty", "stop")
    return tuple(_utf8(s, "stop") for s in stops)


def _stop_token_ids(value: Any, limits: ServingLimits) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise RequestError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
    if len(value) > limits.vocab_size:
        raise RequestError(
            400, "stop_token_ids has more entries than the vocabulary", "stop_token_ids"
        )
    return _in_vocabulary(value, limits, "stop_token_ids", "stop_token_ids:")


def _in_vocabulary(
    ids: list[int], limits: ServingLimits, param: str, label: str
) -> tuple[int, ...]:
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError(
            400, f"{label} {bad} is outside the vocabulary [0, {limits.vocab_size})", param
        )
    return tuple(ids)


# -- scalar fields ----------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return type(value) is int  # not bool, which JSON true would otherwise pass for


def _int(obj: Mapping[str, Any], name: str, *, lo: int, hi: int | None = None) -> int | None:
    """An optional integer field in ``[lo, hi]``; None when absent or null."""
    value = obj.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise RequestError(400, f"{name} must be an integer, got {_json_type(value)}", name)
    if value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise RequestError(400, f"{name} must be {bounds}, got {value}", name)
    return value


def _float(obj: Mapping[str, Any], name: str, default: float) -> float:
    """An optional finite, non-negative number (int or float, not bool)."""
    value = obj.get(name)
    if value is None:
        return default
    if type(value) not in (int, float):
        raise RequestError(400, f"{name} must be a number, got {_json_type(value)}", name)
    try:
        value = float(value)
    except OverflowError:  # a JSON integer beyond float range
        raise RequestError(400, f"{name} must be a finite number >= 0", name) from None
    if not math.isfinite(value) or value < 0:
        raise RequestError(400, f"{name} must be a finite number >= 0, got {value}", name)
    return value


def _bool(obj: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    """An optional boolean field (false when absent or null)."""
    value = obj.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(
            400, f"{param or name} must be true or false, got {_json_type(value)}", param or name
        )
    return value


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return names.get(type(value), "object" if isinstance(value, dict) else type(value).__name__)
