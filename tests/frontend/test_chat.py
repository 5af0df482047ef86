"""Chat templates from a model directory, the fallback, and the tokenizer files they use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.frontend import chat as chat_module
from runtime.frontend.chat import ChatMessage, ChatTemplate, ChatTemplateError, load_chat_template
from runtime.frontend.protocol.chat_completions import parse_chat
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.tokenizer import ModelTokenizer, TokenizerError
from runtime.ranks.model import default_model_dir

# ChatML with the checks real templates make: a BOS, alternating roles, the date helper.
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.first %}"
    "{{ raise_exception('the conversation must not start with the assistant') }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there"))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model directory with the embedded default's tokenizer.json and config.json."""
    source = default_model_dir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(source / name, tmp_path / name)
    return tmp_path


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


def load(model_dir: Path) -> ChatTemplate:
    return load_chat_template(model_dir, ModelTokenizer.from_dir(model_dir))


# -- templates -------------------------------------------------------------------------------


def test_template_from_tokenizer_config_renders(model_dir):
    write_json(
        model_dir / "tokenizer_config.json",
        {"chat_template": CHATML, "bos_token": "<|bos|>", "eos_token": "<|eos|>"},
    )
    template = load(model_dir)
    assert template.render(MESSAGES) == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not template.add_special_tokens


def test_template_without_tokenizer_config_tokens_uses_config_ids(model_dir):
    write_json(
        model_dir / "tokenizer_config.json", {"chat_template": "{{ bos_token }}|{{ eos_token }}"}
    )
    assert load(model_dir).render(MESSAGES) == "<|bos|>|<|eos|>"


def test_trim_and_lstrip_blocks_like_transformers():
    source = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "[{{ m.content }}]\n"
        "    {% endif %}\n"
        "{% endfor %}"
    )
    assert ChatTemplate(source).render(MESSAGES) == "[Hi there]\n"


def test_list_of_templates_takes_default(model_dir):
    write_json(
        model_dir / "tokenizer_config.json",
        {
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ messages | length }} messages"},
            ]
        },
    )
    assert load(model_dir).render(MESSAGES) == "2 messages"
    write_json(
        model_dir / "tokenizer_config.json",
        {"chat_template": [{"name": "tool_use", "template": "TOOLS"}]},
    )
    with pytest.raises(ValueError, match="default"):
        load(model_dir)


def test_chat_template_jinja_file_wins(model_dir):
    write_json(model_dir / "tokenizer_config.json", {"chat_template": "from config"})
    (model_dir / "chat_template.jinja").write_text("from file", encoding="utf-8")
    assert load(model_dir).render(MESSAGES) == "from file"


def test_helpers_and_tojson_without_html_escaping():
    template = ChatTemplate(
        "{{ strftime_now('%Y') | length }} {{ messages[1] | tojson }}"
        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
        "/{{ m.role }}{% endfor %}"
        "{{ tools is none }}"
    )
    rendered = template.render([ChatMessage("user", "<b>日本</b>"), ChatMessage("assistant", "ok")])
    assert rendered == '4 {"role": "assistant", "content": "ok"}/assistantTrue'
    assert "<b>日本</b>" in ChatTemplate("{{ messages[0] | tojson }}").render(
        [ChatMessage("user", "<b>日本</b>")]
    )


def test_raise_exception_is_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match="must not start with the assistant"):
        ChatTemplate(CHATML).render([ChatMessage("assistant", "Hello")])


def test_sandbox_refuses_unsafe_access():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render(MESSAGES)


def test_broken_template_fails_at_load(model_dir):
    write_json(model_dir / "tokenizer_config.json", {"chat_template": "{% for m in messages %}"})
    with pytest.raises(ValueError, match="does not compile"):
        load(model_dir)


def test_fallback_renders_as_documented(model_dir):
    template = load(model_dir)  # no tokenizer_config.json, no chat_template.jinja
    assert template == ChatTemplate(None, "<|bos|>", "<|eos|>")
    expected = "<|system|>\nYou are terse.\n<|user|>\nHi\n<|assistant|>\n"
    rendered = template.render([ChatMessage("system", "You are terse."), ChatMessage("user", "Hi")])
    assert rendered == expected
    documented = "\n".join(line.strip() for line in chat_module.__doc__.splitlines())
    assert expected in documented + "\n"  # the docstring example is the real output
    assert template.add_special_tokens


def test_bos_is_written_once_through_parse_chat(model_dir):
    write_json(
        model_dir / "tokenizer_config.json",
        {"chat_template": CHATML, "bos_token": "<|bos|>", "add_bos_token": True},
    )
    tok = ModelTokenizer.from_dir(model_dir)
    limits = ServingLimits("m", 512, 256)
    req = parse_chat(
        {"messages": [{"role": "user", "content": "Hi"}]}, limits, tok, load(model_dir)
    )
    assert req.prompt_token_ids[0] == 509 and 509 not in req.prompt_token_ids[1:]
    assert req.prompt_token_ids == tuple(tok.encode(req.prompt, add_special_tokens=False))


@pytest.mark.parametrize("chatml", [True, False])
def test_each_messages_token_endpoint_is_sent_with_the_chat_request(model_dir, chatml):
    """The checkpoint anchors: the prompt tokens holding the conversation through each
    message, a prefix of the prompt that a later turn resending it shares."""
    if chatml:
        write_json(model_dir / "tokenizer_config.json", {"chat_template": CHATML})
    tok = ModelTokenizer.from_dir(model_dir)
    template = load(model_dir)
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A mutable sequence."},
        {"role": "user", "content": "And a tuple?"},
    ]
    limits = ServingLimits("m", 512, 4096)
    req = parse_chat({"messages": turns}, limits, tok, template)
    ends = req.message_endpoints
    ids = req.prompt_token_ids
    assert len(ends) == 4 and list(ends) == sorted(ends) and ends[-1] < len(ids)
    special = template.add_special_tokens
    for i, end in enumerate(ends):
        through = template.render(
            [ChatMessage(t["role"], t["content"]) for t in turns[: i + 1]],
            add_generation_prompt=False,
        )
        # The anchor's tokens decode to the conversation through message i, give or
        # take a token the tokenizer merges across the boundary.
        text = tok.decode(list(ids[:end]), skip_special_tokens=False)
        assert through.startswith(text) and len(through) - len(text) <= 4
        assert tok.encode(through, add_special_tokens=special)[:end] == list(ids[:end])
    # The next turn resends the conversation: its anchors extend these.
    more = [*turns, {"role": "assistant", "content": "Immutable."}]
    later = parse_chat({"messages": more}, limits, tok, template)
    assert later.message_endpoints[:4] == ends
    assert later.prompt_token_ids[: ends[-1]] == ids[: ends[-1]]


# -- the model directory's tokenizer files ----------------------------------------------------


def test_embedded_default_tokenizer_facts():
    tok = ModelTokenizer.from_dir(default_model_dir())
    assert (tok.add_bos_token, tok.bos_token_id, tok.bos_token) == (False, 509, "<|bos|>")
    assert (tok.eos_token, tok.eos_token_ids, tok.vocab_size) == ("<|eos|>", (510,), 512)
    ids = tok.encode("Hello world")
    assert ids and ids[0] != 509 and tok.decode(ids) == "Hello world"
    assert tok.decode([*ids, 510]) == "Hello world"
    assert tok.decode([*ids, 510], skip_special_tokens=False) == "Hello world<|eos|>"


def test_add_bos_token_adds_exactly_one_bos(model_dir):
    write_json(
        model_dir / "tokenizer_config.json",
        {"add_bos_token": True, "bos_token": {"content": "<|bos|>", "special": True}},
    )
    tok = ModelTokenizer.from_dir(model_dir)
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == [509, *plain]
    assert tok.encode("<|bos|>Hello") == [509, *plain]  # already there: not doubled
    assert 509 not in plain


def test_eos_ids_come_from_every_file(model_dir):
    write_json(model_dir / "generation_config.json", {"eos_token_id": [510, 7]})
    write_json(model_dir / "tokenizer_config.json", {"eos_token": "<|pad|>"})
    tok = ModelTokenizer.from_dir(model_dir)
    assert tok.eos_token_ids == (511, 510, 7)
    assert tok.eos_token == "<|pad|>"


@pytest.mark.parametrize(
    ("name", "data", "match"),
    [
        ("tokenizer_config.json", {"add_bos_token": "yes"}, "add_bos_token"),
        ("tokenizer_config.json", {"bos_token": 5}, "bos_token"),
        ("generation_config.json", {"eos_token_id": "2"}, "eos_token_id"),
        ("config.json", {"eos_token_id": [1, True]}, "eos_token_id"),
    ],
)
def test_malformed_tokenizer_files_name_the_field(model_dir, name, data, match):
    write_json(model_dir / name, data)
    with pytest.raises(TokenizerError, match=match):
        ModelTokenizer.from_dir(model_dir)


def test_missing_or_unreadable_files(model_dir):
    (model_dir / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        ModelTokenizer.from_dir(model_dir)
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found"):
        ModelTokenizer.from_dir(model_dir)
