"""What a vLLM user expects of the API, against a scripted coordinator: unsupported
fields refused by name, penalties and logit_bias passed to the ranks, request defaults
from generation_config.json, /tokenize, /detokenize and /version, --chat-template,
the choices limit, the API key's scheme in any case, and the min_tokens stop gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from runtime.frontend.chat import ChatTemplate, load_chat_template
from runtime.frontend.defaults import GenerationDefaults, load_generation_defaults
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.server.admin_routes import package_version
from runtime.frontend.server.app import create_app
from runtime.frontend.server.state import Frontend
from runtime.frontend.tokenizer import ModelTokenizer, TokenizerError
from runtime.ranks.model import default_model_dir
from runtime.transport.api import Output
from tests.support.scripted_client import MODEL, ScriptedClient, script_for

VOCAB = 512
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def serve(
    client: ScriptedClient,
    tokenizer: ModelTokenizer,
    *,
    defaults: GenerationDefaults | None = None,
    template: ChatTemplate | None = None,
    api_key: str | None = None,
    **limits,
) -> TestClient:
    template = template or load_chat_template(default_model_dir(), tokenizer)
    frontend = Frontend(
        client,
        tokenizer,
        template,
        ServingLimits(MODEL, VOCAB, 4096, **limits),
        ServingMetrics(MODEL),
        api_key,
        defaults or GenerationDefaults(),
    )
    return TestClient(create_app(frontend))


def ok_client(tokenizer: ModelTokenizer) -> ScriptedClient:
    return ScriptedClient(script_for(tokenizer, "ok"))


# ------------------------------------------------------------------ unsupported fields

UNSUPPORTED = [
    ({"best_of": 3, "n": 2}, "best_of"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 0}, "best_of"),
    ({"suffix": "tail"}, "suffix"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_regex": "[a-z]+"}, "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ({"structured_outputs": {"json": {}}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"response_format": "text"}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tools": {}}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"min_p": 0.1}, "min_p"),
]
NO_OPS = [
    {"best_of": 1},
    {"best_of": 2, "n": 2},
    {"best_of": 1, "n": 3},
    {"suffix": ""},
    {"suffix": None},
    {"use_beam_search": False},
    {"response_format": {"type": "text"}},
    {"tools": []},
    {"tool_choice": "none"},
    {"tools": [], "tool_choice": "auto"},
    {"guided_json": None},
    {"min_p": 0},
]


def route(chat: bool) -> tuple[str, dict]:
    """The completions or chat route and a minimal body for it."""
    if chat:
        return "/v1/chat/completions", {"messages": USER}
    return "/v1/completions", {"prompt": "x"}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(("fields", "param"), UNSUPPORTED)
def test_fields_the_runtime_does_not_implement_are_a_400_naming_them(
    tokenizer, chat, fields, param
):
    client = ok_client(tokenizer)
    path, body = route(chat)
    with serve(client, tokenizer) as http:
        r = http.post(path, json={**body, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"
    assert client.submitted == []


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("fields", NO_OPS)
def test_their_no_op_forms_are_accepted(tokenizer, chat, fields):
    client = ok_client(tokenizer)
    path, body = route(chat)
    with serve(client, tokenizer) as http:
        r = http.post(path, json={**body, **fields})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == fields.get("n", 1)


# ------------------------------------------------------------------ penalties and bias


def test_penalties_and_logit_bias_reach_the_sampling_params(tokenizer):
    client = ok_client(tokenizer)
    body = {
        "prompt": "x",
        "n": 2,
        "logit_bias": {"5": 10, "17": -100, "0": 2.5},
        "presence_penalty": 0.5,
        "frequency_penalty": -1.25,
        "repetition_penalty": 1.3,
    }
    with serve(client, tokenizer) as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    for sampling in client.sampling[:2]:  # every choice
        assert sampling.logit_bias == ((5, 10.0), (17, -100.0), (0, 2.5))
        assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.25)
        assert sampling.repetition_penalty == 1.3
    plain = client.sampling[2]
    assert plain.logit_bias == () and not plain.adjusts_logits


BAD_ADJUSTMENTS = [
    {"logit_bias": {"512": 1}},  # outside the vocabulary
    {"logit_bias": {"9" * 5000: 1}},
    {"logit_bias": {"-1": 1}},
    {"logit_bias": {"abc": 1}},
    {"logit_bias": {" 5": 1}},
    {"logit_bias": {"5": 100.5}},
    {"logit_bias": {"5": -101}},
    {"logit_bias": {"5": "1"}},
    {"logit_bias": {"5": True}},
    {"logit_bias": {"5": 1, "05": 2}},  # the same id twice
    {"logit_bias": [[5, 1]]},
    {"logit_bias": {str(i): 1 for i in range(301)}},
    {"presence_penalty": 2.5},
    {"presence_penalty": "1"},
    {"frequency_penalty": -2.01},
    {"frequency_penalty": 1e400},
    {"repetition_penalty": 0},
    {"repetition_penalty": -1},
    {"repetition_penalty": True},
]


@pytest.mark.parametrize("fields", BAD_ADJUSTMENTS)
def test_bad_penalties_and_biases_are_a_400_naming_the_field(tokenizer, fields):
    client = ok_client(tokenizer)
    (param,) = fields
    with serve(client, tokenizer) as http:
        body = json.dumps({"prompt": "x", **fields}).replace("Infinity", "1e400")
        r = http.post("/v1/completions", content=body,
                      headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert len(r.json()["error"]["message"]) < 300
    assert client.submitted == []


def test_a_bias_on_the_last_id_and_penalties_at_their_bounds_pass(tokenizer):
    client = ok_client(tokenizer)
    body = {"logit_bias": {"511": 100, "0": -100}, "presence_penalty": -2, "frequency_penalty": 2}
    with serve(client, tokenizer) as http:
        r = http.post("/v1/chat/completions", json={"messages": USER, **body})
    assert r.status_code == 200, r.text
    assert client.sampling[0].logit_bias == ((511, 100.0), (0, -100.0))


# ------------------------------------------------------------------ generation_config.json


def write_model(tmp_path: Path, generation: dict | None) -> Path:
    source = Path(default_model_dir())
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_generation_config_gives_the_defaults(tmp_path):
    model = write_model(
        tmp_path,
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
         "max_new_tokens": 7, "eos_token_id": [510, 3], "do_sample": False, "min_p": 0.1},
    )  # fmt: skip
    tokenizer = ModelTokenizer.from_dir(model)
    defaults = load_generation_defaults(model, tokenizer.eos_token_ids)
    assert defaults == GenerationDefaults(
        0.6, 0.9, 20, 1.1, 7, (510, 3),
        ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens"),
    )  # fmt: skip
    assert load_generation_defaults(write_model(tmp_path / "..", None)) == GenerationDefaults()


@pytest.mark.parametrize(
    ("entry", "value"),
    [("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("top_k", 2.5),
     ("top_k", -2), ("repetition_penalty", 0), ("max_new_tokens", 0)],
)  # fmt: skip
def test_a_bad_generation_config_entry_fails_naming_the_file_and_entry(tmp_path, entry, value):
    model = write_model(tmp_path, {entry: value})
    with pytest.raises(TokenizerError, match=f"generation_config.json: {entry}"):
        load_generation_defaults(model)


def test_a_request_field_wins_over_generation_config_which_wins_over_flare(tokenizer):
    defaults = GenerationDefaults(0.6, 0.9, 20, 1.1, 7, (510, 3))
    client = ok_client(tokenizer)
    with serve(client, tokenizer, defaults=defaults) as http:
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        explicit = {"temperature": 0, "top_p": 1, "top_k": -1, "repetition_penalty": 1,
                    "max_tokens": 30}  # fmt: skip
        assert http.post("/v1/completions", json={"prompt": "x", **explicit}).status_code == 200
    model, own = client.sampling
    assert (model.temperature, model.top_p, model.top_k, model.repetition_penalty) == (
        0.6, 0.9, 20, 1.1
    )  # fmt: skip
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty) == (0, 1, -1, 1)


def test_max_new_tokens_caps_the_default_max_tokens(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "alpha beta"))
    seen = []
    submit = client.submit

    def spy(request_id, prompt, max_tokens, *args, **kwargs):
        seen.append(max_tokens)
        return submit(request_id, prompt, max_tokens, *args, **kwargs)

    client.submit = spy
    with serve(client, tokenizer, defaults=GenerationDefaults(max_tokens=7)) as http:
        http.post("/v1/completions", json={"prompt": "x"})
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 100})
    assert seen == [7, 100]


def test_the_model_eos_ids_end_a_choice_unless_ignore_eos(tokenizer):
    """A Llama 3 instruct model lists <|eot_id|> only in generation_config.json: it ends
    the choice like a stop token id (counted, not shown)."""
    ids = tokenizer.encode("alpha beta", add_special_tokens=False)
    script = [Output(0, 10 + i, (t,)) for i, t in enumerate(ids)]
    script.append(Output(0, 99, (ids[0],), "length"))
    eot = ids[4]  # " b": stands in for an end-of-turn id the ranks do not stop on
    defaults = GenerationDefaults(eos_token_ids=(eot,))
    with serve(ScriptedClient(script), tokenizer, defaults=defaults) as http:
        stopped = http.post("/v1/completions", json={"prompt": "x"}).json()
        ignored = http.post("/v1/completions", json={"prompt": "x", "ignore_eos": True}).json()
    assert stopped["choices"][0]["text"] == "alpha"
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 5
    assert ignored["choices"][0]["text"] == "alpha betaal"
    assert ignored["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------ routes


def test_tokenize_and_detokenize_round_trip(tokenizer):
    client = ok_client(tokenizer)
    with serve(client, tokenizer) as http:
        r = http.post("/tokenize", json={"prompt": "alpha beta"})
        assert r.status_code == 200
        body = r.json()
        ids = tokenizer.encode("alpha beta")
        assert body == {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
        r = http.post("/tokenize", json={"model": MODEL, "prompt": "alpha",
                      "add_special_tokens": False, "return_token_strs": True})  # fmt: skip
        strs = r.json()["token_strs"]
        assert "".join(strs) == "alpha" and len(strs) == r.json()["count"]
        r = http.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": "alpha beta"}
        eos = tokenizer.eos_token_ids[0]
        assert http.post("/detokenize", json={"tokens": [eos]}).json() == {"prompt": "<|eos|>"}
        assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    assert client.submitted == []  # no engine work


def test_tokenize_renders_messages_with_the_chat_template(tokenizer):
    with serve(ok_client(tokenizer), tokenizer) as http:
        r = http.post("/tokenize", json={"messages": USER})
        ids = r.json()["tokens"]
        assert tokenizer.decode(ids) == "<|user|>\nhi\n<|assistant|>\n"
        r = http.post("/tokenize", json={"messages": USER, "add_generation_prompt": False})
        assert tokenizer.decode(r.json()["tokens"]) == "<|user|>\nhi\n"
        long = http.post("/tokenize", json={"prompt": "word " * 3000}).json()  # over the context
        assert long["count"] > long["max_model_len"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 512]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_tokenize_and_detokenize_refuse_bad_input_naming_the_field(tokenizer, path, body, param):
    with serve(ok_client(tokenizer), tokenizer) as http:
        r = http.post(path, json=body)
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"]["param"] == param
        r = http.post(path, content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert (
            http.post(path, content=b"x", headers={"content-type": "text/plain"}).status_code == 415
        )


def test_version_comes_from_the_package(tokenizer):
    with serve(ok_client(tokenizer), tokenizer) as http:
        r = http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": package_version()}
    assert package_version() not in ("", None)


def test_models_lists_the_vocabulary_size(tokenizer):
    with serve(ok_client(tokenizer), tokenizer) as http:
        card = http.get("/v1/models").json()["data"][0]
    assert card["vocab_size"] == VOCAB and card["max_model_len"] == 4096


# ------------------------------------------------------------------ API key


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ("Bearer sekrit", 200),
        ("bearer sekrit", 200),
        ("BEARER sekrit", 200),
        ("Bearer  sekrit ", 200),
        ("Bearer wrong", 401),
        ("Basic sekrit", 401),
        ("sekrit", 401),
        ("Bearer", 401),
        (None, 401),
    ],
)
def test_the_authorization_scheme_is_case_insensitive(tokenizer, header, status):
    headers = {} if header is None else {"authorization": header}
    with serve(ok_client(tokenizer), tokenizer, api_key="sekrit") as http:
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/tokenize", {"prompt": "x"}),
                           ("/detokenize", {"tokens": [1]})):  # fmt: skip
            assert http.post(path, json=body, headers=headers).status_code == status
        assert http.get("/v1/models", headers=headers).status_code == status
        assert http.get("/health").status_code == 200  # open, as before
        assert http.get("/version").status_code == 200  # open, as in vLLM


# ------------------------------------------------------------------ --chat-template


def test_a_chat_template_file_replaces_the_models(tmp_path, tokenizer):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")  # fmt: skip
    template = load_chat_template(default_model_dir(), tokenizer, str(path))
    client = ok_client(tokenizer)
    with serve(client, tokenizer, template=template) as http:
        assert http.post("/v1/chat/completions", json={"messages": USER}).status_code == 200
    assert tokenizer.decode(client.prompts[0]) == "[user] hi\n[assistant] "
    inline = load_chat_template(default_model_dir(), tokenizer, "{{ messages[0].content }}!")
    assert inline.source == "{{ messages[0].content }}!"  # no such file: the template itself


@pytest.mark.parametrize(
    ("override", "match"),
    [("/no/such/template.jinja", "cannot read"), ("{% for %}", "does not compile")],
)
def test_a_bad_chat_template_fails_naming_the_flag(tokenizer, override, match):
    with pytest.raises(ValueError, match=f"--chat-template.*{match}"):
        load_chat_template(default_model_dir(), tokenizer, override)


# ------------------------------------------------------------------ choices per request


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "n": 5}, 400, "n"),
        ({"prompt": ["a", "b", "c", "d", "e"]}, 400, "prompt"),
        ({"prompt": [[1], [2], [3]], "n": 2}, 400, "n"),
        ({"prompt": ["a", "b"], "n": 2}, 200, None),
        ({"prompt": "x", "n": 4}, 200, None),
    ],
)
def test_prompts_times_n_over_the_limit_is_a_400(tokenizer, body, status, param):
    client = ok_client(tokenizer)
    with serve(client, tokenizer, max_choices=4) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["param"] == param
            assert "--max-choices-per-request" in r.json()["error"]["message"]
            assert client.submitted == []
        chat = http.post("/v1/chat/completions", json={"messages": USER, "n": 5})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "n"


# ------------------------------------------------------------------ min_tokens


def test_a_stop_string_completed_by_token_number_min_tokens_stops_there(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The token that completes "bet" (whatever the tokenizer's merges: the stop
    # string may end inside it).
    k = next(i for i in range(1, len(ids) + 1) if "bet" in tokenizer.decode(ids[:i]))
    assert tokenizer.decode(ids[:k]).startswith("alpha bet") and k < len(ids)
    for min_tokens, expected, used in (
        (k, "alpha ", k),
        (k + 1, "alpha beta gamma delta", len(ids)),
    ):
        client = ScriptedClient(script_for(tokenizer, text))
        with serve(client, tokenizer) as http:
            body = {"prompt": "x", "stop": ["bet"], "min_tokens": min_tokens, "max_tokens": 50}
            r = http.post("/v1/completions", json=body).json()
        assert r["choices"][0]["text"] == expected, min_tokens
        assert r["usage"]["completion_tokens"] == used
        assert r["choices"][0]["finish_reason"] == ("stop" if min_tokens == k else "length")
