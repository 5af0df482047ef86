"""scripts/bench_prefix_cache.py's pure parts: new-token arithmetic, percentiles, the
figures and goals of the JSON line, usage parsing and the SSE client (no server)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from scripts.bench_prefix_cache import (
    CONFIGS,
    Chat,
    Record,
    TextSource,
    common_prefix_len,
    figures,
    fill_usage,
    new_tokens,
    parse_args,
    percentile,
    stream_chat,
    summarize,
    table,
)


def test_common_prefix_len():
    assert common_prefix_len([], [1, 2]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_len([1, 2, 3], [1, 2]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([1, 9, 3], [1, 2, 3]) == 1
    assert common_prefix_len([0], [1]) == 0


def test_new_tokens_is_the_prompt_beyond_the_previous_prompt_plus_output():
    # Turn 1: no previous turn, the whole prompt is new.
    assert new_tokens([1, 2, 3], None) == 3
    # Previous prompt 1..4 and output 5, 6; the new prompt resends them and adds 7, 8.
    assert new_tokens([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4], [5, 6]) == 2
    # A re-tokenized reply that differs from the output at its second token: the
    # common prefix stops there, so the rest of the reply counts as new.
    assert new_tokens([1, 2, 3, 4, 5, 60, 7, 8], [1, 2, 3, 4], [5, 6]) == 3
    # Nothing shared at all.
    assert new_tokens([9, 9], [1, 2], [3]) == 2
    # A prompt that is a prefix of the previous prompt + output has nothing new.
    assert new_tokens([1, 2, 3], [1, 2], [3, 4]) == 0


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile([4, 1, 3, 2], 100) == 4
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)


def _records(ttft_on_later: float, cached: bool = True) -> list[Record]:
    """Two users x 3 turns, and 4 shared requests, with made-up figures."""
    out = []
    for user in range(2):
        out.append(Record("multiturn", user, 1, 200.0, 300, 0 if cached else None, 8, 300))
        for turn in (2, 3):
            prompt = 300 + 80 * (turn - 1)
            cache = prompt - 70 if cached else None
            out.append(Record("multiturn", user, turn, ttft_on_later, prompt, cache, 8, 60))
    for i in range(4):
        cache = 1000 if cached and i else (0 if cached else None)
        out.append(Record("shared", i, 1, 50.0 + i, 1020, cache, 4))
    return out


def test_summarize_sums_and_the_ratio():
    s = summarize([r for r in _records(20.0) if r.workload == "multiturn" and r.turn > 1])
    assert s["requests"] == 4 and s["errors"] == 0
    assert s["prompt_tokens"] == 2 * (380 + 460)
    assert s["computed_tokens"] == 4 * 70 and s["new_tokens"] == 4 * 60
    assert s["computed_over_new"] == pytest.approx(70 / 60, abs=1e-3)
    assert s["cached_tokens_reported"] is True
    assert s["ttft_ms_p50"] == 20.0


def test_missing_cached_tokens_count_as_zero_and_are_flagged():
    s = summarize([r for r in _records(20.0, cached=False) if r.workload == "shared"])
    assert s["cached_tokens"] == 0 and s["cached_tokens_reported"] is False
    assert s["computed_tokens"] == s["prompt_tokens"] == 4 * 1020
    assert s["new_tokens"] is None and s["computed_over_new"] is None


def test_failed_requests_are_counted_not_summed():
    records = _records(20.0)
    records[1].error = "HTTP 500: boom"
    s = summarize([r for r in records if r.workload == "multiturn" and r.turn > 1])
    assert s["requests"] == 4 and s["errors"] == 1 and s["new_tokens"] == 3 * 60


def test_the_json_line_has_every_flat_key_and_the_goals():
    flat = figures({"cache_on": _records(20.0), "cache_off": _records(100.0, cached=False)})
    json.loads(json.dumps(flat))  # one JSON object, every value serializable
    assert flat["multiturn_ttft_ms_p50_cache_on"] == 20.0
    assert flat["multiturn_ttft_ms_p50_cache_off"] == 100.0
    assert flat["multiturn_ttft_p50_speedup"] == 5.0
    assert flat["multiturn_prompt_tokens_computed_over_new"] == pytest.approx(1.167)
    assert flat["goal_multiturn_computed_over_new_met"] is True
    assert flat["goal_multiturn_ttft_speedup_met"] is True
    for group in ("multiturn", "multiturn_turn1", "shared"):
        for config in CONFIGS:
            for fig in ("ttft_ms_p50", "ttft_ms_p99", "prompt_tokens", "cached_tokens",
                        "computed_tokens", "requests"):  # fmt: skip
                assert f"{group}_{fig}_{config}" in flat
    assert flat["shared_ttft_ms_p50_cache_on"] == pytest.approx(51.5)
    assert flat["shared_computed_tokens_cache_on"] == 4 * 1020 - 3000
    assert flat["multiturn_turn1_ttft_ms_p50_cache_on"] == 200.0
    assert flat["server_error_cache_on"] == flat["server_error_cache_off"] == ""
    text = table(flat)
    assert text.count("NOT met") == 0 and "multi-turn turns>=2" in text


def test_goals_not_met():
    # Too little speedup, and computed/new far above 1.2 without cached tokens.
    flat = figures({"cache_on": _records(60.0, cached=False), "cache_off": _records(100.0)})
    assert flat["multiturn_ttft_p50_speedup"] == pytest.approx(1.667)
    assert flat["goal_multiturn_ttft_speedup_met"] is False
    assert flat["multiturn_prompt_tokens_computed_over_new"] > 1.2
    assert flat["goal_multiturn_computed_over_new_met"] is False
    text = table(flat)
    assert text.count("NOT met") == 2
    assert "not reported by the server; counted as 0" in text


def test_a_server_that_failed_to_start_gives_nulls_and_its_error():
    err = "flare run exited with code 2: unrecognized arguments: --no-enable-prefix-caching"
    flat = figures({"cache_on": _records(20.0), "cache_off": None}, {"cache_off": err})
    assert flat["multiturn_ttft_ms_p50_cache_off"] is None
    assert flat["shared_ttft_ms_p99_cache_off"] is None
    assert flat["multiturn_ttft_p50_speedup"] is None
    assert flat["goal_multiturn_ttft_speedup_met"] is False
    assert flat["server_error_cache_off"] == err
    json.loads(json.dumps(flat))
    text = table(flat)
    assert "server failed" in text and "--no-enable-prefix-caching" in text


def test_fill_usage_with_and_without_details():
    r = Record("shared", 0, 1)
    fill_usage(r, {"prompt_tokens": 10, "completion_tokens": 3})
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (10, 3, None)
    fill_usage(r, {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}})
    assert r.cached_tokens == 8 and r.computed_tokens == 2
    fill_usage(r, {"prompt_tokens": 10, "prompt_tokens_details": None})
    assert r.cached_tokens is None and r.computed_tokens == 10


def test_stream_chat_times_the_first_content_chunk_and_reads_usage():
    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    usage = {"prompt_tokens": 5, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    body = (
        sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        + sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
        + sse({"choices": [{"index": 0, "delta": {"content": "lo"}}]})
        + sse({"choices": [], "usage": usage})
        + "data: [DONE]\n\n"
    )

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await stream_chat(http, "http://test", {"messages": []})

    ttft, text, got = asyncio.run(go())
    assert ttft is not None and ttft >= 0
    assert text == "Hello"
    assert got == usage


def test_stream_chat_raises_on_an_http_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad"}})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await stream_chat(http, "http://test", {"messages": []})

    with pytest.raises(RuntimeError, match="HTTP 400"):
        asyncio.run(go())


def test_text_source_hands_out_distinct_pieces_of_at_least_n_tokens():
    src = TextSource(lambda t: len(t.split()))  # a "token" per word
    a, b = src.take(5), src.take(5)
    assert len(a.split()) == 5 and len(b.split()) == 5 and a != b


def test_chat_renders_and_encodes_as_the_server_does():
    from runtime.frontend.protocol.chat_completions import parse_chat
    from runtime.frontend.protocol.requests import ServingLimits
    from runtime.ranks.model import default_model_dir

    chat = Chat(default_model_dir())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    limits = ServingLimits("m", chat.tokenizer.vocab_size, 4096)
    req = parse_chat({"model": "m", "messages": messages}, limits, chat.tokenizer, chat.template)
    assert chat.prompt_ids(messages) == list(req.prompt_token_ids)


def test_quick_and_config_flags():
    args = parse_args(["--quick"])
    assert (args.users, args.turns, args.shared_users) == (2, 2, 4)
    assert args.configs == ["cache_on", "cache_off"]
    assert parse_args(["--configs", "cache_off"]).configs == ["cache_off"]
    with pytest.raises(SystemExit):
        parse_args(["--configs", "warm"])
