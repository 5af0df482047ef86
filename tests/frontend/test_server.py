"""The HTTP API end to end: `flare run` as a real process tree (frontend,
coordinator, rank) on a free loopback port, driven by the `openai` client and
httpx: completions and chat, streaming, sampling controls, stop handling,
logprobs, metrics, every bad input, the API key.  The spec's scheduling
scenarios are tests/server/test_scheduler.py."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.background import BackgroundStarts
from tests.support.server import Server, words

pytestmark = pytest.mark.process

# Every test runs against ordinary decoding and against fixed-width speculative
# rounds of the embedded draft (bursts of up to 4 tokens: stops, logprobs and
# lengths inside a burst).
MODES = {
    # 39 forward programs (11 of them packed prefills, 18 scored prefills) and 6
    # state programs
    "ordinary": ((), 45),
    "speculative": (
        ("--draft-model", "default", "--num-speculative-tokens", "3",
         "--speculative-selection", "fixed"),
        48,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest) -> Iterator[BackgroundStarts]:
    """The servers of the modes this module's selected tests run in, started together
    as the first of them is needed (their start-ups overlap)."""
    modes = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and callspec is not None:
            modes.add(callspec.params.get("server"))
    makers = {
        mode: (lambda flags=flags: Server(*flags), Server.stop)
        for mode, (flags, _) in MODES.items()
    }
    starts = BackgroundStarts(makers, Counter(mode for mode in MODES if mode in modes))
    yield starts
    starts.close()


@pytest.fixture(scope="module", params=list(MODES))
def server(request: pytest.FixtureRequest, started: BackgroundStarts) -> Iterator[Server]:
    _, programs = MODES[request.param]
    s = started.take(request.param)
    s.mode = request.param
    # One summary line once listening: model, TP, catalog size, address.
    # (The forward + state split: runtime.catalog.describe_counts.)
    line = re.compile(rf"TP=1, catalog of {programs} programs \(\d+ forward \+ \d+ state\), "
                      rf"at http://127\.0\.0\.1:{s.port}/v1")  # fmt: skip
    deadline = time.monotonic() + 10
    while not line.search(s.output()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line.search(s.output()), s.output()
    yield s
    assert s.stop() == 0
    # The coordinator and rank processes went with it.
    out = subprocess.run(["pgrep", "-f", f"api-requests.*{s.port}"], capture_output=True)
    assert out.stdout == b""


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# ------------------------------------------------------------------ basics


def test_models_health_and_a_greedy_completion(server, client, model):
    assert httpx.get(f"{server.base}/health").status_code == 200
    out = client.completions.create(model=model, prompt="Hello there", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    # Streaming gives the same greedy text, then [DONE].
    chunks = list(client.completions.create(model=model, prompt="Hello there", max_tokens=8,
                  temperature=0, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats_and_n_choices_differ(server, client, model):
    kwargs = dict(model=model, prompt=words(20), max_tokens=12, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})  # fmt: skip
    a = client.completions.create(**kwargs, n=3)
    b = client.completions.create(**kwargs, n=3)
    if server.mode == "ordinary":
        # Speculative rounds read the seeded stream per verified position and verify
        # against batch-dependent rounding, so a seed repeats only without them
        # (docs/speculation.md): equality is tested with speculation off.
        assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1  # seeds seed, seed+1, seed+2
    assert a.usage.completion_tokens == 36


def test_batched_prompts_number_choices_prompt_major(client, model):
    prompts = [words(6, 1), words(9, 2)]
    kwargs = dict(model=model, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=prompts, n=2, **kwargs)
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in batch.choices}
    for i, single in enumerate(alone):  # prompt i's choices are 2i and 2i + 1 (greedy)
        assert by_index[2 * i] == by_index[2 * i + 1] == single.choices[0].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 20
    chunks = list(client.completions.create(prompt=prompts, stream=True, **kwargs))
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == {0: alone[0].choices[0].text, 1: alone[1].choices[0].text}


def test_chat_completion_streams_role_then_content_with_usage(client, model):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_a_shared_system_prompt_is_found_in_the_prefix_cache(server, client, model):
    """Two chats sharing a ~300-token system prompt: the second finds it cached
    (usage.prompt_tokens_details.cached_tokens), the first found nothing."""
    system = {"role": "system", "content": words(300, 11)}
    salt = {"cache_salt": f"e2e-{server.mode}"}  # no other test's pages share this salt
    usages = []
    for question in ("What comes next?", "Say it again, shorter."):
        out = client.chat.completions.create(
            model=model, messages=[system, {"role": "user", "content": question}],
            max_tokens=4, temperature=0, extra_body={"ignore_eos": True, **salt},
        )  # fmt: skip
        usages.append(out.usage)
    first, second = usages
    assert first.prompt_tokens > 300 and second.prompt_tokens > 300
    assert first.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.prompt_tokens_details.cached_tokens < second.prompt_tokens
    # Streaming reports it in the final usage chunk too.
    chunks = list(client.chat.completions.create(
        model=model, messages=[system, {"role": "user", "content": "Once more."}],
        max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **salt},
    ))  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_stop_strings_and_stop_token_ids_end_the_choice(client, model):
    prompt = "The value of the expression"
    base = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    text = base.choices[0].text
    # A three-character stop string first seen some way into the text.
    at = next(
        i for i in range(3, len(text) - 2)
        if text[i : i + 3].strip() and text[i : i + 3] not in text[: i + 2]
    )  # fmt: skip
    stop = text[at : at + 3]
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                    temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.usage.completion_tokens < 24


def test_stop_token_ids_end_the_choice_and_count_the_stop_token(server, client, model):
    every = list(range(512))  # the embedded model's vocabulary
    body = {"prompt": words(12, 3), "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = server.post("/v1/completions", {**body, "max_tokens": 3}).json()
    # Every token is a stop token: the first one ends the choice, unshown but counted.
    first = server.post("/v1/completions", {**body, "stop_token_ids": every}).json()
    assert first["choices"][0]["finish_reason"] == "stop"
    assert first["choices"][0]["text"] == "" and first["usage"]["completion_tokens"] == 1
    # With min_tokens 3, stop tokens count only from the fourth token on.
    later = server.post("/v1/completions", {**body, "stop_token_ids": every, "min_tokens": 3})
    later = later.json()
    assert later["usage"]["completion_tokens"] == 4
    assert later["choices"][0]["text"] == plain["choices"][0]["text"]


def test_logprobs_are_sorted_and_the_sampled_one_is_reported(client, model):
    out = client.completions.create(model=model, prompt=words(10), max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        values = list(top.values())
        assert 1 <= len(values) <= 3 and values == sorted(values, reverse=True)
        assert sampled <= 0 and abs(sampled - values[0]) < 1e-4  # greedy takes the best
    assert "".join(lp.tokens) == out.choices[0].text or len(out.choices[0].text) > 0
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def tokenize(server, model: str, prompt, special: bool = True) -> list[int]:
    body = {"model": model, "prompt": prompt, "add_special_tokens": special}
    return httpx.post(f"{server.base}/tokenize", json=body).json()["tokens"]


def test_echo_with_logprobs_scores_the_prompt_and_max_tokens_zero_returns_it(server, client, model):
    """Scored prefill through the API (docs/scored-prefill.md): ``echo`` returns the
    prompt before the completion, its tokens' log probabilities first (the first
    token's null); the score of a token the model generated equals the log
    probability generation reported for it; ``max_tokens: 0`` returns the prompt
    alone, streamed too (the echoed prompt in the first chunk)."""
    prompt = words(12, 7)
    ids = tokenize(server, model, prompt)
    n = len(ids)
    kw = dict(model=model, temperature=0, extra_body={"ignore_eos": True})
    gen = client.completions.create(prompt=ids, max_tokens=2, logprobs=3, **kw)
    generated = gen.choices[0].logprobs.token_logprobs
    out = client.completions.create(prompt=ids, max_tokens=2, echo=True, logprobs=3, **kw)
    choice, lp = out.choices[0], out.choices[0].logprobs
    assert choice.text.endswith(gen.choices[0].text) and len(choice.text) > len(gen.choices[0].text)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[n] == len(choice.text) - len(gen.choices[0].text)
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        values = list(top.values())
        assert value <= 0 and 1 <= len(values) <= 3 and values == sorted(values, reverse=True)
        assert value <= values[0] + 1e-4
    assert lp.token_logprobs[n:] == pytest.approx(generated, abs=1e-4)
    # The prompt followed by the generated tokens, scored alone (max_tokens 0): the
    # scored program's log probabilities of those tokens are generation's.
    first = gen.choices[0].logprobs
    tokens = tokenize(server, model, "".join(first.tokens), special=False)
    whole = client.completions.create(prompt=ids + tokens, max_tokens=0, echo=True, logprobs=3,
                                      **kw)  # fmt: skip
    scored = whole.choices[0].logprobs.token_logprobs
    assert whole.usage.completion_tokens == 0 and len(scored) == n + len(tokens)
    assert scored[:n] == pytest.approx(lp.token_logprobs[:n], abs=1e-4)
    if len(tokens) == 2:  # the text re-tokenizes to the generated ids
        assert scored[n:] == pytest.approx(generated, abs=1e-4)
    alone = client.completions.create(prompt=prompt, max_tokens=0, echo=True, **kw)
    assert alone.choices[0].text == prompt and alone.usage.completion_tokens == 0
    assert alone.choices[0].finish_reason == "length" and alone.choices[0].logprobs is None
    chunks = list(client.completions.create(prompt=ids, max_tokens=2, echo=True, stream=True,
                                            **kw))  # fmt: skip
    assert chunks[0].choices[0].text.startswith(choice.text[: lp.text_offset[n]])
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_prompt_logprobs_in_vllm_shape_also_for_a_cached_prefix(server, client, model):
    """vLLM's ``prompt_logprobs`` on both routes; a prompt whose prefix is cached
    gets its scores all the same (recomputed: cached_tokens stays 0 for it)."""
    prompt = words(40, 11)  # several 16-token pages
    ids = tokenize(server, model, prompt)
    salt = f"scored-{server.mode}"
    kw = dict(model=model, temperature=0, max_tokens=1)
    client.completions.create(prompt=ids, extra_body={"cache_salt": salt}, **kw)
    again = client.completions.create(prompt=ids, extra_body={"cache_salt": salt}, **kw)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix is cached
    body = {"prompt_logprobs": 2, "cache_salt": salt}
    out = client.completions.create(prompt=ids, extra_body=body, **kw)
    scores = out.choices[0].model_extra["prompt_logprobs"]
    assert len(scores) == len(ids) == out.usage.prompt_tokens and scores[0] is None
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # nothing came from the cache
    cold = client.completions.create(prompt=ids, extra_body={"prompt_logprobs": 2}, **kw)
    echo = client.completions.create(prompt=ids, echo=True, logprobs=2, **kw).choices[0].logprobs
    for position, (entry, fresh) in enumerate(zip(scores[1:], cold.choices[0].model_extra[
            "prompt_logprobs"][1:]), 1):  # fmt: skip
        token = entry[str(ids[position])]
        assert token["logprob"] == pytest.approx(echo.token_logprobs[position], abs=1e-4)
        assert token["logprob"] == pytest.approx(fresh[str(ids[position])]["logprob"], abs=1e-4)
        ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
        assert ranks == [1, 2] and all(e["decoded_token"] is not None for e in entry.values())
        assert token["rank"] is None or entry[str(ids[position])]["rank"] in (1, 2)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": prompt}], extra_body={"prompt_logprobs": 1}, **kw
    )
    chat_scores = chat.choices[0].model_extra["prompt_logprobs"]
    assert len(chat_scores) == chat.usage.prompt_tokens and chat_scores[0] is None
    assert all(len(entry) in (1, 2) for entry in chat_scores[1:])


def test_min_tokens_and_ignore_eos_give_exact_lengths(client, model):
    out = client.completions.create(model=model, prompt=words(8), max_tokens=10,
                                    extra_body={"min_tokens": 10})  # fmt: skip
    assert out.usage.completion_tokens == 10 and out.choices[0].finish_reason == "length"


# ------------------------------------------------------------------ metrics


def test_metrics_parse_and_move(server, client, model):
    before = server.metrics()
    client.completions.create(model=model, prompt=words(30), max_tokens=5,
                              extra_body={"ignore_eos": True})  # fmt: skip
    after = server.metrics()
    assert after["flare_generation_tokens_total"] - before["flare_generation_tokens_total"] == 5
    assert after["flare_prompt_tokens_total"] > before["flare_prompt_tokens_total"]
    assert after["flare_scheduler_executions_total:ordinary"] + after.get(
        "flare_scheduler_executions_total:discovery", 0
    ) > before["flare_scheduler_executions_total:ordinary"] + before.get(
        "flare_scheduler_executions_total:discovery", 0
    )
    assert after["flare_scheduler_execution_nanoseconds_total:ordinary"] > 0
    assert (
        after["flare_time_to_first_token_seconds_count"]
        > before["flare_time_to_first_token_seconds_count"]
    )
    assert "flare_speculative_executions_total" in after
    assert after["flare_kv_pages_total"] > 0
    assert any(k.startswith("flare_graph_estimated_duration_seconds") for k in after)


# ------------------------------------------------------------------ bad input


BAD = [
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5] * 5000, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5] * 4000, "max_tokens": 200}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "nan"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ("/v1/completions", [1, 2], 400, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_gets_an_openai_error_naming_the_field(server, path, body, status, param):
    if isinstance(body, dict) and body.get("temperature") == "nan":
        content = json.dumps({"prompt": "x", "temperature": float("nan")})
        response = httpx.post(f"{server.base}{path}", content=content,
                              headers={"content-type": "application/json"})  # fmt: skip
    else:
        response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_wrong_content_type_and_broken_json_are_4xx_and_the_server_stays_healthy(server):
    r = httpx.post(f"{server.base}/v1/completions", content=b"prompt=x",
                   headers={"content-type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert r.status_code == 415 and "error" in r.json()
    r = httpx.post(f"{server.base}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(f"{server.base}/health").status_code == 200


# ------------------------------------------------------------------ vLLM's API


def test_tokenize_detokenize_version_and_a_logit_bias_that_reaches_the_ranks(server):
    ids = server.post("/tokenize", {"prompt": "alpha beta"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] > 0
    text = server.post("/detokenize", {"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "alpha beta"
    assert httpx.get(f"{server.base}/version").json()["version"]
    # A bias of 100 on one token makes greedy decoding pick it every time.
    body = {"prompt": words(8), "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = server.post("/v1/completions", body).json()["choices"][0]["text"]
    biased = server.post("/v1/completions", {**body, "logit_bias": {"300": 100}}).json()
    expected = server.post("/detokenize", {"tokens": [300] * 5}).json()["prompt"]
    assert biased["choices"][0]["text"] == expected != plain
    r = server.post("/v1/completions", {**body, "logit_bias": {"512": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = server.post("/v1/completions", {**body, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
