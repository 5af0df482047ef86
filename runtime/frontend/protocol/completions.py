"""``POST /v1/completions`` bodies: one prompt or a batch of them, each a request."""

from __future__ import annotations

from typing import Any

from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.protocol.build import (
    build_request,
    check_choices,
    served_model,
    zero_or_more_tokens,
)
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.fields import (
    flag_field,
    in_vocabulary,
    int_field,
    is_int,
    json_object,
    utf8,
)
from runtime.frontend.protocol.generation import generation_fields
from runtime.frontend.protocol.requests import Encoder, GenerationRequest, ServingLimits
from runtime.transport.sampling import MAX_LOGPROBS

MAX_PROMPTS = 64  # prompts in one batched completions request


def parse_completion(
    body: object,
    limits: ServingLimits,
    tokenizer: Encoder,
    defaults: GenerationDefaults | None = None,
) -> GenerationRequest:
    """Validate a ``/v1/completions`` body; RequestError on any invalid field.
    ``defaults``: what fields the body leaves out take (flare's when None)."""
    obj = json_object(body)
    model = served_model(obj, limits)
    prompt = _completion_prompt(obj.get("prompt"), limits)
    defaults = defaults or GenerationDefaults()
    fields = generation_fields(obj, limits, defaults, echo=True)
    check_choices(1, fields["n"], limits)
    max_tokens = zero_or_more_tokens(obj, "max_tokens", fields)
    logprobs = int_field(obj, "logprobs", lo=0, hi=MAX_LOGPROBS)
    if isinstance(prompt, str):
        special = flag_field(obj, "add_special_tokens", True)
        text, ids = prompt, tuple(tokenizer.encode(prompt, add_special_tokens=special))
    else:
        text, ids = None, prompt
    return build_request(
        model, ids, text, "prompt", max_tokens, "max_tokens", logprobs, fields, limits, defaults
    )


def parse_completions(
    body: object,
    limits: ServingLimits,
    tokenizer: Encoder,
    defaults: GenerationDefaults | None = None,
) -> list[GenerationRequest]:
    """A ``/v1/completions`` body whose prompt may be a batch: a list of strings or a
    list of token-id lists (vLLM and OpenAI accept both).  One request per prompt,
    each checked like a single one; an error names ``prompt[i]``."""
    obj = json_object(body)
    prompts = obj.get("prompt")
    batched = (
        isinstance(prompts, list)
        and len(prompts) > 0
        and all(isinstance(p, (str, list)) for p in prompts)
        and not (len(prompts) == 1 and isinstance(prompts[0], str))
    )
    if not batched:
        return [parse_completion(obj, limits, tokenizer, defaults)]
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(
            400, f"prompt takes at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt"
        )
    n = 1 if obj.get("n") is None else obj.get("n")
    if is_int(n) and n >= 1:  # a bad n is refused below, naming n
        check_choices(len(prompts), n, limits)
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(parse_completion({**obj, "prompt": prompt}, limits, tokenizer, defaults))
        except RequestError as exc:
            param = f"prompt[{i}]" if exc.param == "prompt" else exc.param
            message = f"prompt[{i}]: {exc.message}" if exc.param == "prompt" else exc.message
            raise RequestError(exc.status, message, param, exc.type, code=exc.code) from None
    return out


def _completion_prompt(value: Any, limits: ServingLimits) -> str | tuple[int, ...]:
    """The prompt text, or its token ids checked against the vocabulary."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if value is None:
        raise RequestError(400, "prompt is required", "prompt")
    if isinstance(value, (str, list)) and not value:
        raise RequestError(400, "prompt must not be empty", "prompt")
    if isinstance(value, str):
        return utf8(value, "prompt")
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise RequestError(
            400,
            "prompt must be a string, a list of token ids, or a list of such prompts",
            "prompt",
        )
    return in_vocabulary(value, limits, "prompt", "prompt token id")
