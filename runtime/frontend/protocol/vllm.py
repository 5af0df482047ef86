"""The request fields flare does not implement (vLLM's and OpenAI's): a value that
asks for something is a 400 naming the field, never ignored; the no-op forms pass
(see :mod:`runtime.frontend.protocol` and ``docs/serving.md``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.fields import bool_field, int_field

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
# Any other value is a 400 naming the field (:func:`refuse_unsupported`).
REFUSED_FIELDS: tuple[tuple[str, tuple[Any, ...], str], ...] = (
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


def refuse_unsupported(obj: Mapping[str, Any], n: int) -> None:
    """A 400 naming each field the runtime does not implement, unless it is a no-op."""

    def refuse(param: str, message: str) -> RequestError:
        return RequestError(400, message, param)

    best_of = int_field(obj, "best_of", lo=1)
    if best_of is not None and best_of > n:
        raise refuse(
            "best_of",
            f"best_of > n is not supported (best_of {best_of}, n {n}): every sampled "
            "choice is returned, so ask for n choices instead",
        )
    suffix = obj.get("suffix")
    if suffix is not None and suffix != "":
        raise refuse("suffix", "suffix (insertion after the completion) is not supported")
    if bool_field(obj, "use_beam_search"):
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
