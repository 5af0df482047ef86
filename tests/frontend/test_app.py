"""The HTTP app against a scripted coordinator: publication reports, cancellation on
frontend-side stops, health.  (tests/frontend/test_server.py runs the real process tree.)"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from runtime.frontend.chat import load_chat_template
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.server.app import create_app
from runtime.frontend.server.state import Frontend
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir
from runtime.transport.api import Output
from tests.support.scripted_client import MODEL, ScriptedClient, script_for, sse


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def app(client: ScriptedClient, tokenizer: ModelTokenizer) -> TestClient:
    template = load_chat_template(default_model_dir(), tokenizer)
    frontend = Frontend(
        client, tokenizer, template, ServingLimits(MODEL, 512, 4096), ServingMetrics(MODEL)
    )
    return TestClient(create_app(frontend))


def test_streaming_publishes_each_chunk_with_its_fence(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "alpha beta gamma delta"))
    with app(client, tokenizer) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True})
    chunks = sse(r)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "alpha beta gamma delta"
    shown = [10 + i for i, c in enumerate(chunks) if c["choices"][0]["text"]]
    # Every chunk but the final one was reported, with the fence that produced it.
    assert [f for _, f in client.published] == shown[:-1]
    assert client.cancelled == []  # it ended at the coordinator


def test_held_back_text_is_not_published_and_a_stop_string_cancels(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "alpha beta gamma delta"))
    with app(client, tokenizer) as http:
        r = http.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 50, "stream": True, "stop": ["gamma"]},
        )
    chunks = sse(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "alpha beta "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert client.cancelled == client.submitted  # the coordinator stops selecting it
    # Publications never claim the held-back text: their fences precede the stop.
    stop_fence = 10 + len(tokenizer.encode("alpha beta gamma", add_special_tokens=False)) - 1
    assert all(f < stop_fence for _, f in client.published)


def test_a_non_streaming_response_publishes_nothing(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "alpha beta"))
    with app(client, tokenizer) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "alpha beta"
    assert client.published == []


def test_a_refusal_is_a_400_and_an_engine_failure_a_500(tokenizer):
    client = ScriptedClient([Output(0, 0, (), "refused", "needs 9 KV pages, the ranks hold 8")])
    with app(client, tokenizer) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert r.status_code == 400 and "KV pages" in r.json()["error"]["message"]
    client = ScriptedClient([Output(0, 0, (), "error", "rank 0: CUDA out of memory")])
    with app(client, tokenizer) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b"[" * 5000 + b"]" * 5000, 400, None),  # nesting deeper than the parser's recursion
        (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),  # a 5000-digit int
        (b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
        (b'{"prompt": "hi", "top_p": 1' + b"0" * 400 + b"}", 400, "top_p"),
        (b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "prompt"),  # a lone surrogate
        (b'{"prompt": "hi", "stop": ["\\udc00"]}', 400, "stop"),
        (b'{"prompt": "' + b"word " * 200_000 + b'"}', 400, "prompt"),  # longer than any context
    ],
)
def test_hostile_bodies_are_4xx_naming_the_field(tokenizer, content, status, param):
    client = ScriptedClient(script_for(tokenizer, "ok"))
    with app(client, tokenizer) as http:
        r = http.post("/v1/completions", content=content,
                      headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert client.submitted == [client.submitted[-1]]  # only the good request went through


def test_a_body_over_the_limit_is_a_413(tokenizer, monkeypatch):
    from runtime.frontend.server import body

    monkeypatch.setattr(body, "MAX_BODY_BYTES", 1000)
    with app(ScriptedClient([]), tokenizer) as http:
        r = http.post("/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and "error" in r.json()


def test_developer_messages_are_system_messages(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "ok"))
    with app(client, tokenizer) as http:
        r = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "developer", "content": "be brief"},
                               {"role": "user", "content": "hi"}]},
        )  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


@pytest.mark.parametrize(("serving", "gone"), [(False, False), (True, True)])
def test_health_is_503_unless_the_engine_serves(tokenizer, serving, gone):
    with app(ScriptedClient([], serving=serving, gone=gone), tokenizer) as http:
        assert http.get("/health").status_code == 503
        assert http.get("/v1/models").status_code == 200
    with app(ScriptedClient([]), tokenizer) as http:
        assert http.get("/health").status_code == 200


def test_a_stopped_engine_is_a_503_and_a_huge_top_k_means_no_top_k(tokenizer):
    with app(ScriptedClient([Output(0, 0, (), "aborted")]), tokenizer) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    client = ScriptedClient(script_for(tokenizer, "alpha"))
    with app(client, tokenizer) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "top_k": 10**12})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "alpha"


def test_the_kv_cache_bounds_max_tokens_like_the_context(tokenizer):
    template = load_chat_template(default_model_dir(), tokenizer)
    limits = ServingLimits(MODEL, 512, 4096, kv_tokens=64)
    client = ScriptedClient(script_for(tokenizer, "ok"))
    frontend = Frontend(client, tokenizer, template, limits, ServingMetrics(MODEL))
    with TestClient(create_app(frontend)) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 100})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "KV cache" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_the_choices_of_one_request_share_an_admission_group(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "ok"))
    with app(client, tokenizer) as http:
        r = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 6
        assert http.post("/v1/completions", json={"prompt": "c"}).status_code == 200
    assert client.groups == [1] * 6 + [2]


def test_a_many_choice_response_renders_a_choice_at_a_time_to_the_same_json():
    from runtime.frontend.server.responses import rendered

    content = {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": 'odd "choices":[] name',
        "choices": [{"index": i, "text": f"é {i}", "finish_reason": "length"} for i in range(20)],
        "usage": {"prompt_tokens": 3},
    }
    response = asyncio.run(rendered(content))
    assert json.loads(response.body) == content
    assert response.headers["content-type"] == "application/json"
