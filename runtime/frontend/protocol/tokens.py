"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` bodies."""

from __future__ import annotations

from runtime.frontend.chat import ChatTemplate, ChatTemplateError
from runtime.frontend.protocol.build import served_model
from runtime.frontend.protocol.chat_completions import chat_messages
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.fields import bool_field, in_vocabulary, is_int, json_object, utf8
from runtime.frontend.protocol.image_prompt import expand_images
from runtime.frontend.protocol.images import IMAGE_PLACEHOLDER, ImagePart
from runtime.frontend.protocol.requests import Encoder, ServingLimits


def parse_tokenize(
    body: object, limits: ServingLimits, tokenizer: Encoder, template: ChatTemplate
) -> tuple[list[int], bool]:
    """A ``/tokenize`` body (vLLM's shapes) to its token ids and whether it asks for
    the token strings (``return_token_strs``).

    ``{"prompt": str, "add_special_tokens": bool = true}``, or ``{"messages": [...],
    "add_generation_prompt": bool = true, "add_special_tokens": bool}`` rendered with
    the chat template, whose ``add_special_tokens`` defaults to what the chat route
    uses (false for a model's template, which writes the BOS itself).  The prompt
    may be longer than the context: counting it is what the route is for.
    """
    obj = json_object(body)
    served_model(obj, limits)
    has_prompt, has_messages = obj.get("prompt") is not None, obj.get("messages") is not None
    if has_prompt == has_messages:
        raise RequestError(400, "give either prompt or messages", "prompt")
    strs = bool_field(obj, "return_token_strs")
    special = obj.get("add_special_tokens")
    if special is not None:
        special = bool_field(obj, "add_special_tokens")
    if has_prompt:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise RequestError(400, "prompt must be a string", "prompt")
        text = utf8(prompt, "prompt")
        return tokenizer.encode(text, add_special_tokens=special is not False), strs
    # Images: a text-only model refuses them; a vision model's count as their image
    # tokens (as in the chat route), without decoding them.
    vision = limits.image_tokens
    parts: list[ImagePart] | None = None if vision is None else []
    reserved = None if vision is None else IMAGE_PLACEHOLDER
    messages = chat_messages(obj["messages"], parts, limits.images, reserved=reserved)
    generation = obj.get("add_generation_prompt")
    generation = True if generation is None else bool_field(obj, "add_generation_prompt")
    try:
        text = template.render(messages, add_generation_prompt=generation)
    except ChatTemplateError as exc:
        raise RequestError(400, str(exc), "messages") from exc
    special = template.add_special_tokens if special is None else special
    if vision is not None:
        count = len(parts or ())
        return list(expand_images(text, count, vision, tokenizer, special)[0]), strs
    return tokenizer.encode(text, add_special_tokens=special), strs


def parse_detokenize(body: object, limits: ServingLimits) -> tuple[int, ...]:
    """A ``/detokenize`` body, ``{"tokens": [ids]}``: the ids, each in the vocabulary."""
    obj = json_object(body)
    served_model(obj, limits)
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise RequestError(400, "tokens must be a list of token ids", "tokens")
    return in_vocabulary(tokens, limits, "tokens", "token id")
