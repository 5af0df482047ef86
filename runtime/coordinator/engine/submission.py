"""Checks of a submission against the model the ranks reported, and a request's
images as the engine keeps them (:class:`RequestImages`)."""

from __future__ import annotations

import operator
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.catalog import GraphKind
from runtime.coordinator.engine.startup import ModelFacts
from runtime.image_spans import ImageSpan
from runtime.transport.fields import ProtocolError
from runtime.transport.images import SubmitImage
from runtime.transport.images import check_images as check_image_wire
from runtime.transport.sampling import MAX_LOGPROBS, SamplingParams


def check_prompt(prompt_token_ids: Sequence[int], facts: ModelFacts) -> tuple[int, ...]:
    """The prompt as a tuple of ints; ValueError naming ``prompt_token_ids`` otherwise."""
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
        raise ValueError(
            "prompt_token_ids must be a sequence of token ids, "
            f"got {type(prompt_token_ids).__name__}"
        )
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids must not be empty")
    tokens = []
    vocab = facts.vocab_size
    for i, token in enumerate(prompt_token_ids):
        try:
            if isinstance(token, bool):
                raise TypeError
            value = operator.index(token)
        except TypeError:
            raise ValueError(
                f"prompt_token_ids[{i}] must be an integer token id, got {token!r}"
            ) from None
        if not 0 <= value < vocab:
            raise ValueError(
                f"prompt_token_ids[{i}] = {value} is outside the vocabulary [0, {vocab})"
            )
        tokens.append(value)
    return tuple(tokens)


def check_submission(
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    sampling: SamplingParams | None,
    ignore_eos: bool,
    facts: ModelFacts,
    prompt_logprobs: int = -1,
) -> tuple[tuple[int, ...], SamplingParams]:
    """The checked prompt and sampling; ValueError naming the argument otherwise.
    ``prompt_logprobs`` >= 0 (score the prompt) needs scored prefill programs and
    allows ``max_tokens`` 0."""
    prompt = check_prompt(prompt_token_ids, facts)
    if (
        isinstance(prompt_logprobs, bool)
        or not isinstance(prompt_logprobs, int)
        or not -1 <= prompt_logprobs <= MAX_LOGPROBS
    ):
        raise ValueError(
            f"prompt_logprobs must be in [-1, {MAX_LOGPROBS}], got {prompt_logprobs!r}"
        )
    scored = prompt_logprobs >= 0
    if scored and not any(d.kind is GraphKind.SCORED_PREFILL for d in facts.descriptors):
        raise ValueError(
            "prompt_logprobs: the deployment captured no scored prefill programs "
            "(it runs with --no-scored-prefill)"
        )
    least = 0 if scored else 1
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < least:
        kind = "a non-negative" if scored else "a positive"
        raise ValueError(f"max_tokens must be {kind} integer, got {max_tokens!r}")
    total = len(prompt) + max_tokens
    if total > facts.max_context:
        raise ValueError(
            f"prompt_token_ids ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {total} "
            f"exceeds the model's max_context {facts.max_context}"
        )
    pages = -(-total // facts.page_size)
    if pages > facts.num_pages:
        raise ValueError(
            f"prompt_token_ids + max_tokens need {pages} KV pages of {facts.page_size} "
            f"tokens, the ranks hold {facts.num_pages}"
        )
    if sampling is None:  # greedy, with a fresh seed should a caller re-sample later
        sampling = SamplingParams(seed=secrets.randbits(62))
    elif not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a bool, got {ignore_eos!r}")
    for i, (token, _) in enumerate(sampling.logit_bias):
        if token >= facts.vocab_size:
            raise ValueError(
                f"logit_bias[{i}] token id {token} is outside the vocabulary "
                f"[0, {facts.vocab_size})"
            )
    return prompt, sampling


@dataclass(frozen=True)
class RequestImages:
    """A request's images, kept with the engine's record of it (its stream) from
    submission to retirement: the spans the scheduler plans with
    (``RequestSpec.images``) and each image's pixels (``SubmitImage.pixels``,
    ``shape``, float32), which the vision frames send to the ranks."""

    images: tuple[SubmitImage, ...]

    @property
    def spans(self) -> tuple[ImageSpan, ...]:
        return tuple(image.span for image in self.images)

    def pixels(self, index: int) -> tuple[bytes, tuple[int, ...]]:
        """Image ``index``'s float32 pixels (C order) and shape."""
        image = self.images[index]
        return image.pixels, image.shape


def check_images(
    images: Sequence[SubmitImage], prompt: tuple[int, ...], facts: ModelFacts
) -> RequestImages | None:
    """A submission's images (None without any), checked against its prompt (spans
    in order, disjoint, inside it, over one repeated image token; digests
    recomputed) and the deployment: it must have vision programs.  A ValueError
    naming ``images`` otherwise: never run without its images."""
    if isinstance(images, (str, bytes)) or not hasattr(images, "__len__"):
        raise ValueError(f"images must be a sequence of SubmitImage, got {type(images).__name__}")
    if len(images) == 0:
        return None
    try:
        checked = check_image_wire(tuple(images), prompt)
    except ProtocolError as exc:  # "images[1].start: ..."
        raise ValueError(str(exc)) from None
    if not any(d.kind is GraphKind.VISION for d in facts.descriptors):
        raise ValueError(
            "images: the deployment has no vision programs (the served model "
            f"{facts.model_name!r} does not take images)"
        )
    return RequestImages(checked)


def spec_images(images: RequestImages | None) -> dict[str, Any]:
    """``RequestSpec``'s keyword for a request's image spans ({} without images)."""
    return {} if images is None else {"images": images.spans}
