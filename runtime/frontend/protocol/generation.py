"""The fields both generation endpoints share (everything but the prompt, max_tokens
and logprobs): sampling, stops, penalties, logit bias, streaming, the cache salt,
vLLM's output fields and prompt truncation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.fields import (
    bool_field,
    flag_field,
    float_field,
    in_vocabulary,
    int_field,
    is_int,
    json_type,
    utf8,
)
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.protocol.vllm import refuse_unsupported
from runtime.transport.api import MAX_SALT_CHARS
from runtime.transport.sampling import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    PENALTY_LIMIT,
)

MAX_N = 16
MAX_STOP = 16
_SEED_END = 2**63


def generation_fields(
    obj: Mapping[str, Any],
    limits: ServingLimits,
    defaults: GenerationDefaults,
    echo: bool = False,
) -> dict[str, Any]:
    """The fields both endpoints share (everything but prompt, max_tokens, logprobs).
    ``echo``: the endpoint takes ``echo`` (completions); elsewhere it is refused."""
    echoed = bool_field(obj, "echo")
    if echoed and not echo:
        raise RequestError(400, "echo is not supported on this endpoint", "echo")
    name = "prompt_logprobs"
    value = obj.get(name)
    if is_int(value) and value == -1:
        raise RequestError(
            400, f"{name}: -1 (the whole vocabulary) is not supported, at most {MAX_LOGPROBS}", name
        )
    prompt_logprobs = int_field(obj, name, lo=0, hi=MAX_LOGPROBS)
    top_k = int_field(obj, "top_k", lo=-1)
    seed = int_field(obj, "seed", lo=0, hi=_SEED_END - 1)
    stream = bool_field(obj, "stream")
    options = obj.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError(400, "stream_options must be an object", "stream_options")
        if not stream:
            raise RequestError(
                400, "stream_options is only allowed when stream is true", "stream_options"
            )
        include_usage = bool_field(options, "include_usage", "stream_options.include_usage")
        name = "stream_options.continuous_usage_stats"
        if bool_field(options, "continuous_usage_stats", name):
            raise RequestError(
                400, f"{name}: usage in every chunk is not supported (only at the end)", name
            )
    top_p = float_field(obj, "top_p", defaults.top_p)
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p must lie in (0, 1], got {top_p}", "top_p")
    n = int_field(obj, "n", lo=1, hi=MAX_N)
    n = 1 if n is None else n
    refuse_unsupported(obj, n)
    ignore_eos = bool_field(obj, "ignore_eos")
    stop_token_ids = _stop_token_ids(obj.get("stop_token_ids"), limits)
    if not ignore_eos:  # the model's EOS ids end a choice (generation_config.json's too)
        eos = tuple(t for t in defaults.eos_token_ids if 0 <= t < limits.vocab_size)
        stop_token_ids = tuple(dict.fromkeys(stop_token_ids + eos))
    if top_k is None:
        top_k = defaults.top_k
    presence, frequency = (
        _signed(obj, name, PENALTY_LIMIT) for name in ("presence_penalty", "frequency_penalty")
    )
    skip_special_tokens = flag_field(obj, "skip_special_tokens", True)
    name = "spaces_between_special_tokens"  # matters only when special tokens are shown
    if not flag_field(obj, name, True) and not skip_special_tokens:
        raise RequestError(
            400, f"{name}: false is not supported with skip_special_tokens false", name
        )
    return {
        "temperature": float_field(obj, "temperature", defaults.temperature),
        "top_p": top_p,
        "top_k": -1 if top_k == 0 else top_k,
        "seed": seed,
        "n": n,
        "stop": _stop(obj.get("stop")),
        "stop_token_ids": stop_token_ids,
        "stream": stream,
        "include_usage": include_usage,
        "ignore_eos": ignore_eos,
        "min_tokens": int_field(obj, "min_tokens", lo=0) or 0,
        "presence_penalty": presence,
        "frequency_penalty": frequency,
        "repetition_penalty": _repetition_penalty(obj, defaults.repetition_penalty),
        "logit_bias": _logit_bias(obj.get("logit_bias"), limits),
        "cache_salt": _cache_salt(obj.get("cache_salt")),
        "include_stop_str_in_output": bool_field(obj, "include_stop_str_in_output"),
        "skip_special_tokens": skip_special_tokens,
        "return_tokens_as_token_ids": bool_field(obj, "return_tokens_as_token_ids"),
        "truncate_prompt_tokens": _truncate_prompt_tokens(obj.get("truncate_prompt_tokens")),
        "echo": echoed,
        "prompt_logprobs": prompt_logprobs,
    }


def _truncate_prompt_tokens(value: Any) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: an int >= 1, or -1 (as many as fit); None absent."""
    name = "truncate_prompt_tokens"
    if value is None:
        return None
    if not is_int(value):
        raise RequestError(400, f"{name} must be an integer, got {json_type(value)}", name)
    if value < 1 and value != -1:
        raise RequestError(400, f"{name} must be >= 1, or -1 for as many as fit, got {value}", name)
    return value


def _cache_salt(value: Any) -> str:
    """vLLM's ``cache_salt``: a non-empty string of at most MAX_SALT_CHARS ("" absent)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RequestError(
            400, f"cache_salt must be a string, got {json_type(value)}", "cache_salt"
        )
    if not value:
        raise RequestError(400, "cache_salt must not be empty", "cache_salt")
    if len(value) > MAX_SALT_CHARS:
        raise RequestError(
            400,
            f"cache_salt takes at most {MAX_SALT_CHARS} characters, got {len(value)}",
            "cache_salt",
        )
    return utf8(value, "cache_salt")


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
    return tuple(utf8(s, "stop") for s in stops)


def _stop_token_ids(value: Any, limits: ServingLimits) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise RequestError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
    if len(value) > limits.vocab_size:
        raise RequestError(
            400, "stop_token_ids has more entries than the vocabulary", "stop_token_ids"
        )
    return in_vocabulary(value, limits, "stop_token_ids", "stop_token_ids:")


def _logit_bias(value: Any, limits: ServingLimits) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token-id strings to biases, as distinct (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError(
            400, "logit_bias must be an object mapping token ids to biases", "logit_bias"
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise RequestError(
            400,
            f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(value)}",
            "logit_bias",
        )
    vocab = limits.vocab_size
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise RequestError(400, f"logit_bias: key {key!r} is not a token id", "logit_bias")
        token = int(key) if len(key) <= 12 else vocab  # no int() of a 5000-digit key
        if token >= vocab:
            raise RequestError(
                400,
                f"logit_bias: token id {key[:20]} is outside the vocabulary [0, {vocab})",
                "logit_bias",
            )
        if token in out:
            raise RequestError(400, f"logit_bias: token id {token} is given twice", "logit_bias")
        if type(bias) not in (int, float):
            raise RequestError(
                400, f"logit_bias[{key!r}] must be a number, got {json_type(bias)}", "logit_bias"
            )
        try:
            number = float(bias)
        except OverflowError:
            number = math.inf
        if not -LOGIT_BIAS_LIMIT <= number <= LOGIT_BIAS_LIMIT:  # NaN fails too
            raise RequestError(
                400,
                f"logit_bias[{key!r}] must lie in [-{LOGIT_BIAS_LIMIT:g}, "
                f"{LOGIT_BIAS_LIMIT:g}], got {number:g}",
                "logit_bias",
            )
        out[token] = number
    return tuple(out.items())


def _signed(obj: Mapping[str, Any], name: str, limit: float) -> float:
    """An optional number in [-limit, limit] (0 when absent or null)."""
    value = obj.get(name)
    if value is None:
        return 0.0
    if type(value) not in (int, float):
        raise RequestError(400, f"{name} must be a number, got {json_type(value)}", name)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not -limit <= number <= limit:
        raise RequestError(400, f"{name} must lie in [-{limit:g}, {limit:g}], got {number:g}", name)
    return number


def _repetition_penalty(obj: Mapping[str, Any], default: float) -> float:
    """vLLM's repetition_penalty: a finite number > 0 (1 is off)."""
    value = obj.get("repetition_penalty")
    if value is None:
        return default
    name = "repetition_penalty"
    if type(value) not in (int, float):
        raise RequestError(400, f"{name} must be a number, got {json_type(value)}", name)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise RequestError(400, f"{name} must be a finite number > 0, got {number:g}", name)
    return number
