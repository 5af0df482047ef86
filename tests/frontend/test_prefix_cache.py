"""Prefix caching at the frontend, against a scripted coordinator: ``cache_salt``
validation, per-API-key salts, the Submit of a chat request (message endpoints and
salt), and ``usage.prompt_tokens_details.cached_tokens`` from ``Output.cached_tokens``.
(tests/frontend/test_server.py checks cached tokens with the real process tree.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient

from runtime.frontend.chat import load_chat_template
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.protocol.chat_completions import parse_chat
from runtime.frontend.protocol.completions import parse_completions
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.server.app import create_app
from runtime.frontend.server.auth import api_keys, combined_salt, tenant_salts
from runtime.frontend.server.generation import submit_endpoints
from runtime.frontend.server.state import Frontend
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir
from runtime.transport.api import MAX_SALT_CHARS, Output
from tests.support.scripted_client import MODEL, ScriptedClient, script_for, sse

LIMITS = ServingLimits(MODEL, 512, 4096)
PROMPT_A = "one two three four five six seven eight nine ten"
PROMPT_B = "red green blue cyan magenta yellow black white grey"
CHAT = [
    {"role": "system", "content": "You are a careful assistant. " * 8},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi, how can I help?"},
    {"role": "user", "content": "tell me a story"},
]


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def serve(client: ScriptedClient, tokenizer: ModelTokenizer, api_key=None) -> TestClient:
    template = load_chat_template(default_model_dir(), tokenizer)
    frontend = Frontend(client, tokenizer, template, LIMITS, ServingMetrics(MODEL), api_key)
    return TestClient(create_app(frontend))


def cached_script(tokenizer: ModelTokenizer, text: str, cached: int) -> list[Output]:
    """``script_for``'s outputs, each carrying ``cached`` cached prompt tokens (as the
    coordinator sets it on every output once the request ran)."""
    return [dataclasses.replace(o, cached_tokens=cached) for o in script_for(tokenizer, text)]


# ------------------------------------------------------------------ cache_salt


@pytest.mark.parametrize(
    "salt", ["", 7, True, ["a"], {"a": 1}, "x" * (MAX_SALT_CHARS + 1), "\ud800"]
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_cache_salt_is_a_400_naming_it(tokenizer, path, salt):
    client = ScriptedClient(script_for(tokenizer, "ok"))
    body = {"max_tokens": 2, "cache_salt": salt}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "x"})
    with serve(client, tokenizer) as http:
        r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"
    assert client.submitted == []


def test_a_good_cache_salt_is_parsed_and_null_means_none(tokenizer):
    template = load_chat_template(default_model_dir(), tokenizer)
    req = parse_chat({"messages": CHAT, "cache_salt": "tenant-a"}, LIMITS, tokenizer, template)
    assert req.cache_salt == "tenant-a"
    longest = "s" * MAX_SALT_CHARS
    reqs = parse_completions({"prompt": ["a", "b"], "cache_salt": longest}, LIMITS, tokenizer)
    assert [r.cache_salt for r in reqs] == [longest, longest]
    assert (
        parse_completions({"prompt": "a", "cache_salt": None}, LIMITS, tokenizer)[0].cache_salt
        == ""
    )


# ------------------------------------------------------------------ per-key salts


def test_api_keys_take_lists_and_repeats():
    assert api_keys(None) == () and api_keys("") == () and api_keys(" , ") == ()
    assert api_keys("k1") == ("k1",)
    assert api_keys("k1, k2,,k1") == ("k1", "k2")
    assert api_keys(["k1", "k2,k3"]) == ("k1", "k2", "k3")
    assert api_keys(("k1",)) == ("k1",)


def test_each_key_gets_its_own_salt_which_is_not_the_key():
    keys = ("alpha-key", "beta-key", "gamma-key")
    salts = tenant_salts(keys)
    assert set(salts) == set(keys)
    assert len(set(salts.values())) == 3  # distinct per key
    for key, salt in salts.items():
        assert key not in salt and salt != key
        assert 0 < len(salt) <= MAX_SALT_CHARS
    assert tenant_salts(keys) == salts  # stable within the process
    assert tenant_salts(("only",)) == {} and tenant_salts(()) == {}  # one key: no salt


def test_combined_salts_keep_tenants_apart_and_fit_submit():
    a, b = tenant_salts(("key-a", "key-b")).values()
    assert combined_salt("", "mine") == "mine" and combined_salt("", "") == ""
    assert combined_salt(a, "") == a
    long = "x" * MAX_SALT_CHARS
    for salt in ("", "mine", long, b):
        assert combined_salt(a, salt) != combined_salt(b, salt)
        assert combined_salt(a, salt).startswith(a)
        assert len(combined_salt(a, salt)) <= MAX_SALT_CHARS
    assert combined_salt(a, "one") != combined_salt(a, "two") != combined_salt(a, "")


def test_several_api_keys_salt_each_tenants_submits(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "ok"))
    keys = "key-one,key-two"
    with serve(client, tokenizer, api_key=keys) as http:
        for key in ("key-one", "key-two", "key-one"):
            r = http.post(
                "/v1/chat/completions",
                json={"messages": CHAT, "max_tokens": 2},
                headers={"authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200, r.text
        r = http.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "cache_salt": "mine"},
            headers={"authorization": "Bearer key-two"},
        )
        assert r.status_code == 200
        bad = http.post(
            "/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer nope"}
        )
        assert bad.status_code == 401
    salts = [s.cache_salt for s in client.submits]
    one, two = tenant_salts(api_keys(keys)).values()
    assert salts[:3] == [one, two, one] and one != two
    assert salts[3] == combined_salt(two, "mine") != "mine"
    assert all("key-" not in salt for salt in salts)


def test_one_api_key_or_none_sends_the_requests_own_salt(tokenizer):
    for api_key in (None, "sekrit"):
        client = ScriptedClient(script_for(tokenizer, "ok"))
        headers = {"authorization": "Bearer sekrit"} if api_key else {}
        with serve(client, tokenizer, api_key=api_key) as http:
            for body in ({"prompt": "x", "cache_salt": "s1"}, {"prompt": "x"}):
                assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
        assert [s.cache_salt for s in client.submits] == ["s1", ""]


# ------------------------------------------------------------------ Submit


def test_a_chat_submit_carries_the_message_endpoints_and_the_salt(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "ok"))
    with serve(client, tokenizer) as http:
        r = http.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 2, "n": 2, "cache_salt": "conv-7"},
        )
    assert r.status_code == 200
    template = load_chat_template(default_model_dir(), tokenizer)
    req = parse_chat({"messages": CHAT}, LIMITS, tokenizer, template)
    assert len(client.submits) == 2  # one per choice, each with the anchors and salt
    for submit in client.submits:
        assert submit.prompt_token_ids == req.prompt_token_ids
        assert submit.cache_salt == "conv-7"
        assert submit.message_endpoints == req.message_endpoints
        assert len(submit.message_endpoints) == len(CHAT)
        assert 0 < submit.message_endpoints[0] < submit.message_endpoints[-1]
        assert submit.message_endpoints[-1] < len(submit.prompt_token_ids)  # + generation prompt


def test_a_completion_submit_has_no_endpoints(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "ok"))
    with serve(client, tokenizer) as http:
        assert http.post("/v1/completions", json={"prompt": "x y z"}).status_code == 200
    assert client.submits[0].message_endpoints == () and client.submits[0].cache_salt == ""


def test_submit_endpoints_are_strictly_increasing_within_the_prompt():
    assert submit_endpoints((0, 0, 3, 3, 5, 9), 8) == (3, 5)
    assert submit_endpoints((), 4) == ()
    assert len(submit_endpoints(tuple(range(1, 6000)), 6000)) == 4096


def test_message_endpoints_of_repeated_empty_messages_still_make_a_valid_submit(tokenizer):
    """Messages that add no tokens give equal (or zero) endpoints; the Submit drops them."""
    template = load_chat_template(default_model_dir(), tokenizer)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 3
    req = parse_chat({"messages": messages}, LIMITS, tokenizer, template)
    client = ScriptedClient(script_for(tokenizer, "ok"))
    with serve(client, tokenizer) as http:
        assert http.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
    assert client.submits[0].message_endpoints == submit_endpoints(
        req.message_endpoints, len(req.prompt_token_ids)
    )


# ------------------------------------------------------------------ usage


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_usage_reports_cached_tokens_streaming_and_not(tokenizer, path):
    chat = "chat" in path
    body = {"messages": CHAT} if chat else {"prompt": "x y z"}
    client = ScriptedClient(cached_script(tokenizer, "alpha beta", 12))
    with serve(client, tokenizer) as http:
        whole = http.post(path, json={**body, "max_tokens": 5}).json()
        streamed = http.post(
            path,
            json={**body, "max_tokens": 5, "stream": True,
                  "stream_options": {"include_usage": True}},
        )  # fmt: skip
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}
    last = sse(streamed)[-1]
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] == 12
    assert last["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_usage_reports_zero_cached_tokens_when_none_were_found(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "ok"))
    with serve(client, tokenizer) as http:
        usage = http.post("/v1/completions", json={"prompt": "x"}).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_cached_tokens_count_each_prompt_once_like_prompt_tokens(tokenizer):
    """n choices of one prompt: the most any choice found (prompt_tokens counts the
    prompt once too); a batch of prompts: summed over the prompts."""
    per_request = {1: 0, 2: 6, 3: 4, 4: 8}  # request id -> cached tokens

    class PerRequest(ScriptedClient):
        def submit(self, request_id, *args, **kwargs):
            queue = super().submit(request_id, *args, **kwargs)
            outs = []
            while not queue.empty():
                outs.append(queue.get_nowait())
            for out in outs:
                queue.put_nowait(dataclasses.replace(out, cached_tokens=per_request[request_id]))
            return queue

    client = PerRequest(script_for(tokenizer, "ok"))
    with serve(client, tokenizer) as http:
        usage = http.post("/v1/completions", json={"prompt": [PROMPT_A, PROMPT_B], "n": 2}).json()[
            "usage"
        ]
    # Prompt 0: requests 1 and 2 (max 6); prompt 1: requests 3 and 4 (max 8).
    assert usage["prompt_tokens_details"]["cached_tokens"] == 6 + 8
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
