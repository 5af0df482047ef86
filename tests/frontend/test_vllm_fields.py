"""vLLM's request fields (issue 23): the ones flare implements change the output exactly
as vLLM's do, the ones it does not are a 400 naming them, and the ones that never change
the output are accepted.  ``docs/serving.md`` ("vLLM request fields") is the audit these
tables follow.  Against a scripted coordinator, and at the parsing level."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from runtime.frontend.chat import ChatTemplate, load_chat_template
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.detokenizer import IncrementalDetokenizer
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.protocol.chat_completions import parse_chat
from runtime.frontend.protocol.completions import parse_completion, parse_completions
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.server.app import create_app
from runtime.frontend.server.state import Frontend
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir
from runtime.transport.api import Output, TokenLogprobs
from tests.support.scripted_client import MODEL, ScriptedClient, script_for, sse

VOCAB = 512
USER = [{"role": "user", "content": "hi"}]
TEXT = "alpha beta gamma delta"
LIMITS = ServingLimits(MODEL, VOCAB, 64)
FALLBACK = ChatTemplate()


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def serve(client: ScriptedClient, tok: ModelTokenizer, max_context: int = 4096) -> TestClient:
    frontend = Frontend(
        client,
        tok,
        load_chat_template(default_model_dir(), tok),
        ServingLimits(MODEL, VOCAB, max_context),
        ServingMetrics(MODEL),
        None,
        GenerationDefaults(),
    )
    return TestClient(create_app(frontend))


def route(chat: bool) -> tuple[str, dict]:
    if chat:
        return "/v1/chat/completions", {"messages": USER}
    return "/v1/completions", {"prompt": "x"}


def post(tok, body: dict, *, chat: bool = False, script=None, max_context: int = 4096):
    """(the response, the scripted client) of one request producing TEXT by default."""
    client = ScriptedClient(script if script is not None else script_for(tok, TEXT))
    path, base = route(chat)
    with serve(client, tok, max_context) as http:
        return http.post(path, json={**base, "max_tokens": 50, **body}), client


def text_of(r, chat: bool) -> str:
    """The choice's text: the whole response's, or a stream's chunks joined."""
    if r.headers["content-type"].startswith("text/event-stream"):
        key = "delta" if chat else None
        chunks = [c["choices"][0] for c in sse(r) if c.get("choices")]
        return "".join((c[key].get("content") or "") if key else c["text"] for c in chunks)
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def refusal(call, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        call(*args, **kwargs)
    return info.value


# ------------------------------------------------------------------ include_stop_str_in_output


def test_include_stop_str_parses_as_a_bool(tok):
    parse = lambda **f: parse_completion({"prompt": "x", **f}, LIMITS, tok)  # noqa: E731
    assert parse().include_stop_str_in_output is False
    assert parse(include_stop_str_in_output=None).include_stop_str_in_output is False
    assert parse(include_stop_str_in_output=True).include_stop_str_in_output is True
    error = refusal(parse, include_stop_str_in_output="yes")
    assert (error.status, error.param) == (400, "include_stop_str_in_output")


def test_the_detokenizer_emits_through_the_stop_string_and_holds_nothing_back(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], ["gamma"], include_stop=True)
    shown = ""
    for i, token in enumerate(ids):
        delta = detok.push([token])
        shown += delta.text
        if delta.stopped:
            break
        assert shown == tok.decode(ids[: i + 1])  # no stop-string prefix held back
    assert shown == "alpha beta gamma"  # the stop string, split across pushes, included
    assert (delta.stopped, delta.stop_reason, detok.stop_reason) == (True, "gamma", "gamma")
    # Without it: the text before the stop string, "g", "ga"... held back meanwhile.
    detok = IncrementalDetokenizer(tok, [], ["gamma"])
    assert "".join(detok.push([t]).text for t in ids) == "alpha beta "


def test_include_stop_ends_at_the_first_stop_string_and_respects_min_tokens(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], ["delta", "beta"], include_stop=True)
    delta = detok.push(ids)  # one push: the earliest stop string wins
    assert (delta.text, delta.stop_reason) == ("alpha beta", "beta")
    assert delta.num_tokens == 6  # through "ta", the token completing "beta"
    # "beta" completes within the first min_tokens tokens: it does not stop; "delta" does.
    detok = IncrementalDetokenizer(tok, [], ["delta", "beta"], min_tokens=7, include_stop=True)
    text = "".join(detok.push([t]).text for t in ids)
    assert (text, detok.stop_reason) == ("alpha beta gamma delta", "delta")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_puts_the_stop_string_in_the_text(tok, chat, stream):
    body = {"stop": ["gamma"], "stream": stream}
    r, client = post(tok, {**body, "include_stop_str_in_output": True}, chat=chat)
    assert r.status_code == 200, r.text
    assert text_of(r, chat) == "alpha beta gamma"
    assert client.cancelled == client.submitted  # it still stopped there
    r, _ = post(tok, body, chat=chat)
    assert text_of(r, chat) == "alpha beta "


def test_include_stop_str_counts_the_tokens_through_the_stop_string(tok):
    r, _ = post(tok, {"stop": ["gamma"], "include_stop_str_in_output": True})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(tok.encode("alpha beta gamma"))


def test_include_stop_str_shows_a_stop_token_too(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop_id = ids[4]  # " be"
    body = {"stop_token_ids": [stop_id]}
    r, _ = post(tok, {**body, "include_stop_str_in_output": True})
    assert r.json()["choices"][0]["text"] == "alpha be"
    r, _ = post(tok, body)
    assert r.json()["choices"][0]["text"] == "alpha"


# ------------------------------------------------------------------ skip_special_tokens


def test_skip_special_tokens_false_shows_special_tokens(tok):
    alpha, beta = (tok.encode(t, add_special_tokens=False) for t in ("alpha", " beta"))
    ids = [*alpha, 511, *beta]  # 511: <|pad|>, a special token
    script = [Output(0, 10, tuple(ids), "length")]
    assert parse_completion({"prompt": "x"}, LIMITS, tok).skip_special_tokens is True
    r, _ = post(tok, {"skip_special_tokens": False}, script=script)
    assert r.json()["choices"][0]["text"] == "alpha<|pad|> beta"
    r, _ = post(tok, {"skip_special_tokens": True}, script=script)
    assert r.json()["choices"][0]["text"] == "alpha beta"
    error = refusal(parse_completion, {"prompt": "x", "skip_special_tokens": 0}, LIMITS, tok)
    assert error.param == "skip_special_tokens"


def test_spaces_between_special_tokens_false_is_refused_only_with_them_shown(tok):
    body = {"prompt": "x", "spaces_between_special_tokens": False}
    assert parse_completion(body, LIMITS, tok).skip_special_tokens is True  # no effect
    error = refusal(parse_completion, {**body, "skip_special_tokens": False}, LIMITS, tok)
    assert (error.status, error.param) == (400, "spaces_between_special_tokens")
    body["spaces_between_special_tokens"] = True
    assert parse_completion({**body, "skip_special_tokens": False}, LIMITS, tok)


def test_the_eos_shows_with_include_stop_and_special_tokens_kept(tok):
    ids = [*tok.encode("alpha", add_special_tokens=False), 510]  # <|eos|>
    script = [Output(0, 10, tuple(ids), "length")]
    body = {"stop_token_ids": [510], "include_stop_str_in_output": True}
    r, _ = post(tok, {**body, "skip_special_tokens": False}, script=script)
    assert r.json()["choices"][0]["text"] == "alpha<|eos|>"
    r, _ = post(tok, body, script=script)
    assert r.json()["choices"][0]["text"] == "alpha"


# ------------------------------------------------------------------ truncate_prompt_tokens


def test_truncate_prompt_tokens_keeps_the_last_k_prompt_tokens(tok):
    ids = list(range(1, 41))
    req = parse_completion({"prompt": ids, "truncate_prompt_tokens": 5}, LIMITS, tok)
    assert req.prompt_token_ids == (36, 37, 38, 39, 40)
    assert req.truncate_prompt_tokens == 5
    text_ids = tuple(tok.encode("Hello world"))
    req = parse_completion({"prompt": "Hello world", "truncate_prompt_tokens": 3}, LIMITS, tok)
    assert (req.prompt_token_ids, req.prompt) == (text_ids[-3:], None)
    # A prompt no longer than k is left alone, text and all.
    req = parse_completion({"prompt": "Hello world", "truncate_prompt_tokens": 8}, LIMITS, tok)
    assert (req.prompt_token_ids, req.prompt) == (text_ids, "Hello world")
    assert parse_completion({"prompt": ids}, LIMITS, tok).prompt_token_ids == tuple(ids)


def test_truncation_lets_a_prompt_longer_than_the_context_through(tok):
    ids = list(range(1, 101))  # 100 tokens, context 64
    error = refusal(parse_completion, {"prompt": ids}, LIMITS, tok)
    assert (error.param, error.code) == ("prompt", "context_length_exceeded")
    req = parse_completion({"prompt": ids, "truncate_prompt_tokens": 60}, LIMITS, tok)
    assert req.prompt_token_ids == tuple(range(41, 101)) and req.max_tokens == 4


def test_truncate_minus_one_keeps_what_leaves_room_for_max_tokens(tok):
    ids = list(range(1, 101))
    body = {"prompt": ids, "truncate_prompt_tokens": -1}
    req = parse_completion({**body, "max_tokens": 10}, LIMITS, tok)
    assert (len(req.prompt_token_ids), req.prompt_token_ids[-1], req.max_tokens) == (54, 100, 10)
    req = parse_completion(body, LIMITS, tok)  # room for one token
    assert (len(req.prompt_token_ids), req.max_tokens) == (63, 1)
    req = parse_completion(body, LIMITS, tok, GenerationDefaults(max_tokens=16))
    assert (len(req.prompt_token_ids), req.max_tokens) == (48, 16)  # the default cap's room
    req = parse_completion({**body, "prompt": [1, 2, 3]}, LIMITS, tok)  # short: untouched
    assert req.prompt_token_ids == (1, 2, 3) and req.max_tokens == 61


@pytest.mark.parametrize(
    "fields",
    [
        {"truncate_prompt_tokens": 0},
        {"truncate_prompt_tokens": -2},
        {"truncate_prompt_tokens": True},
        {"truncate_prompt_tokens": 2.0},
        {"truncate_prompt_tokens": "5"},
        {"truncate_prompt_tokens": 65},  # over the context
        {"truncate_prompt_tokens": 60, "max_tokens": 10},  # over the context less max_tokens
    ],
)
def test_bad_truncate_prompt_tokens_is_a_400_naming_it(tok, fields):
    for parse, body in (
        (parse_completion, {"prompt": list(range(1, 101)), **fields}),
        (lambda *a: parse_chat(*a, FALLBACK), {"messages": USER, **fields}),
    ):
        error = refusal(parse, body, LIMITS, tok)
        assert (error.status, error.param) == (400, "truncate_prompt_tokens"), fields
        assert "truncate_prompt_tokens" in error.message


def test_chat_truncates_the_rendered_prompt(tok):
    messages = [{"role": "user", "content": "one two three four five"}]
    full = parse_chat({"messages": messages}, LIMITS, tok, FALLBACK)
    assert full.message_endpoints  # anchors, without truncation
    req = parse_chat({"messages": messages, "truncate_prompt_tokens": 4}, LIMITS, tok, FALLBACK)
    assert req.prompt_token_ids == full.prompt_token_ids[-4:]
    assert (req.prompt, req.message_endpoints) == (None, ())


def test_each_prompt_of_a_batch_is_truncated_on_its_own(tok):
    body = {"prompt": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], "truncate_prompt_tokens": 2}
    reqs = parse_completions(body, LIMITS, tok)
    assert [r.prompt_token_ids for r in reqs] == [(4, 5), (6, 7), (9, 10)]


@pytest.mark.parametrize("chat", [False, True])
def test_truncate_prompt_tokens_end_to_end(tok, chat):
    prompt = (
        {"messages": [{"role": "user", "content": "one two three"}]}
        if chat
        else {"prompt": list(range(1, 31))}
    )
    r, client = post(tok, {**prompt, "truncate_prompt_tokens": 7}, chat=chat)
    assert r.status_code == 200, r.text
    assert len(client.prompts[0]) == 7 and r.json()["usage"]["prompt_tokens"] == 7
    r, full = post(tok, prompt, chat=chat)
    assert client.prompts[0] == full.prompts[0][-7:]
    assert r.json()["usage"]["prompt_tokens"] == len(full.prompts[0]) > 7


def test_a_text_longer_than_the_context_passes_with_truncation(tok):
    text = "alpha beta " * 2000  # far more characters than a 64-token context can hold
    r, _ = post(tok, {"prompt": text, "max_tokens": 5}, max_context=64)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r, client = post(
        tok, {"prompt": text, "max_tokens": 5, "truncate_prompt_tokens": 20}, max_context=64
    )
    assert r.status_code == 200, r.text
    assert client.prompts[0] == tuple(tok.encode(text))[-20:]
    assert r.json()["usage"]["prompt_tokens"] == 20


# ------------------------------------------------------------------ return_tokens_as_token_ids


def logprob_script(tok) -> tuple[list[int], list[Output]]:
    """Outputs of "alpha beta", two tokens a frame, each with logprobs: the token at
    -0.25 and the next vocabulary id as its alternative at -2."""
    ids = tok.encode("alpha beta", add_special_tokens=False)
    lps = [TokenLogprobs(-0.25, (t, t + 1), (-0.25, -2.0)) for t in ids]
    outs = [
        Output(0, 10 + i, tuple(ids[i : i + 2]), logprobs=tuple(lps[i : i + 2]))
        for i in range(0, len(ids), 2)
    ]
    outs[-1] = dataclasses.replace(outs[-1], finish_reason="length")
    return ids, outs


def completion_logprobs(r) -> dict:
    if r.headers["content-type"].startswith("text/event-stream"):
        merged: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in sse(r):
            lp = chunk["choices"][0]["logprobs"] if chunk.get("choices") else None
            for key in merged if lp else ():
                merged[key] += lp[key]
        return merged
    return r.json()["choices"][0]["logprobs"]


def chat_logprobs(r) -> list:
    if r.headers["content-type"].startswith("text/event-stream"):
        out = []
        for chunk in sse(r):
            lp = chunk["choices"][0]["logprobs"] if chunk.get("choices") else None
            out += lp["content"] if lp else []
        return out
    return r.json()["choices"][0]["logprobs"]["content"]


def test_return_tokens_as_token_ids_parses_as_a_bool(tok):
    parse = lambda **f: parse_completion({"prompt": "x", **f}, LIMITS, tok)  # noqa: E731
    assert parse().return_tokens_as_token_ids is False
    assert parse(return_tokens_as_token_ids=True).return_tokens_as_token_ids is True
    req = parse_chat({"messages": USER, "return_tokens_as_token_ids": True}, LIMITS, tok, FALLBACK)
    assert req.return_tokens_as_token_ids is True
    error = refusal(parse, return_tokens_as_token_ids=1)
    assert (error.status, error.param) == (400, "return_tokens_as_token_ids")


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_name_tokens_by_id(tok, stream):
    ids, script = logprob_script(tok)
    body = {"logprobs": 1, "stream": stream, "return_tokens_as_token_ids": True}
    r, _ = post(tok, body, script=script)
    assert r.status_code == 200, r.text
    assert text_of(r, False) == "alpha beta"  # the text itself is unchanged
    lp = completion_logprobs(r)
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert lp["top_logprobs"] == [{f"token_id:{t}": -0.25, f"token_id:{t + 1}": -2.0} for t in ids]
    assert lp["token_logprobs"] == [-0.25] * len(ids)
    texts = [tok.decode([t]) for t in ids]
    assert lp["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(len(ids))]
    # Without it: the tokens' text.
    r, _ = post(tok, {"logprobs": 1, "stream": stream}, script=script)
    assert completion_logprobs(r)["tokens"] == texts


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_name_tokens_by_id(tok, stream):
    ids, script = logprob_script(tok)
    body = {"logprobs": True, "top_logprobs": 2, "stream": stream}
    r, _ = post(tok, {**body, "return_tokens_as_token_ids": True}, chat=True, script=script)
    assert r.status_code == 200, r.text
    content = chat_logprobs(r)
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    # As vLLM: the sampled token's bytes are its text's, an alternative's its token string's.
    assert [e["bytes"] for e in content] == [list(tok.decode([t]).encode()) for t in ids]
    assert [e["top_logprobs"] for e in content] == [
        [
            {"token": f"token_id:{a}", "logprob": v, "bytes": list(f"token_id:{a}".encode())}
            for a, v in ((t, -0.25), (t + 1, -2.0))
        ]
        for t in ids
    ]
    r, _ = post(tok, body, chat=True, script=script)
    assert [e["token"] for e in chat_logprobs(r)] == [tok.decode([t]) for t in ids]


# ------------------------------------------------------------------ add_special_tokens, generation


def test_add_special_tokens_decides_the_bos(tok):
    bos_tok = dataclasses.replace(tok, add_bos_token=True)
    bos = bos_tok.bos_token_id
    parse = lambda **f: parse_completion({"prompt": "Hello", **f}, LIMITS, bos_tok)  # noqa: E731
    assert parse().prompt_token_ids[0] == bos
    assert parse(add_special_tokens=True).prompt_token_ids[0] == bos
    assert parse(add_special_tokens=False).prompt_token_ids == tuple(tok.encode("Hello"))
    # Chat: the template's default (the fallback adds them; a model's template does not).
    chat = lambda **f: parse_chat({"messages": USER, **f}, LIMITS, bos_tok, FALLBACK)  # noqa: E731
    assert chat().prompt_token_ids[0] == bos
    assert chat(add_special_tokens=False).prompt_token_ids[0] != bos
    model_template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    req = parse_chat({"messages": USER}, LIMITS, bos_tok, model_template)
    assert req.prompt_token_ids == tuple(tok.encode("hi"))
    req = parse_chat(
        {"messages": USER, "add_special_tokens": True}, LIMITS, bos_tok, model_template
    )
    assert req.prompt_token_ids == (bos, *tok.encode("hi"))
    error = refusal(parse, add_special_tokens="no")
    assert (error.status, error.param) == (400, "add_special_tokens")


def test_add_generation_prompt_false_leaves_out_the_assistant_start(tok):
    req = parse_chat({"messages": USER}, LIMITS, tok, FALLBACK)
    assert req.prompt == "<|user|>\nhi\n<|assistant|>\n"
    req = parse_chat({"messages": USER, "add_generation_prompt": False}, LIMITS, tok, FALLBACK)
    assert req.prompt == "<|user|>\nhi\n"
    assert req.prompt_token_ids == tuple(tok.encode("<|user|>\nhi\n"))
    error = refusal(
        parse_chat, {"messages": USER, "add_generation_prompt": 1}, LIMITS, tok, FALLBACK
    )
    assert error.param == "add_generation_prompt"


# ------------------------------------------------------------------ refused, ignored

# Every field the audit refuses: a value that asks for something -> 400 naming it.
REFUSED = [
    ("prompt_logprobs", -1),
    ("allowed_token_ids", [1, 2]),
    ("allowed_token_ids", []),
    ("bad_words", ["beta"]),
    ("prompt_embeds", "AAAA"),
    ("logits_processors", ["module.Processor"]),
    ("vllm_xargs", {"key": 1}),
    ("kv_transfer_params", {"do_remote_prefill": True}),
    ("priority", 1),
    ("priority", -1),
    ("return_token_ids", True),
    ("max_repetition_pattern_size", 4),
    ("min_repetition_pattern_size", 2),
    ("repetition_min_count", 3),
    ("chat_template", "{{ messages }}"),
    ("chat_template_kwargs", {"enable_thinking": False}),
    ("documents", [{"title": "t", "text": "x"}]),
    ("reasoning_effort", "low"),
    ("continue_final_message", True),
    ("structural_tag", "{}"),
    ("best_of", 2),
    ("suffix", "tail"),
    ("use_beam_search", True),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "[a-z]+"),
    ("guided_choice", ["a", "b"]),
    ("guided_grammar", "root ::= 'a'"),
    ("structured_outputs", {"regex": "a"}),
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("functions", [{"name": "f"}]),
    ("tool_choice", "required"),
    ("function_call", {"name": "f"}),
    ("min_p", 0.1),
]
# Their forms that ask for nothing pass.
NO_OPS = [
    ("prompt_logprobs", None),
    ("allowed_token_ids", None),
    ("bad_words", []),
    ("prompt_embeds", None),
    ("logits_processors", []),
    ("vllm_xargs", {}),
    ("kv_transfer_params", {}),
    ("priority", 0),
    ("return_token_ids", False),
    ("max_repetition_pattern_size", 0),
    ("min_repetition_pattern_size", 0),
    ("repetition_min_count", 0),
    ("chat_template", None),
    ("chat_template_kwargs", {}),
    ("reasoning_effort", None),
    ("continue_final_message", False),
    ("echo", False),
]
# Fields that never change the output (given what flare refuses): accepted, no effect.
IGNORED = [
    ("user", "user-1234"),
    ("request_id", "my-request"),
    ("length_penalty", 0.5),  # beam search only
    ("spaces_between_special_tokens", False),  # tokenizer.json tokenizers add none
    ("include_reasoning", False),  # no reasoning parser
    ("parallel_tool_calls", False),  # no tools
    ("guided_decoding_backend", "xgrammar"),  # guided decoding only
    ("guided_whitespace_pattern", r"\s*"),  # guided decoding only
    ("mm_processor_kwargs", {"num_crops": 4}),  # multimodal processors only
    ("store", True),  # OpenAI's, outside vLLM's models
    ("metadata", {"k": "v"}),
    ("service_tier", "auto"),
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(("field", "value"), REFUSED)
def test_a_refused_field_is_a_400_naming_it(tok, chat, field, value):
    r, client = post(tok, {field: value}, chat=chat)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == (field, "invalid_request_error")
    assert field in error["message"]
    assert client.submitted == []


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("value", [0, 5, 20])
def test_prompt_logprobs_asks_the_coordinator_to_score_the_prompt(tok, chat, value):
    r, client = post(tok, {"prompt_logprobs": value, "max_tokens": 0}, chat=chat)
    assert r.status_code == 200, r.text
    (submit,) = client.submits
    assert (submit.prompt_logprobs, submit.max_tokens) == (value, 0)


@pytest.mark.parametrize("value", [-1, 21, "2"])
def test_prompt_logprobs_out_of_range_is_a_400_naming_it(tok, value):
    r, client = post(tok, {"prompt_logprobs": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert client.submitted == []


def test_echo_is_for_completions_only_and_scores_with_logprobs(tok):
    r, client = post(tok, {"echo": True}, chat=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r, client = post(tok, {"echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    assert client.submits[0].prompt_logprobs == 2  # echo with logprobs scores the prompt
    r, client = post(tok, {"echo": True})
    assert r.json()["choices"][0]["text"].startswith("x")  # the prompt, then the text
    assert client.submits[0].prompt_logprobs == -1  # echo alone: the text, no scoring


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_is_refused(tok, chat):
    options = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    r, _ = post(tok, options, chat=chat)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    options["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
    r, _ = post(tok, options, chat=chat)
    assert r.status_code == 200 and sse(r)[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(("field", "value"), NO_OPS)
def test_a_refused_fields_no_op_form_passes(tok, chat, field, value):
    r, _ = post(tok, {field: value}, chat=chat)
    assert r.status_code == 200, r.text
    assert text_of(r, chat) == TEXT


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(("field", "value"), IGNORED)
def test_an_ignored_field_is_accepted_and_changes_nothing(tok, chat, field, value):
    r, client = post(tok, {field: value, "seed": 7}, chat=chat)
    assert r.status_code == 200, r.text
    assert text_of(r, chat) == TEXT
    _, plain = post(tok, {"seed": 7}, chat=chat)
    assert client.submits == plain.submits  # the same prompt, sampling, everything
