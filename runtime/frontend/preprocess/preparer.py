"""Preparing a request body: parse its JSON, check its sizes, validate it, render
its chat template and tokenize it (:class:`Preparer`), on the event loop or in the
worker pool (:func:`prepare_body`; see :mod:`runtime.frontend.preprocess`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from runtime.frontend.chat import ChatTemplate
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.preprocess.image_processor import ImageProcessorConfig
from runtime.frontend.preprocess.images import prepare_images
from runtime.frontend.preprocess.limits import (
    INLINE_BODY_BYTES,
    INLINE_COST,
    TOKENIZE_CONTEXTS,
    check_sizes,
    has_images,
    inline_cost,
    limit_error,
)
from runtime.frontend.preprocess.pool import PreprocessPool
from runtime.frontend.preprocess.wire import Body, body_bytes, body_size
from runtime.frontend.protocol.chat_completions import parse_chat
from runtime.frontend.protocol.completions import parse_completions
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.images import ImagePart, PreparedImage
from runtime.frontend.protocol.requests import GenerationRequest, ServingLimits
from runtime.frontend.protocol.tokens import parse_detokenize, parse_tokenize
from runtime.frontend.tokenizer import ModelTokenizer


class Preparer:
    """What preparing a body needs: the limits, tokenizer, chat template and defaults,
    and for a model that takes images its ``preprocessor_config.json``
    (``image_processor``; None for a text-only model, whose images are decoded and
    checked, then refused)."""

    def __init__(
        self,
        limits: ServingLimits,
        tokenizer: ModelTokenizer,
        template: ChatTemplate,
        defaults: GenerationDefaults,
        image_processor: ImageProcessorConfig | None = None,
    ) -> None:
        if limits.accepts_images and image_processor is None:
            raise ValueError("a model that accepts images needs its preprocessor_config.json")
        self.limits = limits
        self.tokenizer = tokenizer
        self.template = template
        self.defaults = defaults
        self.image_processor = image_processor
        self.max_token_chars = tokenizer.max_token_chars

    def images(self, parts: Sequence[ImagePart]) -> tuple[PreparedImage, ...]:
        """A chat request's image parts decoded, checked and preprocessed."""
        return prepare_images(parts, self.limits.images, self.image_processor)

    def run(self, route: str, body: object) -> list[GenerationRequest] | dict[str, Any]:
        """The requests of a generation route, or the response of /tokenize and
        /detokenize; RequestError for anything invalid or over a limit."""
        check_sizes(route, body, self.limits, self.max_token_chars)
        if route == "chat":
            return [
                parse_chat(
                    body, self.limits, self.tokenizer, self.template, self.defaults, self.images
                )
            ]
        if route == "completions":
            return parse_completions(body, self.limits, self.tokenizer, self.defaults)
        if route == "tokenize":
            return self._tokenize(body)
        if route == "detokenize":
            ids = parse_detokenize(body, self.limits)
            return {"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)}
        raise ValueError(f"no route {route!r}")

    def _tokenize(self, body: object) -> dict[str, Any]:
        ids, token_strs = parse_tokenize(body, self.limits, self.tokenizer, self.template)
        wide = TOKENIZE_CONTEXTS * self.limits.max_context
        if len(ids) > wide:
            given = isinstance(body, dict) and body.get("prompt") is not None
            param = "prompt" if given else "messages"
            raise limit_error(
                f"{param} encodes to {len(ids)} tokens; /tokenize counts at most {wide} "
                f"({TOKENIZE_CONTEXTS} x the model's maximum context of "
                f"{self.limits.max_context})",
                param,
            )
        strs = None
        if token_strs:
            strs = [self.tokenizer.backend.id_to_token(t) or "" for t in ids]
        return {
            "count": len(ids),
            "max_model_len": self.limits.max_context,
            "tokens": ids,
            "token_strs": strs,
        }


def parse_json(body: bytes) -> object:
    """The body's JSON; RequestError 400 when it is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise RequestError(400, f"body is not valid JSON: {str(exc)[:200]}", None) from None


def render_json(content: Any) -> bytes:
    """JSON as Starlette's JSONResponse renders it."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


async def prepare_body(
    preparer: Preparer, pool: PreprocessPool | None, route: str, body: Body
) -> list[GenerationRequest] | dict[str, Any] | bytes:
    """The prepared body (:meth:`Preparer.run`'s result, or a worker's JSON bytes for
    /tokenize and /detokenize), from inline or from the pool (module docstring);
    RequestError when it is invalid or over a limit.  ``body``: whole, or in the
    chunks it arrived in (a large one goes to a worker without being joined)."""
    size = body_size(body)
    if pool is not None and size > INLINE_BODY_BYTES:
        return await pool.prepare(route, body)
    data = body_bytes(body)
    if pool is None and size > INLINE_BODY_BYTES:  # no pool: a thread, as good as it gets
        return await asyncio.to_thread(_parse_and_run, preparer, route, data)
    obj = parse_json(data)
    images = has_images(route, obj)  # decoded off the event loop, whatever their size
    if pool is None:
        if images:
            return await asyncio.to_thread(preparer.run, route, obj)
        return preparer.run(route, obj)
    if images or inline_cost(route, obj, size) > INLINE_COST:
        return await pool.prepare(route, data)
    return preparer.run(route, obj)


def _parse_and_run(preparer: Preparer, route: str, data: bytes):
    return preparer.run(route, parse_json(data))
