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
    ContentPart,
    message_endpoints,
)
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.preprocess.image_tokens import ImageTokens
from runtime.frontend.protocol.build import (
    build_request,
    check_choices,
    served_model,
    zero_or_more_tokens,
)
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.fields import bool_field, flag_field, int_field, json_object, utf8
from runtime.frontend.protocol.generation import generation_fields
from runtime.frontend.protocol.image_prompt import check_hand_off, expand_images, image_spans
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
    vision = limits.image_tokens
    reserved = IMAGE_PLACEHOLDER if vision is not None else None
    messages = chat_messages(obj.get("messages"), parts, limits.images, reserved=reserved)
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

    ids, starts = _encode(text, len(parts), vision, tokenizer, special)
    request = build_request(
        model, ids, text, "messages", max_tokens, max_param, logprobs, fields, limits, defaults
    )
    if prepared:
        assert vision is not None  # _decoded refused images for a text-only model
        dropped = len(ids) - len(request.prompt_token_ids)
        spans = image_spans(starts, prepared, vision, dropped)
        check_hand_off(prepared, len(request.prompt_token_ids))
        request = dataclasses.replace(request, images=prepared, image_spans=spans)
    if len(request.prompt_token_ids) < len(ids):
        return request  # truncated: the later turns' anchors would not be prefixes of it
    try:
        ends = message_endpoints(
            template, messages, ids, lambda t: _encode(t, None, vision, tokenizer, special)[0]
        )
    except ChatTemplateError:  # a template that refuses a partial conversation: no anchors
        ends = ()
    return dataclasses.replace(request, message_endpoints=ends)


def _encode(
    text: str, count: int | None, vision: ImageTokens | None, tokenizer: Encoder, special: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prompt's ids and each image's first position (a vision model's images
    expanded into its image tokens: :func:`expand_images`)."""
    if vision is None:
        return tuple(tokenizer.encode(text, add_special_tokens=special)), ()
    return expand_images(text, count, vision, tokenizer, special)


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
    value: Any,
    images: list[ImagePart] | None = None,
    limits: ImageLimits | None = None,
    *,
    reserved: str | None = None,
) -> tuple[ChatMessage, ...]:
    """The messages; their image parts (checked, not decoded) are appended to
    ``images`` (None: an image part is refused as the model's not accepting it).
    ``reserved``: the served vision model's image placeholder, refused in text (a
    400 naming the text): an image goes where its image_url part is, never where a
    client typed the placeholder."""
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
        raw, at = message.get("content"), f"{where}.content"
        if isinstance(raw, str):
            out.append(ChatMessage(role, _typed_placeholder(utf8(raw, at), at, reserved)))
            continue
        parts = _parts(raw, at, images, limits, reserved)
        content = "\n".join(IMAGE_PLACEHOLDER if k == "image" else t for k, t in parts)
        out.append(ChatMessage(role, content, parts))
    return tuple(out)


def _parts(
    value: Any,
    where: str,
    images: list[ImagePart] | None,
    limits: ImageLimits | None,
    reserved: str | None,
) -> tuple[ContentPart, ...]:
    """List content: a non-empty list of text and image parts (joined by newlines,
    an image part as IMAGE_PLACEHOLDER, by :func:`chat_messages`)."""
    if not isinstance(value, list) or not value:
        raise RequestError(
            400, f"{where} must be a string or a non-empty list of content parts", where
        )
    out: list[ContentPart] = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "image_url" and isinstance(part, dict):
            _image(part, at, images, limits)
            out.append(("image", ""))
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
        out.append(("text", _typed_placeholder(utf8(text, f"{at}.text"), f"{at}.text", reserved)))
    return tuple(out)


def _typed_placeholder(text: str, where: str, reserved: str | None) -> str:
    if reserved is not None and reserved in text:
        raise RequestError(
            400,
            f"{where} contains {reserved!r}, the served model's image placeholder: send "
            "each image as an image_url part, which places it (typed, it would be an "
            "image without pixels)",
            where,
        )
    return text


def _image(
    part: dict[str, Any], at: str, images: list[ImagePart] | None, limits: ImageLimits | None
) -> None:
    if images is None:  # a route that takes no images (a text-only model's /tokenize)
        raise not_accepted(at)
    limits = limits or ImageLimits()
    if len(images) >= limits.max_images_per_prompt:
        raise too_many_images(len(images) + 1, limits)
    images.append(image_part(part, at, limits))
