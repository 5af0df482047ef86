"""What a request is checked against (:class:`ServingLimits`), what a valid one
becomes (:class:`GenerationRequest`), and what validation needs of a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from runtime.frontend.preprocess.image_tokens import ImageTokens
from runtime.frontend.protocol.images import ImageLimits, PreparedImage
from runtime.image_spans import ImageSpan

MAX_CHOICES = 1024  # prompts x n of one request, unless the server says otherwise


@dataclass(frozen=True)
class ServingLimits:
    """What the server serves: checked against every request.

    ``default_max_tokens``: the max_tokens of a request that gives none, capped by the
    rest of the context; None means the rest of the context (OpenAI's legacy completions
    used 16).  ``max_choices``: prompts x n one request may ask for
    (``--max-choices-per-request``).  ``images``: what a chat request's images may be
    (the image flags); ``accepts_images``: whether the served model takes images
    (a LLaVA model; a text-only model's image that passes intake is then a 400),
    with ``image_tokens``: how its prompt holds an image (``config.json``), given
    exactly when it takes them.
    """

    model_name: str
    vocab_size: int
    max_context: int
    default_max_tokens: int | None = None
    kv_tokens: int | None = None  # tokens the KV cache holds for one request (pages x size)
    max_choices: int = MAX_CHOICES
    images: ImageLimits = field(default_factory=ImageLimits)
    accepts_images: bool = False
    image_tokens: ImageTokens | None = None

    def __post_init__(self) -> None:
        if self.accepts_images != (self.image_tokens is not None):
            raise ValueError("a model that accepts images has image_tokens, and only it")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        for name in ("vocab_size", "max_context", "max_choices"):
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    # Chat: each message's token endpoint in prompt_token_ids (chat.message_endpoints).
    message_endpoints: tuple[int, ...] = ()
    cache_salt: str = ""  # the request's own prefix-cache salt ("" none)
    # vLLM's output fields (see the module docstring).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    # What the request asked (None: no truncation); prompt_token_ids are already cut.
    truncate_prompt_tokens: int | None = None
    # Chat: the images, decoded and preprocessed, in the order of their parts (each
    # left IMAGE_PLACEHOLDER in its message's text): the vision model's input;
    # image_spans: where each one's image tokens are in prompt_token_ids (one span
    # per image, in order, its digest the image's image_hash).
    images: tuple[PreparedImage, ...] = ()
    image_spans: tuple[ImageSpan, ...] = ()
    # Scored prompts (docs/scored-prefill.md): completions' ``echo`` (the prompt's
    # text, and with logprobs its tokens' log probabilities, before the output)
    # and vLLM's ``prompt_logprobs`` (None: not asked; k: each prompt token's
    # log probability and its top k).
    echo: bool = False
    prompt_logprobs: int | None = None

    @property
    def scored_k(self) -> int:
        """The prompt's top-k to score (Submit.prompt_logprobs): -1 when the prompt
        is not scored; a request of no output is scored (k >= 0) so that it runs."""
        if self.prompt_logprobs is None and not (self.echo and self.logprobs is not None):
            return 0 if self.max_tokens == 0 else -1
        echoed = self.logprobs if self.echo and self.logprobs is not None else 0
        return max(self.prompt_logprobs or 0, echoed)


class Encoder(Protocol):
    """What validation needs of a tokenizer (``ModelTokenizer`` is one)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
