"""The spec's HTTP scenarios against an idle service with four request slots and a
4096-token prefill capacity: concurrent long prompts, two and four decode streams,
a long prompt arriving during decode, short/long prompt contention, and
cancellation followed by slot reuse.  Complete responses, correct usage, no
stream starved.

By default the test starts `flare run` on the embedded model (CPU) three times:
ordinary decoding, fixed-width speculative rounds (copy proposals) and adaptive
speculation with the embedded draft (``MODES``), with any extra flags in
``FLARE_SCHEDULER_TEST_FLAGS``.  With
``FLARE_SCHEDULER_TEST_URL=http://HOST:PORT`` it drives that server instead
(e.g. a GPU deployment, in ordinary, fixed-width or adaptive speculative mode).
Run with ``-s`` to see each scenario's prompt/output token counts, client SSE
arrival gaps and server graph-counter deltas (SSE gaps are not device times).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shlex
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.server import Server, body, stream_times, words

pytestmark = pytest.mark.process

# Every scenario runs in ordinary decoding and in both speculative modes (issue
# 13): fixed-width rounds of copy proposals and adaptive selection with the
# embedded draft model.  A server given by URL runs in whatever mode it has.
MODES = {
    "ordinary": [],
    "fixed": ["--proposer", "copy", "--num-speculative-tokens", "3",
              "--speculative-selection", "fixed"],
    "adaptive": ["--draft-model", "default", "--num-speculative-tokens", "3"],
}  # fmt: skip
URL = os.environ.get("FLARE_SCHEDULER_TEST_URL")


@pytest.fixture(scope="module", params=["external"] if URL else list(MODES))
def server(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Server]:
    flags = shlex.split(os.environ.get("FLARE_SCHEDULER_TEST_FLAGS", ""))
    if URL:
        s = Server(url=URL)
    else:  # the plan trace explains a failed scenario (which frames ran meanwhile)
        trace = tmp_path_factory.mktemp("trace") / "plan.jsonl"
        s = Server(*MODES[request.param], "--trace", str(trace), *flags)
        s.trace = trace
    yield s
    assert s.stop() == 0


@pytest.fixture
def report(server: Server, request: pytest.FixtureRequest) -> Iterator[list]:
    """Collects (times, usage) per stream and prints the scenario's figures."""
    before = server.metrics()
    streams: list = []
    yield streams
    after = server.metrics()
    deltas = {
        k: after[k] - before.get(k, 0.0)
        for k in sorted(after)
        if k.startswith(("flare_frames_total:", "flare_scheduler_executions_total:"))
        and after[k] != before.get(k, 0.0)
    }
    print(f"\n{request.node.name}: graph-counter deltas {deltas}")
    for i, (times, usage) in enumerate(streams):
        gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
        gap = f"median {statistics.median(gaps):.1f} ms, max {max(gaps):.1f} ms" if gaps else "-"
        print(
            f"  stream {i}: prompt {usage.get('prompt_tokens')} + output "
            f"{usage.get('completion_tokens')} tokens, SSE gaps {gap}"
        )


def frames_between(server: Server, start: float, end: float) -> str:
    """The requests admitted and the frames committed from ``start`` to ``end`` (client
    monotonic seconds; the coordinator's trace uses the same clock), one line each, in
    time order, for a failure message."""
    if server.trace is None or not server.trace.exists():
        return "(no trace: an external server)"
    lines = []
    for text in server.trace.read_text().splitlines():
        line = json.loads(text)
        if line.get("event") == "frame":
            at = line["committed_at_ns"] / 1e9
            what = (
                f"{line['graph']:<28} {line['reason']:<10}"
                f" est {line['selected_cost_ns'] / 1e6:5.1f} ran {line['device_ns'] / 1e6:5.1f} ms"
                f"  requests {line['requests']}"
                f" phases {line['lanes']['phase']}"
            )
        elif line.get("event") == "request":
            at = line["admitted_ns"] / 1e9
            what = (
                f"request {line['request']} admitted ({line['prompt_tokens']} prompt tokens; "
                f"submitted {(line['submitted_ns'] / 1e9 - start) * 1e3:.1f} ms)"
            )
        else:
            continue
        if start <= at <= end:
            lines.append((at, f"  {(at - start) * 1e3:7.1f} ms  {what}"))
    return "\n".join(text for _, text in sorted(lines)) or "(no frames)"


def gather(*jobs):
    async def run():
        return await asyncio.gather(*jobs)

    return asyncio.run(run())


def test_concurrent_long_prompts(server, report):
    prompts = [server.prompt_of(1500, seed=i) for i in range(4)]
    results = gather(*(stream_times(server.base, body(p, 8)) for p in prompts))
    report.extend(results)
    for times, usage in results:
        assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] >= 1300
        assert len(times) >= 1


@pytest.mark.parametrize("streams", [2, 4])
def test_decode_streams_all_progress_together(server, report, streams):
    # 96 tokens a stream (~0.6 s at 7 ms a CPU frame): the requests' arrival at the
    # coordinator may be 100-200 ms apart on a loaded machine (the frontend and the
    # client share its two cores), which 24-token streams (~0.15 s) did not outlast.
    # A scheduler that ran streams one after the other still fails at any length.
    tokens = 96

    async def run():
        # One client made first, so the requests leave together (issue 25's CI
        # run: clients made per stream sent the second ~200 ms late on a loaded
        # machine, after the first stream had finished).
        limits = httpx.Limits(max_connections=streams)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            jobs = (
                stream_times(server.base, body(words(6, i), tokens), client=http)
                for i in range(streams)
            )
            return await asyncio.gather(*jobs)

    sent = time.monotonic()
    results = asyncio.run(run())
    report.extend(results)
    ends = [times[-1] for times, _ in results]
    starts = [times[0] for times, _ in results]
    assert [usage["completion_tokens"] for _, usage in results] == [tokens] * streams
    # Every stream started before any finished: none starved.
    assert max(starts) < min(ends), (
        f"first tokens at {[round((t - sent) * 1e3) for t in starts]} ms, last at "
        f"{[round((t - sent) * 1e3) for t in ends]} ms after sending; frames:\n"
        + frames_between(server, sent, max(ends))
    )


def test_long_prompt_arriving_during_decode(server, report):
    long_prompt = server.prompt_of(2500)

    async def run():
        seen: list[list[float]] = [[], []]
        decode = [
            asyncio.create_task(stream_times(server.base, body(words(4, i), 300), seen[i]))
            for i in range(2)
        ]
        while min(len(times) for times in seen) < 3:  # both streams are decoding
            await asyncio.sleep(0.01)
        arrived = time.monotonic()
        long = await stream_times(server.base, body(long_prompt, 4))
        return arrived, long, await asyncio.gather(*decode)

    arrived, long, decodes = asyncio.run(run())
    report.extend([long, *decodes])
    assert long[1]["completion_tokens"] == 4 and long[1]["prompt_tokens"] >= 2200
    for times, usage in decodes:
        assert usage["completion_tokens"] == 300
        assert any(t > arrived for t in times)  # decoding went on after the long prompt came


def test_short_and_long_prompt_contention(server, report):
    long_prompt = server.prompt_of(3000, seed=1)
    jobs = [stream_times(server.base, body(long_prompt, 4))]
    jobs += [stream_times(server.base, body(words(5, i), 8)) for i in range(3)]
    (long_times, long_usage), *shorts = gather(*jobs)
    report.extend([(long_times, long_usage), *shorts])
    assert long_usage["completion_tokens"] == 4 and long_times
    for times, usage in shorts:
        assert usage["completion_tokens"] == 8 and times


def test_cancellation_followed_by_slot_reuse(server, report):
    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            # Fill the four slots, then walk away from one stream mid-way.
            tasks = [
                asyncio.create_task(stream_times(server.base, body(words(5, i), 64)))
                for i in range(3)
            ]
            async with http.stream(
                "POST", f"{server.base}/v1/completions", json=body(words(5, 9), 4000)
            ) as response:
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break  # the client disconnects mid-stream
            first = await asyncio.gather(*tasks)
            # The freed slot takes new work: four more streams complete.
            second = await asyncio.gather(
                *(stream_times(server.base, body(words(5, 20 + i), 16)) for i in range(4))
            )
            return first, second

    first, second = asyncio.run(run())
    report.extend([*first, *second])
    assert all(usage["completion_tokens"] == 64 for _, usage in first)
    assert all(usage["completion_tokens"] == 16 for _, usage in second)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics["flare_num_requests_running"] == 0 and metrics["flare_kv_pages_used"] == 0:
            break
        time.sleep(0.2)
    assert metrics["flare_num_requests_running"] == 0 and metrics["flare_kv_pages_used"] == 0
    assert httpx.get(f"{server.base}/health").status_code == 200
