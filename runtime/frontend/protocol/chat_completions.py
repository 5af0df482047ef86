"""``POST /v1/chat/completions`` bodies: the messages, rendered with the chat
template into the prompt, and each message's token endpoint (prefix-cache anchors)."""

from __future__ import annotations

import dataclasses
from typing import Any

from runtime.frontend.chat import (
    ROLES,
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    message_endpoints,
)
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.protocol.build import (
    build_request,
    check_choices,
    served_model,
    zero_or_more_tokens,
)
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.fields import bool_field, flag_field, int_field, json_object, utf8
from runtime.frontend.protocol.generation import generation_fields
from runtime.frontend.protocol.requests import Encoder, GenerationRequest, ServingLimits
from runtime.transport.sampling import MAX_LOGPROBS


def parse_chat(
    body: object,
    limits: ServingLimits,
    tokenizer: Encoder,
    template: ChatTemplate,
    defaults: GenerationDefaults | None = None,
) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and render its prompt with ``template``."""
    obj = json_object(body)
    model = served_model(obj, limits)
    messages = chat_messages(obj.get("messages"))
    defaults = defaults or GenerationDefaults()
    fields = generation_fields(obj, limits, defaults)
    check_choices(1, fields["n"], limits)
    max_completion = zero_or_more_tokens(obj, "max_completion_tokens", fields)
    max_plain = zero_or_more_tokens(obj, "max_tokens", fields)
    if max_completion is not None:
        max_tokens, max_param = max_completion, "max_completion_tokens"
    else:
        max_tokens, max_param = max_plain, "max_tokens"
    top_logprobs = int_field(obj, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    logprobs: int | None = None
    if bool_field(obj, "logprobs"):
        logprobs = top_logprobs or 0
    elif top_logprobs is not None:
        raise RequestError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    generation = flag_field(obj, "add_generation_prompt", True)
    special = flag_field(obj, "add_special_tokens", template.add_special_tokens)
    try:
        text = template.render(messages, add_generation_prompt=generation)
    except ChatTemplateError as exc:
        raise RequestError(400, str(exc), "messages") from exc
    ids = tuple(tokenizer.encode(text, add_special_tokens=special))
    request = build_request(
        model, ids, text, "messages", max_tokens, max_param, logprobs, fields, limits, defaults
    )
    if len(request.prompt_token_ids) < len(ids):
        return request  # truncated: the later turns' anchors would not be prefixes of it
    try:
        ends = message_endpoints(
            template, messages, ids, lambda t: tokenizer.encode(t, add_special_tokens=special)
        )
    except ChatTemplateError:  # a template that refuses a partial conversation: no anchors
        ends = ()
    return dataclasses.replace(request, message_endpoints=ends)


def chat_messages(value: Any) -> tuple[ChatMessage, ...]:
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


def _content(value: Any, where: str) -> str:
    """Message content: a string, or a non-empty list of text parts joined by newlines."""
    if isinstance(value, str):
        return utf8(value, where)
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
        texts.append(utf8(text, f"{at}.text"))
    return "\n".join(texts)
