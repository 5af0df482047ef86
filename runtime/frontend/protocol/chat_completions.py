"""``POST /v1/chat/completions`` bodies: the messages, rendered with the chat
template into the prompt, and each message's token endpoint (prefix-cache anchors).

Content parts are ``text`` and ``image_url`` (:mod:`.images`); an image part leaves
``IMAGE_PLACEHOLDER`` in its message's text, and its decoding is ``parse_chat``'s
``images`` callable (the preprocessing worker's, :mod:`runtime.frontend.preprocess.images`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
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
from runtime.frontend.protocol.images import (
    IMAGE_PLACEHOLDER,
    ImageLimits,
    ImagePart,
    PreparedImage,
    image_part,
    not_accepted,
    too_many_images,
)
from runtime.frontend.protocol.requests import Encoder, GenerationRequest, ServingLimits
from runtime.transport.sampling import MAX_LOGPROBS

# Decodes and checks a request's image parts (None: the body may hold none).
ImageDecoder = Callable[[Sequence[ImagePart]], tuple[PreparedImage, ...]]


def parse_chat(
    body: object,
    limits: ServingLimits,
    tokenizer: Encoder,
    template: ChatTemplate,
    defaults: GenerationDefaults | None = None,
    images: ImageDecoder | None = None,
) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and render its prompt with ``template``;
    its image parts decoded by ``images`` (a 500 without one: such a body is the
    preprocessing worker's), then refused unless the served model takes images."""
    obj = json_object(body)
    model = served_model(obj, limits)
    parts: list[ImagePart] = []
    messages = chat_messages(obj.get("messages"), parts, limits.images)
    prepared = _decoded(parts, images, limits)
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
    if prepared:
        request = dataclasses.replace(request, images=prepared)
    if len(request.prompt_token_ids) < len(ids):
        return request  # truncated: the later turns' anchors would not be prefixes of it
    try:
        ends = message_endpoints(
            template, messages, ids, lambda t: tokenizer.encode(t, add_special_tokens=special)
        )
    except ChatTemplateError:  # a template that refuses a partial conversation: no anchors
        ends = ()
    return dataclasses.replace(request, message_endpoints=ends)


def _decoded(
    parts: list[ImagePart], images: ImageDecoder | None, limits: ServingLimits
) -> tuple[PreparedImage, ...]:
    if not parts:
        return ()
    if images is None:
        raise RequestError(500, "images reached a preparer that cannot decode them", None)
    prepared = images(parts)  # every hostile image is refused here, naming its part
    if not limits.accepts_images:
        raise not_accepted(parts[0].param)
    return prepared


def chat_messages(
    value: Any, images: list[ImagePart] | None = None, limits: ImageLimits | None = None
) -> tuple[ChatMessage, ...]:
    """The messages; their image parts (checked, not decoded) are appended to
    ``images`` (None: an image part is refused as the model's not accepting it)."""
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
        content = _content(message.get("content"), f"{where}.content", images, limits)
        out.append(ChatMessage(role, content))
    return tuple(out)


def _content(
    value: Any, where: str, images: list[ImagePart] | None, limits: ImageLimits | None
) -> str:
    """Message content: a string, or a non-empty list of text and image parts joined
    by newlines (an image part as IMAGE_PLACEHOLDER)."""
    if isinstance(value, str):
        return utf8(value, where)
    if not isinstance(value, list) or not value:
        raise RequestError(
            400, f"{where} must be a string or a non-empty list of content parts", where
        )
    texts = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "image_url" and isinstance(part, dict):
            texts.append(_image(part, at, images, limits))
            continue
        if kind != "text":
            raise RequestError(
                400,
                f"{at} must be a {{'type': 'text', 'text': ...}} or "
                f"{{'type': 'image_url', 'image_url': ...}} part, got {kind!r}",
                f"{at}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(400, f"{at}.text must be a string", f"{at}.text")
        texts.append(utf8(text, f"{at}.text"))
    return "\n".join(texts)


def _image(
    part: dict[str, Any], at: str, images: list[ImagePart] | None, limits: ImageLimits | None
) -> str:
    if images is None:  # a route that takes no images (a text-only model's /tokenize)
        raise not_accepted(at)
    limits = limits or ImageLimits()
    if len(images) >= limits.max_images_per_prompt:
        raise too_many_images(len(images) + 1, limits)
    images.append(image_part(part, at, limits))
    return IMAGE_PLACEHOLDER
