"""The load generator against a fake OpenAI-compatible server, plus its pure parts
(workload generation, arrival schedule, report math) on hand-built inputs.

The fake server streams ``max_tokens`` chunks with a known first-chunk delay and
gap between chunks, so counts must match exactly and latencies are bounded below
by the sleeps (upper bounds are generous: they only catch gross errors).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import math
import random
import re
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from runtime.cli.commands.bench import main
from runtime.loadgen import progress
from runtime.loadgen.client import ClientConfig, RequestRecord, run_benchmark
from runtime.loadgen.progress import ProgressLines
from runtime.loadgen.report import format_table, percentile, summarize
from runtime.loadgen.workload import (
    EMBEDDED_TOKENS_PER_WORD,
    TOKEN_ID_RANGE,
    WorkloadSpec,
    arrival_offsets,
    build_requests,
    parse_distribution,
    token_id_range_for,
)

MODEL = "fake-model"


@dataclass
class FakeBehaviour:
    """How the fake server answers its n-th request (counted from 0 on arrival)."""

    first_delay: float = 0.05
    gap: float = 0.02
    slow_first: frozenset[int] = frozenset()  # these requests wait slow_delay first
    slow_gap: frozenset[int] = frozenset()  # these requests use slow_gap_s between chunks
    slow_delay: float = 0.4
    slow_gap_s: float = 0.1
    fail: frozenset[int] = frozenset()
    usage: bool = True
    tokens_per_chunk: int = 1  # what usage claims per chunk
    vocab_size: int | None = None  # flare's model card carries it; vLLM's does not
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


def _fake_app(state: dict[str, FakeBehaviour]) -> Starlette:
    async def models(_: Request) -> JSONResponse:
        card: dict[str, Any] = {"id": MODEL, "object": "model"}
        if state["now"].vocab_size is not None:
            card["vocab_size"] = state["now"].vocab_size
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(request: Request) -> JSONResponse | StreamingResponse:
        behaviour = state["now"]
        body = await request.json()
        n = len(behaviour.received)
        behaviour.received.append(body)
        behaviour.headers.append(dict(request.headers))
        if n in behaviour.fail:
            error = {"message": f"fake failure {n}", "type": "BadRequestError", "code": 400}
            return JSONResponse({"object": "error", **error, "error": error}, status_code=400)
        chat = request.url.path.endswith("/chat/completions")
        first = behaviour.slow_delay if n in behaviour.slow_first else behaviour.first_delay
        gap = behaviour.slow_gap_s if n in behaviour.slow_gap else behaviour.gap
        count = body["max_tokens"]

        def chunk(text: str | None, usage: dict | None = None) -> str:
            if text is None:
                choices = []
            elif chat:
                choices = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
            else:
                choices = [{"index": 0, "text": text, "finish_reason": None}]
            payload = {"id": f"req-{n}", "model": MODEL, "choices": choices, "usage": usage}
            return f"data: {json.dumps(payload)}\n\n"

        async def stream() -> Any:
            if chat:  # the role-only opening chunk real servers send: no output
                yield chunk("")
            await asyncio.sleep(first)
            for i in range(count):
                if i:
                    await asyncio.sleep(gap)
                yield chunk(f" w{i}")
            if behaviour.usage and body.get("stream_options", {}).get("include_usage"):
                tokens = count * behaviour.tokens_per_chunk
                yield chunk(None, {"prompt_tokens": 7, "completion_tokens": tokens})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, dict[str, FakeBehaviour]]]:
    state = {"now": FakeBehaviour()}
    config = uvicorn.Config(
        _fake_app(state), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def fake(server) -> Iterator[tuple[str, FakeBehaviour]]:
    """The server's URL and a fresh behaviour the test may change before sending."""
    url, state = server
    state["now"] = FakeBehaviour()
    yield url, state["now"]


def _run(url: str, argv: list[str], capsys) -> tuple[int, str, dict]:
    code = main(["--base-url", url, "--seed", "3", *argv])
    out = capsys.readouterr().out
    return code, out, json.loads(out.strip().splitlines()[-1])


# --- end to end against the fake server --------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_counts_and_latencies_match_what_the_server_sent(fake, capsys, endpoint):
    url, behaviour = fake
    argv = ["--endpoint", endpoint, "--num-requests", "6", "--concurrency", "3"]
    argv += ["--output-len", "uniform:3:8", "--ignore-eos", "--api-key", "sekrit"]
    if endpoint == "completions":
        argv += ["--prompt-kind", "token-ids", "--prompt-len", "16"]
    code, _, result = _run(url, argv, capsys)
    assert code == 0
    sent = [body["max_tokens"] for body in behaviour.received]
    assert len(sent) == 6 and result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == sum(sent)
    assert result["total_input_tokens"] == 6 * 7  # the server's usage figure
    for body, headers in zip(behaviour.received, behaviour.headers):
        assert body["model"] == MODEL  # found through GET /v1/models
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True
        if endpoint == "chat":
            assert body["messages"][0]["role"] == "user"
        else:
            assert len(body["prompt"]) == 16 and all(isinstance(t, int) for t in body["prompt"])
        assert headers["authorization"] == "Bearer sekrit"
    first_ms, gap_ms = 1000 * behaviour.first_delay, 1000 * behaviour.gap
    assert first_ms <= result["mean_ttft_ms"] <= first_ms + 500
    # Chunk arrivals can bunch by a little on a busy machine, never by half a gap.
    assert 0.5 * gap_ms <= result["median_itl_ms"] <= gap_ms + 250
    assert 0.5 * gap_ms <= result["mean_tpot_ms"] <= gap_ms + 250
    # The server slept first_delay + (n-1) gaps before its last chunk: a hard bound.
    assert result["mean_e2el_ms"] >= first_ms + gap_ms * (statistics.fmean(sent) - 1)
    assert result["duration_s"] > 0
    assert result["request_throughput"] == pytest.approx(6 / result["duration_s"])


def test_usage_is_preferred_and_chunks_are_counted_without_it(fake):
    url, behaviour = fake
    requests = build_requests(
        WorkloadSpec(4, parse_distribution("5"), parse_distribution("4"), seed=1)
    )
    config = ClientConfig(base_url=url, model=MODEL)
    behaviour.tokens_per_chunk = 2  # usage says twice the chunks
    records, _ = asyncio.run(run_benchmark(config, requests, [0.0] * 4))
    assert [r.output_tokens for r in records] == [8] * 4
    assert all(len(r.chunk_times) == 4 for r in records)
    behaviour.usage = False
    records, _ = asyncio.run(run_benchmark(config, requests, [0.0] * 4))
    assert [r.output_tokens for r in records] == [4] * 4
    assert [r.prompt_tokens for r in records] == [5] * 4  # the words sent


def test_failures_are_counted_with_their_error_text(fake, capsys, tmp_path):
    url, behaviour = fake
    behaviour.fail = frozenset({1, 3})
    out_path = tmp_path / "result.json"
    argv = ["--num-requests", "5", "--concurrency", "1", "--output-len", "3"]
    code, out, result = _run(url, [*argv, "--result-json", str(out_path)], capsys)
    assert code == 0
    assert result["completed"] == 3 and result["failed"] == 2
    assert result["errors"] == {"HTTP 400: fake failure 1": 1, "HTTP 400: fake failure 3": 1}
    assert result["total_output_tokens"] == 9  # failed requests count no tokens
    assert "HTTP 400: fake failure 3" in out
    saved = json.loads(out_path.read_text())
    assert [r["error"] for r in saved["requests"]] == [
        "",
        "HTTP 400: fake failure 1",
        "",
        "HTTP 400: fake failure 3",
        "",
    ]
    assert {k: v for k, v in saved.items() if k != "requests"} == result


def test_all_failing_exits_nonzero(fake, capsys):
    url, behaviour = fake
    behaviour.fail = frozenset(range(3))
    code, _, result = _run(url, ["--num-requests", "3", "--output-len", "2"], capsys)
    assert code == 1 and result["failed"] == 3 and result["mean_ttft_ms"] is None


def test_goodput_counts_only_requests_meeting_both_slos(fake, capsys):
    url, behaviour = fake
    behaviour.first_delay, behaviour.gap = 0.01, 0.005
    behaviour.slow_first = frozenset({1, 4})  # 400 ms TTFT > 200 ms SLO
    behaviour.slow_gap = frozenset({2})  # 100 ms TPOT > 50 ms SLO
    argv = ["--num-requests", "6", "--concurrency", "1", "--output-len", "4"]
    argv += ["--ttft-slo-ms", "200", "--tpot-slo-ms", "50"]
    code, _, result = _run(url, argv, capsys)
    assert code == 0 and result["completed"] == 6
    assert result["good_requests"] == 3
    assert result["request_goodput"] == pytest.approx(3 / result["duration_s"])
    assert result["p99_ttft_ms"] >= 400


def test_every_printed_figure_is_in_the_last_json_line(fake, capsys):
    url, behaviour = fake
    behaviour.fail = frozenset({0})
    argv = ["--num-requests", "4", "--request-rate", "50", "--output-len", "3"]
    argv += ["--ttft-slo-ms", "1000"]
    _, out, result = _run(url, argv, capsys)
    numbers = [v for v in result.values() if isinstance(v, (int, float))]
    printed = 0
    for line in out.strip().splitlines()[:-1]:
        match = re.fullmatch(r"(.+?):\s+(-?\d+(?:\.\d+)?)", line)
        if match:
            printed += 1
            value = float(match.group(2))
            assert any(abs(value - n) <= 0.005 + 1e-9 for n in numbers), line
    assert printed >= 20
    assert result["config"]["request_rate"] == "50.0"
    assert result["config"]["model"] == MODEL


def test_without_a_terminal_progress_is_a_line_every_few_seconds(fake, capsys, monkeypatch):
    """stderr is no terminal under pytest: lines, not a bar; here one every 50 ms."""
    url, behaviour = fake
    behaviour.first_delay, behaviour.gap = 0.05, 0.05
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.05)
    argv = ["--num-requests", "4", "--concurrency", "2", "--output-len", "4"]
    assert main(["--base-url", url, "--seed", "3", *argv]) == 0
    err = capsys.readouterr().err
    pattern = r"flare bench: (\d+)/4 requests done \(0 failed\), [\d.]+ req/s, [\d.]+ s elapsed"
    done = [int(re.fullmatch(pattern, line).group(1)) for line in err.splitlines()]
    assert len(done) >= 3 and done[-1] == 4 and done == sorted(done)
    assert "\r" not in err  # no bar


def test_progress_lines_count_and_rate_on_a_given_clock():
    now = [100.0]
    stream = io.StringIO()
    lines = ProgressLines(10, stream, interval_s=5.0, clock=lambda: now[0])
    ok = RequestRecord(0, 0.0, 1.0, (0.5,), 3, 2)
    lines.update(ok)
    lines.update(RequestRecord(1, 0.0, 1.0, (), 3, 0, error="HTTP 500"))
    now[0] += 4.0
    lines.line()
    assert stream.getvalue() == (
        "flare bench: 2/10 requests done (1 failed), 0.5 req/s, 4.0 s elapsed\n"
    )


def test_an_unreachable_server_without_model_fails_cleanly(capsys):
    assert main(["--base-url", "http://127.0.0.1:9", "--timeout", "2"]) == 1
    assert "/v1/models" in capsys.readouterr().err


# --- token-id prompts and the served vocabulary --------------------------------

TOKEN_ARGS = ["--prompt-kind", "token-ids", "--prompt-len", "40", "--num-requests", "5",
              "--output-len", "2"]  # fmt: skip


def sent_ids(behaviour: FakeBehaviour) -> set[int]:
    return {t for body in behaviour.received for t in body["prompt"]}


def test_token_id_prompts_stay_inside_the_served_vocabulary(fake, capsys):
    url, behaviour = fake
    behaviour.vocab_size = 512  # the embedded default model's
    code, _, result = _run(url, TOKEN_ARGS, capsys)
    assert code == 0 and result["completed"] == 5
    ids = sent_ids(behaviour)
    assert min(ids) >= 51 and max(ids) < 460 and len(ids) > 100
    assert result["config"]["token_id_range"] == "51:460"


def test_a_tokenizer_gives_the_vocabulary_when_the_server_does_not(fake, capsys):
    from runtime.ranks.model import default_model_dir

    url, behaviour = fake  # no vocab_size in the card, as vLLM's
    code, _, result = _run(url, [*TOKEN_ARGS, "--tokenizer", str(default_model_dir())], capsys)
    assert code == 0 and max(sent_ids(behaviour)) < 460
    assert result["config"]["token_id_range"] == "51:460"
    code, _, _ = _run(
        url, [*TOKEN_ARGS, "--tokenizer", str(default_model_dir() / "tokenizer.json")], capsys
    )
    assert code == 0


def test_an_unknown_vocabulary_falls_back_to_the_common_range_and_says_so(fake, capsys):
    url, behaviour = fake
    code = main(["--base-url", url, *TOKEN_ARGS])
    captured = capsys.readouterr()
    assert code == 0 and "vocabulary size is unknown" in captured.err
    assert min(sent_ids(behaviour)) >= TOKEN_ID_RANGE[0]
    assert max(sent_ids(behaviour)) < TOKEN_ID_RANGE[1]


def test_a_token_id_range_past_the_served_vocabulary_fails_naming_the_flag(fake, capsys):
    url, behaviour = fake
    behaviour.vocab_size = 512
    with pytest.raises(SystemExit) as exit_info:
        main(["--base-url", url, *TOKEN_ARGS, "--token-id-range", "1000:30000"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --token-id-range" in err and "512" in err
    assert behaviour.received == []
    code, _, _ = _run(url, [*TOKEN_ARGS, "--token-id-range", "3:9"], capsys)
    assert code == 0 and sent_ids(behaviour) <= set(range(3, 9))


def test_token_id_range_for_common_vocabularies():
    assert token_id_range_for(512) == (51, 460)
    assert token_id_range_for(32000) == (1000, 28800)
    assert token_id_range_for(128256) == (1000, 115430)
    assert token_id_range_for(2) == (0, 1)
    with pytest.raises(ValueError):
        token_id_range_for(1)


def test_the_stated_tokens_per_word_is_measured_on_the_embedded_model():
    """The help text's figure: words prompts against the embedded default model."""
    from runtime.frontend.tokenizer import ModelTokenizer
    from runtime.ranks.model import default_model_dir

    tokenizer = ModelTokenizer.from_dir(default_model_dir())
    spec = WorkloadSpec(200, parse_distribution("128"), parse_distribution("1"), seed=0)
    requests = build_requests(spec)
    tokens = sum(len(tokenizer.encode(r.prompt)) for r in requests)
    words = sum(r.prompt_len for r in requests)
    assert tokens / words == pytest.approx(EMBEDDED_TOKENS_PER_WORD, abs=0.01)


# --- argument errors name the flag -------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--prompt-len", "normal:abc:3"], "--prompt-len"),
        (["--output-len", "uniform:9:2"], "--output-len"),
        (["--prompt-len", "0"], "--prompt-len"),
        (["--request-rate", "-1"], "--request-rate"),
        (["--concurrency", "0"], "--concurrency"),
        (["--num-requests", "many"], "--num-requests"),
        (["--ttft-slo-ms", "0"], "--ttft-slo-ms"),
        (["--base-url", "localhost:8000"], "--base-url"),
        (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file"),
        (["--endpoint", "chat", "--prompt-kind", "token-ids"], "--prompt-kind"),
        (["--request-rate", "2", "--concurrency", "2"], "--concurrency"),
        (["--token-id-range", "9:3"], "--token-id-range"),
        (["--token-id-range", "512"], "--token-id-range"),
        (["--tokenizer", "/nonexistent/dir"], "--tokenizer"),
    ],
)
def test_invalid_flags_fail_fast_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "m", "--base-url", "http://127.0.0.1:9", *argv])
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


# --- workload and arrivals ------------------------------------------------------


def test_distributions_parse_sample_and_round_trip():
    rng = random.Random(0)
    assert {parse_distribution("7").sample(rng) for _ in range(20)} == {7}
    uniform = [parse_distribution("uniform:3:6").sample(rng) for _ in range(500)]
    assert set(uniform) == {3, 4, 5, 6}
    clamped = [parse_distribution("normal:100:80:50:150").sample(rng) for _ in range(2000)]
    assert min(clamped) == 50 and max(clamped) == 150
    assert min(parse_distribution("normal:3:10").sample(rng) for _ in range(500)) == 1
    for text in ["12", "uniform:1:9", "normal:128:32", "normal:128.5:3:2:900"]:
        assert str(parse_distribution(text)) == text


def test_workload_is_seeded_and_token_prompts_have_the_asked_length():
    lengths = parse_distribution("uniform:5:20")
    spec = WorkloadSpec(30, lengths, parse_distribution("normal:10:3"), "token-ids", seed=4)
    first, again = build_requests(spec), build_requests(spec)
    assert first == again
    assert first != build_requests(WorkloadSpec(30, lengths, spec.output_len, "token-ids"))
    for request in first:
        assert len(request.prompt) == request.prompt_len
        assert all(TOKEN_ID_RANGE[0] <= t < TOKEN_ID_RANGE[1] for t in request.prompt)
    narrow = WorkloadSpec(30, lengths, spec.output_len, "token-ids", token_id_range=(3, 7))
    assert {t for r in build_requests(narrow) for t in r.prompt} == {3, 4, 5, 6}
    words = build_requests(WorkloadSpec(5, lengths, spec.output_len, seed=4))
    assert all(len(r.prompt.split()) == r.prompt_len for r in words)
    explicit = WorkloadSpec(3, lengths, spec.output_len, prompts=("a b", "c"))
    assert [r.prompt for r in build_requests(explicit)] == ["a b", "c", "a b"]


def test_poisson_arrivals_are_seeded_with_the_right_rate():
    offsets = arrival_offsets(20000, 8.0, seed=11)
    assert offsets == arrival_offsets(20000, 8.0, seed=11)
    assert offsets != arrival_offsets(20000, 8.0, seed=12)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.03)
    # Exponential gaps: deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    with pytest.raises(ValueError):
        arrival_offsets(4, 0)


# --- report math on hand-built records --------------------------------------------


def test_percentile_interpolates_between_ranks():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([4.0], 99) == 4.0
    assert percentile([1.0, 3.0], 50) == 2.0


def test_report_math_on_known_timestamps():
    records = [
        # TTFT 100 ms, chunks 100 and 200 ms apart, TPOT (0.5-0.1)/2 = 200 ms.
        RequestRecord(0, 10.0, 10.5, (10.1, 10.2, 10.4), prompt_tokens=5, output_tokens=3),
        # TTFT 300 ms, one token: no TPOT, no ITL.
        RequestRecord(1, 11.0, 11.3, (11.3,), prompt_tokens=4, output_tokens=1),
        # TTFT 50 ms, usage says 5 tokens in 2 chunks: TPOT (0.45-0.05)/4 = 100 ms.
        RequestRecord(2, 12.0, 12.45, (12.05, 12.45), prompt_tokens=6, output_tokens=5),
        RequestRecord(3, 13.0, 13.1, (), prompt_tokens=3, output_tokens=0, error="HTTP 500: x"),
    ]
    s = summarize(records, duration_s=4.0, ttft_slo_ms=200, tpot_slo_ms=150)
    assert (s["completed"], s["failed"], s["errors"]) == (3, 1, {"HTTP 500: x": 1})
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (15, 9)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(9 / 4)
    assert s["total_token_throughput"] == pytest.approx(24 / 4)
    assert s["mean_ttft_ms"] == pytest.approx(150)
    assert s["median_ttft_ms"] == pytest.approx(100)
    assert s["p99_ttft_ms"] == pytest.approx(296)  # 100 + 0.98 * (300 - 100)
    assert s["mean_tpot_ms"] == pytest.approx(150)
    assert s["p99_tpot_ms"] == pytest.approx(199)
    assert s["mean_itl_ms"] == pytest.approx((100 + 200 + 400) / 3)
    assert s["median_itl_ms"] == pytest.approx(200)
    assert s["mean_e2el_ms"] == pytest.approx((500 + 300 + 450) / 3)
    # Request 0 misses the TPOT SLO, request 1 the TTFT SLO; request 2 meets both.
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(0.25)
    only_ttft = summarize(records, 4.0, ttft_slo_ms=200)
    assert only_ttft["good_requests"] == 2  # one-token request 1 still misses TTFT
    no_slo = summarize(records, 4.0)
    assert no_slo["good_requests"] is None and no_slo["request_goodput"] is None
    table = format_table(s)
    assert "HTTP 500: x" in table and "Mean TTFT (ms):" in table and "150.00" in table
