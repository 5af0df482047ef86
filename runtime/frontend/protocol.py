"""Validation of ``POST /v1/completions`` and ``POST /v1/chat/completions`` bodies.

``parse_completion(body, limits, tokenizer)`` and ``parse_chat(body, limits, tokenizer,
template)`` turn a decoded JSON body into a frozen ``GenerationRequest`` (prompt token
ids plus everything the engine and the response writer need), or raise ``RequestError``
with the HTTP status and the OpenAI error body (``to_json()``), naming the bad field in
``param``. Plain code rather than pydantic: each check names its field exactly, and
booleans are never taken for integers.

Accepted fields (null means "not given"; unknown fields are ignored, as OpenAI does):

- ``model``: the served model's name (default); another name is a 404
  ``model_not_found`` naming ``model``.
- completions ``prompt``: a non-empty string, a list of one string, or a non-empty list
  of token ids in ``[0, vocab_size)``. Text is encoded with the tokenizer's special
  tokens (a BOS where the tokenizer adds one). ``parse_completions`` also takes a
  batch: a list of such prompts (strings or token-id lists), one request each.
- chat ``messages``: a non-empty list of ``{"role": "system"|"user"|"assistant",
  "content": str | [{"type": "text", "text": str}, ...]}``; text parts are joined with
  "\\n" (as vLLM does). The prompt is the chat template's rendering.
- ``max_tokens`` (chat also ``max_completion_tokens``, which wins): an int >= 1. Default:
  the rest of the context, capped by ``ServingLimits.default_max_tokens`` when set.
- ``temperature`` (finite, >= 0, default 1.0; 0 is greedy), ``top_p`` (0 < p <= 1),
  ``top_k`` (int >= -1; 0 and -1 disable it and are returned as -1), ``seed`` (0 <= seed
  < 2**63, or null for a random one), ``n`` (1..16).
- ``stop``: a non-empty string or a list of at most 16; ``stop_token_ids``: ids in
  ``[0, vocab_size)``.
- completions ``logprobs``: int 0..20, the number of top alternatives per token; chat
  ``logprobs: bool`` with ``top_logprobs`` 0..20 (which needs ``logprobs: true``). Both
  end up as ``GenerationRequest.logprobs`` (None: no logprobs).
- ``cache_salt`` (vLLM): a non-empty string of at most 256 characters; requests share
  prefix-cache pages only with requests of an equal salt (null or absent: no salt).
  With several API keys the server adds each key's own salt (``runtime.frontend.server``).
- ``stream``, ``stream_options.include_usage`` (stream_options only with stream: true),
  ``ignore_eos`` (vLLM), ``min_tokens`` (0..max_tokens, vLLM); ``echo: true`` is refused.
- vLLM's output fields: ``include_stop_str_in_output`` (bool, default false: the stop
  string that ends a choice is part of its text), ``skip_special_tokens`` (bool, default
  true: special tokens are left out of the text; ``spaces_between_special_tokens: false``
  is refused with it false), ``return_tokens_as_token_ids`` (bool: logprobs name tokens
  ``"token_id:{id}"``).
- ``truncate_prompt_tokens`` (vLLM): k >= 1 keeps only the prompt's last k tokens (chat:
  of the rendered prompt); -1 keeps as many as leave room for max_tokens (for one token
  when max_tokens is not given, or the default max_tokens cap when there is one). k over
  the context less an explicit max_tokens is a 400 naming it. Each prompt of a batch is
  truncated on its own; ``prompt`` is then None (the ids are no longer its text's).
- ``add_special_tokens`` (vLLM): completions default true (the tokenizer's special
  tokens, a BOS where it adds one); chat default the template's (false for a model's
  template, which writes the BOS itself). Chat ``add_generation_prompt`` (default true).
- ``logit_bias``: an object of at most 300 token-id strings (ids in ``[0, vocab_size)``)
  to biases in [-100, 100]; ``presence_penalty`` and ``frequency_penalty`` in [-2, 2];
  ``repetition_penalty`` > 0 (vLLM; 1 is off). They reach the ranks in
  ``SamplingParams``.
- Fields the runtime does not implement are a 400 naming the field, never ignored:
  ``best_of`` > n, ``suffix``, ``use_beam_search: true``, guided decoding
  (``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
  ``structured_outputs``), ``response_format`` other than ``{"type": "text"}``,
  non-empty ``tools`` or ``functions``, a ``tool_choice`` / ``function_call`` that asks
  for a call, ``min_p`` other than 0. Their no-op forms pass: ``best_of`` <= n,
  ``suffix: ""``, ``use_beam_search: false``, ``response_format: {"type": "text"}``,
  ``tools: []``, ``tool_choice: "none"`` (or ``"auto"``, which with no tools calls none).
  Likewise vLLM's ``prompt_logprobs`` (any value: prompts are not scored yet),
  ``structural_tag``, ``allowed_token_ids``, ``bad_words`` (``[]`` passes),
  ``prompt_embeds``, ``logits_processors`` (``[]``), ``vllm_xargs`` (``{}``),
  ``kv_transfer_params`` (``{}``), ``priority`` (0), ``return_token_ids`` (false),
  ``stream_options.continuous_usage_stats`` (false), the repetition-pattern stop
  (``max_repetition_pattern_size``, ``min_repetition_pattern_size``,
  ``repetition_min_count``: 0) and the chat template's inputs ``chat_template``,
  ``chat_template_kwargs`` (``{}``), ``documents``, ``reasoning_effort`` and
  ``continue_final_message`` (false). ``docs/serving.md`` ("vLLM request fields") lists
  every field of vLLM's two request models and what flare does with it.

Defaults: a field the request leaves out takes the model's ``generation_config.json``
value (``GenerationDefaults``, see ``runtime.frontend.defaults``), else flare's. The
model's EOS ids are stop token ids unless ``ignore_eos``.

Choices: prompts x n may not exceed ``ServingLimits.max_choices`` (a 400 naming ``n``,
or ``prompt`` when n is 1).

Context: a prompt that leaves no room for one output token (``len(prompt) >=
max_context``) is an error naming ``prompt`` (``messages`` for chat); prompt plus an
explicit ``max_tokens`` over ``max_context`` is an error naming the max-tokens field.
Both carry the code ``context_length_exceeded``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.frontend.chat import (
    ROLES,
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    message_endpoints,
)
from runtime.frontend.defaults import GenerationDefaults
from runtime.transport.api import MAX_SALT_CHARS
from runtime.transport.sampling import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, PENALTY_LIMIT

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP",
    "Encoder",
    "GenerationDefaults",
    "GenerationRequest",
    "RequestError",
    "ServingLimits",
    "parse_chat",
    "parse_completion",
    "parse_completions",
    "parse_detokenize",
    "parse_tokenize",
]

MAX_N = 16
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_STOP = 16
MAX_LOGPROBS = 20
MAX_CHOICES = 1024  # prompts x n of one request, unless the server says otherwise
_SEED_END = 2**63
# Guided decoding: vLLM's request fields (and the newer structured_outputs object).
GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structural_tag",
    "structured_outputs",
)

# vLLM fields flare does not implement: (field, the values that ask for nothing, why).
# Any other value is a 400 naming the field (``_unsupported``).
REFUSED_FIELDS: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("prompt_logprobs", (), "flare does not score prompts yet (no prompt logprobs)"),
    ("allowed_token_ids", (), "sampling from a list of allowed tokens is not implemented"),
    ("bad_words", ([],), "banning words is not implemented"),
    ("prompt_embeds", (), "prompts are text or token ids, not embeddings"),
    ("logits_processors", ([],), "custom logits processors are not implemented"),
    ("vllm_xargs", ({},), "extension arguments are not implemented"),
    ("kv_transfer_params", ({},), "disaggregated serving (KV transfer) is not implemented"),
    ("priority", (0,), "requests are not scheduled by priority (only priority 0)"),
    ("return_token_ids", (False,), "responses do not carry token ids"),
    ("max_repetition_pattern_size", (0,), "the repetition-pattern stop is not implemented"),
    ("min_repetition_pattern_size", (0,), "the repetition-pattern stop is not implemented"),
    ("repetition_min_count", (0,), "the repetition-pattern stop is not implemented"),
    ("chat_template", (), "the chat template is the server's (flare run --chat-template)"),
    ("chat_template_kwargs", ({},), "the chat template takes no request arguments"),
    ("documents", (), "the chat template is not given documents"),
    ("reasoning_effort", (), "the chat template is not given a reasoning effort"),
    ("continue_final_message", (False,), "the final message cannot be continued"),
)


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None,
        type: str = "invalid_request_error",
        *,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def to_json(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class ServingLimits:
    """What the server serves: checked against every request.

    ``default_max_tokens``: the max_tokens of a request that gives none, capped by the
    rest of the context; None means the rest of the context (OpenAI's legacy completions
    used 16).  ``max_choices``: prompts x n one request may ask for
    (``--max-choices-per-request``).
    """

    model_name: str
    vocab_size: int
    max_context: int
    default_max_tokens: int | None = None
    kv_tokens: int | None = None  # tokens the KV cache holds for one request (pages x size)
    max_choices: int = MAX_CHOICES

    def __post_init__(self) -> None:
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


class Encoder(Protocol):
    """What validation needs of a tokenizer (``ModelTokenizer`` is one)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...


def parse_completion(
    body: object,
    limits: ServingLimits,
    tokenizer: Encoder,
    defaults: GenerationDefaults | None = None,
) -> GenerationRequest:
    """Validate a ``/v1/completions`` body; RequestError on any invalid field.
    ``defaults``: what fields the body leaves out take (flare's when None)."""
    obj = _object(body)
    model = _model(obj, limits)
    prompt = _completion_prompt(obj.get("prompt"), limits)
    defaults = defaults or GenerationDefaults()
    fields = _common(obj, limits, defaults)
    _check_choices(1, fields["n"], limits)
    max_tokens = _int(obj, "max_tokens", lo=1)
    logprobs = _int(obj, "logprobs", lo=0, hi=MAX_LOGPROBS)
    if isinstance(prompt, str):
        special = _flag(obj, "add_special_tokens", True)
        text, ids = prompt, tuple(tokenizer.encode(prompt, add_special_tokens=special))
    else:
        text, ids = None, prompt
    return _build(
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
    obj = _object(body)
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
    if _is_int(n) and n >= 1:  # a bad n is refused below, naming n
        _check_choices(len(prompts), n, limits)
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(parse_completion({**obj, "prompt": prompt}, limits, tokenizer, defaults))
        except RequestError as exc:
            param = f"prompt[{i}]" if exc.param == "prompt" else exc.param
            message = f"prompt[{i}]: {exc.message}" if exc.param == "prompt" else exc.message
            raise RequestError(exc.status, message, param, exc.type, code=exc.code) from None
    return out


def parse_chat(
    body: object,
    limits: ServingLimits,
    tokenizer: Encoder,
    template: ChatTemplate,
    defaults: GenerationDefaults | None = None,
) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body and render its prompt with ``template``."""
    obj = _object(body)
    model = _model(obj, limits)
    messages = _messages(obj.get("messages"))
    defaults = defaults or GenerationDefaults()
    fields = _common(obj, limits, defaults)
    _check_choices(1, fields["n"], limits)
    max_completion = _int(obj, "max_completion_tokens", lo=1)
    max_plain = _int(obj, "max_tokens", lo=1)
    if max_completion is not None:
        max_tokens, max_param = max_completion, "max_completion_tokens"
    else:
        max_tokens, max_param = max_plain, "max_tokens"
    top_logprobs = _int(obj, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    logprobs: int | None = None
    if _bool(obj, "logprobs"):
        logprobs = top_logprobs or 0
    elif top_logprobs is not None:
        raise RequestError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    generation = _flag(obj, "add_generation_prompt", True)
    special = _flag(obj, "add_special_tokens", template.add_special_tokens)
    try:
        text = template.render(messages, add_generation_prompt=generation)
    except ChatTemplateError as exc:
        raise RequestError(400, str(exc), "messages") from exc
    ids = tuple(tokenizer.encode(text, add_special_tokens=special))
    request = _build(
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
    obj = _object(body)
    _model(obj, limits)
    has_prompt, has_messages = obj.get("prompt") is not None, obj.get("messages") is not None
    if has_prompt == has_messages:
        raise RequestError(400, "give either prompt or messages", "prompt")
    strs = _bool(obj, "return_token_strs")
    special = obj.get("add_special_tokens")
    if special is not None:
        special = _bool(obj, "add_special_tokens")
    if has_prompt:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise RequestError(400, "prompt must be a string", "prompt")
        text = _utf8(prompt, "prompt")
        return tokenizer.encode(text, add_special_tokens=special is not False), strs
    messages = _messages(obj["messages"])
    generation = obj.get("add_generation_prompt")
    generation = True if generation is None else _bool(obj, "add_generation_prompt")
    try:
        text = template.render(messages, add_generation_prompt=generation)
    except ChatTemplateError as exc:
        raise RequestError(400, str(exc), "messages") from exc
    special = template.add_special_tokens if special is None else special
    return tokenizer.encode(text, add_special_tokens=special), strs


def parse_detokenize(body: object, limits: ServingLimits) -> tuple[int, ...]:
    """A ``/detokenize`` body, ``{"tokens": [ids]}``: the ids, each in the vocabulary."""
    obj = _object(body)
    _model(obj, limits)
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise RequestError(400, "tokens must be a list of token ids", "tokens")
    return _in_vocabulary(tokens, limits, "tokens", "token id")


# -- shared fields --------------------------------------------------------------------


def _build(
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
    if room < 1:
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


def _common(
    obj: Mapping[str, Any], limits: ServingLimits, defaults: GenerationDefaults
) -> dict[str, Any]:
    """The fields both endpoints share (everything but prompt, max_tokens, logprobs)."""
    if _bool(obj, "echo"):
        raise RequestError(400, "echo is not supported", "echo")
    top_k = _int(obj, "top_k", lo=-1)
    seed = _int(obj, "seed", lo=0, hi=_SEED_END - 1)
    stream = _bool(obj, "stream")
    options = obj.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError(400, "stream_options must be an object", "stream_options")
        if not stream:
            raise RequestError(
                400, "stream_options is only allowed when stream is true", "stream_options"
            )
        include_usage = _bool(options, "include_usage", "stream_options.include_usage")
        name = "stream_options.continuous_usage_stats"
        if _bool(options, "continuous_usage_stats", name):
            raise RequestError(
                400, f"{name}: usage in every chunk is not supported (only at the end)", name
            )
    top_p = _float(obj, "top_p", defaults.top_p)
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p must lie in (0, 1], got {top_p}", "top_p")
    n = _int(obj, "n", lo=1, hi=MAX_N)
    n = 1 if n is None else n
    _unsupported(obj, n)
    ignore_eos = _bool(obj, "ignore_eos")
    stop_token_ids = _stop_token_ids(obj.get("stop_token_ids"), limits)
    if not ignore_eos:  # the model's EOS ids end a choice (generation_config.json's too)
        eos = tuple(t for t in defaults.eos_token_ids if 0 <= t < limits.vocab_size)
        stop_token_ids = tuple(dict.fromkeys(stop_token_ids + eos))
    if top_k is None:
        top_k = defaults.top_k
    presence, frequency = (
        _signed(obj, name, PENALTY_LIMIT) for name in ("presence_penalty", "frequency_penalty")
    )
    skip_special_tokens = _flag(obj, "skip_special_tokens", True)
    name = "spaces_between_special_tokens"  # matters only when special tokens are shown
    if not _flag(obj, name, True) and not skip_special_tokens:
        raise RequestError(
            400, f"{name}: false is not supported with skip_special_tokens false", name
        )
    return {
        "temperature": _float(obj, "temperature", defaults.temperature),
        "top_p": top_p,
        "top_k": -1 if top_k == 0 else top_k,
        "seed": seed,
        "n": n,
        "stop": _stop(obj.get("stop")),
        "stop_token_ids": stop_token_ids,
        "stream": stream,
        "include_usage": include_usage,
        "ignore_eos": ignore_eos,
        "min_tokens": _int(obj, "min_tokens", lo=0) or 0,
        "presence_penalty": presence,
        "frequency_penalty": frequency,
        "repetition_penalty": _repetition_penalty(obj, defaults.repetition_penalty),
        "logit_bias": _logit_bias(obj.get("logit_bias"), limits),
        "cache_salt": _cache_salt(obj.get("cache_salt")),
        "include_stop_str_in_output": _bool(obj, "include_stop_str_in_output"),
        "skip_special_tokens": skip_special_tokens,
        "return_tokens_as_token_ids": _bool(obj, "return_tokens_as_token_ids"),
        "truncate_prompt_tokens": _truncate_prompt_tokens(obj.get("truncate_prompt_tokens")),
    }


def _truncate_prompt_tokens(value: Any) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: an int >= 1, or -1 (as many as fit); None absent."""
    name = "truncate_prompt_tokens"
    if value is None:
        return None
    if not _is_int(value):
        raise RequestError(400, f"{name} must be an integer, got {_json_type(value)}", name)
    if value < 1 and value != -1:
        raise RequestError(400, f"{name} must be >= 1, or -1 for as many as fit, got {value}", name)
    return value


def _cache_salt(value: Any) -> str:
    """vLLM's ``cache_salt``: a non-empty string of at most MAX_SALT_CHARS ("" absent)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RequestError(
            400, f"cache_salt must be a string, got {_json_type(value)}", "cache_salt"
        )
    if not value:
        raise RequestError(400, "cache_salt must not be empty", "cache_salt")
    if len(value) > MAX_SALT_CHARS:
        raise RequestError(
            400,
            f"cache_salt takes at most {MAX_SALT_CHARS} characters, got {len(value)}",
            "cache_salt",
        )
    return _utf8(value, "cache_salt")


def _unsupported(obj: Mapping[str, Any], n: int) -> None:
    """A 400 naming each field the runtime does not implement, unless it is a no-op."""

    def refuse(param: str, message: str) -> RequestError:
        return RequestError(400, message, param)

    best_of = _int(obj, "best_of", lo=1)
    if best_of is not None and best_of > n:
        raise refuse(
            "best_of",
            f"best_of > n is not supported (best_of {best_of}, n {n}): every sampled "
            "choice is returned, so ask for n choices instead",
        )
    suffix = obj.get("suffix")
    if suffix is not None and suffix != "":
        raise refuse("suffix", "suffix (insertion after the completion) is not supported")
    if _bool(obj, "use_beam_search"):
        raise refuse("use_beam_search", "use_beam_search: beam search is not supported")
    for name in GUIDED_FIELDS:
        if obj.get(name) is not None:
            raise refuse(name, f"{name}: guided decoding is not supported")
    fmt = obj.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if not isinstance(kind, str):
            raise refuse("response_format", 'response_format must be an object with a "type"')
        if kind != "text":
            raise refuse(
                "response_format",
                f'response_format type {kind!r} is not supported; only {{"type": "text"}}',
            )
    for name in ("tools", "functions"):
        value = obj.get(name)
        if value is None:
            continue
        if not isinstance(value, list):
            raise refuse(name, f"{name} must be a list")
        if value:
            raise refuse(name, f"{name}: tool calling is not supported (only {name}: [])")
    for name in ("tool_choice", "function_call"):
        value = obj.get(name)
        if value is not None and value not in ("none", "auto"):
            raise refuse(
                name,
                f'{name}: tool calling is not supported (only "none", or "auto" without tools)',
            )
    min_p = obj.get("min_p")
    if min_p is not None and not (type(min_p) in (int, float) and min_p == 0):
        raise refuse("min_p", "min_p sampling is not supported (only min_p: 0)")
    for name, no_ops, why in REFUSED_FIELDS:
        value = obj.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in no_ops):
            raise refuse(name, f"{name} is not supported: {why}")


def _check_choices(prompts: int, n: int, limits: ServingLimits) -> None:
    """Prompts x n within ``limits.max_choices``; the 400 names n (prompt when n is 1)."""
    if prompts * n > limits.max_choices:
        raise RequestError(
            400,
            f"{prompts} prompt(s) x n {n} = {prompts * n} choices exceed this server's limit "
            f"of {limits.max_choices} per request (--max-choices-per-request)",
            "prompt" if n == 1 else "n",
        )


def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(400, "body must be a JSON object", None)
    return body


def _model(obj: Mapping[str, Any], limits: ServingLimits) -> str:
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


def _completion_prompt(value: Any, limits: ServingLimits) -> str | tuple[int, ...]:
    """The prompt text, or its token ids checked against the vocabulary."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if value is None:
        raise RequestError(400, "prompt is required", "prompt")
    if isinstance(value, (str, list)) and not value:
        raise RequestError(400, "prompt must not be empty", "prompt")
    if isinstance(value, str):
        return _utf8(value, "prompt")
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise RequestError(
            400,
            "prompt must be a string, a list of token ids, or a list of such prompts",
            "prompt",
        )
    return _in_vocabulary(value, limits, "prompt", "prompt token id")


def _messages(value: Any) -> tuple[ChatMessage, ...]:
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


def _utf8(value: str, param: str) -> str:
    """``value`` if it is valid Unicode text (JSON can carry lone surrogates, which no
    tokenizer or client can take)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, f"{param} is not valid Unicode text", param) from None
    return value


def _content(value: Any, where: str) -> str:
    """Message content: a string, or a non-empty list of text parts joined by newlines."""
    if isinstance(value, str):
        return _utf8(value, where)
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
        texts.append(_utf8(text, f"{at}.text"))
    return "\n".join(texts)


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
    return tuple(_utf8(s, "stop") for s in stops)


def _stop_token_ids(value: Any, limits: ServingLimits) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise RequestError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
    if len(value) > limits.vocab_size:
        raise RequestError(
            400, "stop_token_ids has more entries than the vocabulary", "stop_token_ids"
        )
    return _in_vocabulary(value, limits, "stop_token_ids", "stop_token_ids:")


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
                400, f"logit_bias[{key!r}] must be a number, got {_json_type(bias)}", "logit_bias"
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
        raise RequestError(400, f"{name} must be a number, got {_json_type(value)}", name)
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
        raise RequestError(400, f"{name} must be a number, got {_json_type(value)}", name)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise RequestError(400, f"{name} must be a finite number > 0, got {number:g}", name)
    return number


def _in_vocabulary(
    ids: list[int], limits: ServingLimits, param: str, label: str
) -> tuple[int, ...]:
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError(
            400, f"{label} {bad} is outside the vocabulary [0, {limits.vocab_size})", param
        )
    return tuple(ids)


# -- scalar fields ----------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return type(value) is int  # not bool, which JSON true would otherwise pass for


def _int(obj: Mapping[str, Any], name: str, *, lo: int, hi: int | None = None) -> int | None:
    """An optional integer field in ``[lo, hi]``; None when absent or null."""
    value = obj.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise RequestError(400, f"{name} must be an integer, got {_json_type(value)}", name)
    if value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise RequestError(400, f"{name} must be {bounds}, got {value}", name)
    return value


def _float(obj: Mapping[str, Any], name: str, default: float) -> float:
    """An optional finite, non-negative number (int or float, not bool)."""
    value = obj.get(name)
    if value is None:
        return default
    if type(value) not in (int, float):
        raise RequestError(400, f"{name} must be a number, got {_json_type(value)}", name)
    try:
        value = float(value)
    except OverflowError:  # a JSON integer beyond float range
        raise RequestError(400, f"{name} must be a finite number >= 0", name) from None
    if not math.isfinite(value) or value < 0:
        raise RequestError(400, f"{name} must be a finite number >= 0, got {value}", name)
    return value


def _bool(obj: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    """An optional boolean field (false when absent or null)."""
    value = obj.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(
            400, f"{param or name} must be true or false, got {_json_type(value)}", param or name
        )
    return value


def _flag(obj: Mapping[str, Any], name: str, default: bool) -> bool:
    """An optional boolean field (``default`` when absent or null)."""
    return default if obj.get(name) is None else _bool(obj, name)


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return names.get(type(value), "object" if isinstance(value, dict) else type(value).__name__)
