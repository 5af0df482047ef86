"""Size limits on request bodies, checked before any tokenizing, and the cost that
decides whether a body is prepared inline (see :mod:`runtime.frontend.preprocess`).

Limits (:func:`check_sizes`; every refusal is a 400 naming the limit, the body's
own size a 413 in :mod:`runtime.frontend.server.body`):

- chat ``messages`` (also /tokenize's): at most ``MAX_MESSAGES``;
- a prompt's text: no longer than the context can hold (``max_context`` times the
  longest token's characters), as before;
- a prompt of token ids: at most ``max_context`` ids, counted before any id is
  looked at;
- /tokenize and /detokenize: ``TOKENIZE_CONTEXTS`` contexts' worth of text and
  tokens (/tokenize counts past the context, which is what it is for);
- a prompt with ``truncate_prompt_tokens`` (which keeps its last tokens) may be
  longer than the context: the body's size and the worker's time limit bound it.
"""

from __future__ import annotations

from typing import Any

from runtime.frontend.protocol.completions import MAX_PROMPTS
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import ServingLimits

ROUTES = ("completions", "chat", "tokenize", "detokenize")
INLINE_BODY_BYTES = 16 << 10  # bodies up to this size may be prepared on the event loop...
INLINE_COST = 32 << 10  # ...when the characters the tokenizer sees stay within this
MAX_MESSAGES = 4096  # chat messages of one request (Submit's message_endpoints bound)
TOKENIZE_CONTEXTS = 4  # /tokenize, /detokenize and truncated prompts: this many contexts


def limit_error(message: str, param: str | None, code: str | None = None) -> RequestError:
    return RequestError(400, message, param, code=code)


def _text_len(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


def _messages_chars(messages: Any) -> int:
    """Characters of a messages list's text (its string contents and text parts)."""
    total = 0
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(_text_len(p.get("text")) for p in content if isinstance(p, dict))
    return total


def _truncating(obj: dict) -> bool:
    """Whether the body asks to truncate its prompt (a bad value is refused later,
    naming the field, rather than as a context overflow)."""
    return obj.get("truncate_prompt_tokens") is not None


def check_sizes(route: str, body: object, limits: ServingLimits, max_token_chars: int) -> None:
    """RequestError (400, naming the limit) for a body bigger than the work it may
    cause: see the module docstring.  Cheap: it counts, it converts nothing."""
    if not isinstance(body, dict):
        return  # the parser refuses it, naming the body
    context = limits.max_context
    wide = TOKENIZE_CONTEXTS * context  # /tokenize, /detokenize, truncated prompts
    messages = body.get("messages")
    if (
        route in ("chat", "tokenize")
        and isinstance(messages, list)
        and len(messages) > MAX_MESSAGES
    ):
        raise limit_error(
            f"messages has {len(messages)} messages; this server takes at most "
            f"{MAX_MESSAGES} per request",
            "messages",
        )
    if route == "detokenize":
        tokens = body.get("tokens")
        if isinstance(tokens, list) and len(tokens) > wide:
            raise limit_error(
                f"tokens has {len(tokens)} token ids; /detokenize takes at most {wide} "
                f"({TOKENIZE_CONTEXTS} x the model's maximum context of {context} tokens)",
                "tokens",
            )
        return
    if route == "tokenize":
        chars = _text_len(body.get("prompt")) + _messages_chars(messages)
        if chars > wide * max_token_chars:
            param = "messages" if body.get("prompt") is None else "prompt"
            raise limit_error(
                f"{param} has {chars} characters, more than /tokenize's limit of {wide} "
                f"tokens ({TOKENIZE_CONTEXTS} x the model's maximum context of {context}) "
                f"can hold",
                param,
            )
        return
    # Generation: a prompt longer than the context cannot be served.  With
    # truncate_prompt_tokens it can (its last tokens are kept): only the body's size
    # and the worker's time limit bound it then.
    if _truncating(body):
        return
    what = f"the model's maximum context of {context} tokens"
    room = context
    if route == "chat":
        if _messages_chars(messages) > room * max_token_chars:
            raise limit_error(
                f"messages is longer than {what}", "messages", code="context_length_exceeded"
            )
        return
    prompt = body.get("prompt")
    batch = (  # as parse_completions tells a batch (all() stops at the first id)
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(p, (str, list)) for p in prompt)
        and not (len(prompt) == 1 and isinstance(prompt[0], str))
    )
    if batch and len(prompt) > MAX_PROMPTS:
        return  # refused by the parser, naming the batch limit
    prompts = prompt if batch else [prompt]
    for i, one in enumerate(prompts):
        param = f"prompt[{i}]" if batch else "prompt"
        if isinstance(one, str) and len(one) > room * max_token_chars:
            raise limit_error(
                f"{param} is longer than {what}", param, code="context_length_exceeded"
            )
        if isinstance(one, list) and len(one) > room:
            raise limit_error(
                f"{param} has {len(one)} token ids, more than {what}",
                param,
                code="context_length_exceeded",
            )


def has_images(route: str, body: object) -> bool:
    """Whether a chat body holds an ``image_url`` part: decoding one is never done
    on the event loop, whatever the body's size."""
    if route != "chat" or not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return False
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content
        ):
            return True
    return False


def inline_cost(route: str, body: object, size: int) -> int:
    """The characters the tokenizer would go through for this body, roughly: a chat
    request encodes its conversation once per message (its prefix-cache anchors)."""
    if route == "chat" and isinstance(body, dict) and isinstance(body.get("messages"), list):
        return size * (1 + len(body["messages"]))
    return size
