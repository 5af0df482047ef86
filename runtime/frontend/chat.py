"""Chat templates: a conversation to the prompt text the model was trained on.

``load_chat_template(model_dir, tokenizer, override)`` takes ``override`` when given
(``flare run --chat-template FILE``: the file's text, or, as vLLM allows, the template
itself when no such file exists and the text holds ``{``, ``}`` or a newline), else the
model's jinja template from ``chat_template.jinja`` (newer transformers exports) or the
``chat_template`` entry of ``tokenizer_config.json`` (a string, or a list of ``{"name",
"template"}`` of which the one named ``"default"`` is used). It is rendered as
transformers' ``apply_chat_template`` renders it: an ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, the
``raise_exception`` and ``strftime_now`` helpers, a ``tojson`` filter that does not
escape HTML, and the variables ``messages`` (a list of ``{"role", "content"}`` dicts),
``add_generation_prompt`` (true: the model answers next; ``/tokenize`` may ask for
false), ``bos_token``, ``eos_token`` and ``tools`` (None).
Such a template writes the BOS token itself, so its prompt is encoded without the
tokenizer's special tokens (``ChatTemplate.add_special_tokens`` is False).

When the model has no template, the fallback renders each message as
``<|{role}|>\\n{content}\\n`` and then ``<|assistant|>\\n``; for example a system and a
user message give::

    <|system|>
    You are terse.
    <|user|>
    Hi
    <|assistant|>

and that prompt is encoded with the tokenizer's special tokens (a BOS where the tokenizer
adds one).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.frontend.tokenizer import ModelTokenizer, read_model_json

__all__ = [
    "ROLES",
    "ChatMessage",
    "ChatTemplate",
    "ChatTemplateError",
    "load_chat_template",
    "message_endpoints",
]

log = logging.getLogger("runtime.frontend")

FALLBACK_DESCRIPTION = "<|{role}|>\\n{content}\\n per message, then <|assistant|>\\n"

Role = Literal["system", "user", "assistant"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``, e.g. roles that do not
    alternate) or failed while rendering it: the client's messages are at fault."""


# A content part as a template sees it: ("text", its text) or ("image", "").
ContentPart = tuple[Literal["text", "image"], str]


@dataclass(frozen=True)
class ChatMessage:
    """One message of a conversation: ``content``, list content joined into text
    (an image part as ``<image>``), and ``parts``, the parts as the client sent
    them (None for string content), for a template that renders parts itself."""

    role: Role
    content: str
    parts: tuple[ContentPart, ...] | None = None

    def template_content(self) -> list[dict[str, str]]:
        """The content as OpenAI-format templates take it (vLLM's "openai" content
        format): ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts."""
        if self.parts is None:
            return [{"type": "text", "text": self.content}]
        return [
            {"type": "image"} if kind == "image" else {"type": "text", "text": text}
            for kind, text in self.parts
        ]


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja chat template (``source``), or the fallback when ``source`` is None."""

    source: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        if self.source is not None:
            try:
                _compile(self.source)  # a broken template fails at startup, not per request
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat_template does not compile: {exc}") from exc

    @property
    def renders_parts(self) -> bool:
        """Whether the template loops over a message's content (vLLM's "openai"
        content format: it renders text and image parts itself, LLaVA's writing
        ``<image>``); otherwise it takes the content as one string."""
        return self.source is not None and _loops_over_content(self.source)

    @property
    def add_special_tokens(self) -> bool:
        """Whether the rendered prompt is encoded with the tokenizer's special tokens: only
        for the fallback, since a model's template writes ``bos_token`` itself."""
        return self.source is None

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages``, ending where the assistant's answer starts
        (without that start when not ``add_generation_prompt``: ``/tokenize`` asks)."""
        if self.source is None:
            turns = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages)
            return turns + ("<|assistant|>\n" if add_generation_prompt else "")
        parts = self.renders_parts
        try:
            return _compile(self.source).render(
                messages=[
                    {"role": m.role, "content": m.template_content() if parts else m.content}
                    for m in messages
                ],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=None,  # templates test `tools is not none`; undefined would pass that
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc


def message_endpoints(
    template: ChatTemplate,
    messages: Sequence[ChatMessage],
    prompt_ids: Sequence[int],
    encode: Callable[[str], Sequence[int]],
) -> tuple[int, ...]:
    """Each message's token endpoint in ``prompt_ids`` (the rendered conversation):
    the prompt tokens that hold the conversation through message i, one entry per
    message, non-decreasing.  These are the checkpoint anchors of issue 14: where a
    later turn that resends the conversation can resume.

    Message i's endpoint is found by rendering the conversation through it
    (without a generation prompt) and encoding that text: the endpoint is its
    longest common token prefix with ``prompt_ids``, since the tokenizer may merge
    across the boundary differently once more text follows.  A template that
    renders a shorter conversation as something other than a prefix of the whole
    (some move the system message) gives the common prefix too: an anchor is
    only ever a prefix of the prompt.  ``encode``: text to ids, with the special
    tokens the prompt was encoded with.
    """
    ids = list(prompt_ids)
    out: list[int] = []
    for i in range(len(messages)):
        prefix = encode(template.render(messages[: i + 1], add_generation_prompt=False))
        common = 0
        for a, b in zip(prefix, ids):
            if a != b:
                break
            common += 1
        out.append(max(common, out[-1] if out else 0))
    return tuple(out)


def load_chat_template(
    model_dir: str | Path, tokenizer: ModelTokenizer, override: str | None = None
) -> ChatTemplate:
    """The chat template as described in the module docstring, with the tokenizer's
    BOS/EOS strings; the fallback when neither ``override`` nor the directory has one.
    ValueError naming ``--chat-template`` for an override that is neither a readable
    file nor a template, or that does not compile."""
    if override is not None:
        return ChatTemplate(
            _override_source(override), tokenizer.bos_token or "", tokenizer.eos_token or ""
        )
    jinja_file = Path(model_dir) / "chat_template.jinja"
    if jinja_file.is_file():
        source: Any = jinja_file.read_text(encoding="utf-8")
    else:
        source = (read_model_json(model_dir, "tokenizer_config.json") or {}).get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(
                f"tokenizer_config.json: chat_template lists {sorted(map(str, named))}, "
                "none named 'default'"
            )
        source = named["default"]
    if source is not None and not isinstance(source, str):
        raise ValueError(f"tokenizer_config.json: chat_template must be a string, got {source!r}")
    if source is None:
        log.warning(
            "%s has no chat template (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json): /v1/chat/completions renders conversations with the "
            "fallback template (%s), which the model was not trained on; give the model's "
            "template with --chat-template FILE",
            model_dir,
            FALLBACK_DESCRIPTION,
        )
    return ChatTemplate(source, tokenizer.bos_token or "", tokenizer.eos_token or "")


def _override_source(override: str) -> str:
    """``--chat-template``'s text: the file it names, or the template it is."""
    try:
        with open(override, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        if not any(c in override for c in "{}\n"):
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"--chat-template {override}: cannot read it ({reason})") from None
        source = override  # a template given inline, as vLLM accepts
    try:
        _compile(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {override}: does not compile: {exc}") from None
    return source


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps``, without jinja's HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=8)
def _loops_over_content(source: str) -> bool:
    """A ``{% for ... in <x>['content'] %}`` (or ``<x>.content``, through filters
    such as ``selectattr``) anywhere in the template: vLLM's content-format test,
    without its check of what ``<x>`` is."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
            return True
        if (
            isinstance(node, jinja2.nodes.Getitem)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content"
        ):
            return True
    return False


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)
