"""What a valid request becomes: the choices limit, the served model's name, and
:func:`build_request`, which applies the context checks and the max_tokens default."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.fields import int_field
from runtime.frontend.protocol.requests import GenerationRequest, ServingLimits


def build_request(
    model: str,
    ids: tuple[int, ...],
    text: str | None,
    prompt_param: str,
    max_tokens: int | None,
    max_param: str,
    logprobs: int | None,
    fields: dict[str, Any],
    limits: ServingLimits,
    defaults: GenerationDefaults,
) -> GenerationRequest:
    """Apply the context checks and the max_tokens default; assemble the request."""
    if not ids:
        raise RequestError(400, "the prompt encodes to no tokens", prompt_param)
    context = limits.max_context
    limit = f"This model's maximum context length is {context} tokens"
    if limits.kv_tokens is not None and limits.kv_tokens < context:
        context = limits.kv_tokens  # the KV cache, not the model, is the tighter limit
        limit = f"The KV cache holds {context} tokens for one request"
    truncate = fields["truncate_prompt_tokens"]
    if truncate is not None:
        if truncate == -1:  # as many as leave room for the output
            caps = [c for c in (limits.default_max_tokens, defaults.max_tokens) if c is not None]
            reserve = max_tokens if max_tokens is not None else min(caps, default=1)
            truncate = max(context - reserve, 1)
        elif truncate > context - (max_tokens or 0):
            also = f" less {max_param} {max_tokens}" if max_tokens is not None else ""
            raise RequestError(
                400,
                f"truncate_prompt_tokens {truncate} exceeds the context{also}: {limit}",
                "truncate_prompt_tokens",
            )
        if len(ids) > truncate:
            ids, text = ids[-truncate:], None  # the last tokens: the text is no longer theirs
    room = context - len(ids)
    if room < 1 and max_tokens != 0:  # (a scored prompt of no output needs no room)
        raise RequestError(
            400,
            f"{limit}; the prompt has {len(ids)} tokens, leaving no room to generate",
            prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        caps = (limits.default_max_tokens, defaults.max_tokens)
        max_tokens = min([room, *(cap for cap in caps if cap is not None)])
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


def zero_or_more_tokens(obj: Mapping[str, Any], name: str, fields: dict[str, Any]) -> int | None:
    """The output limit ``name``: >= 1, or 0 when the prompt is scored (``echo`` or
    ``prompt_logprobs``: the response is the prompt alone); None when absent."""
    value = int_field(obj, name, lo=0)
    if value == 0 and not (fields.get("echo") or fields.get("prompt_logprobs") is not None):
        raise RequestError(
            400, f"{name} must be >= 1 (0 only with echo or prompt_logprobs), got 0", name
        )
    return value


def check_choices(prompts: int, n: int, limits: ServingLimits) -> None:
    """Prompts x n within ``limits.max_choices``; the 400 names n (prompt when n is 1)."""
    if prompts * n > limits.max_choices:
        raise RequestError(
            400,
            f"{prompts} prompt(s) x n {n} = {prompts * n} choices exceed this server's limit "
            f"of {limits.max_choices} per request (--max-choices-per-request)",
            "prompt" if n == 1 else "n",
        )


def served_model(obj: Mapping[str, Any], limits: ServingLimits) -> str:
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
