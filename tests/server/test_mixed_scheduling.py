"""A long prompt arriving during four decode streams, with and without mixed
prefill/decode programs (the mixed-programs issue).

* In process (the scheduler's trace records): with ``mixed_prefill`` the long
  prompt is consumed only by frames that also serve all four decoders.
* Over HTTP (``flare run``, with and without ``--mixed-prefill``): no
  prefill-only frame runs while the prompt is consumed (the per-kind frame
  counters of ``/metrics``), and the four streams' SSE gaps are printed for
  both servers (run with ``-s``).  SSE gaps are client arrival gaps, not
  device times.

Five requests need five slots, so these deployments have eight (the spec's
four-slot scenarios are tests/server/test_scheduler.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import time
from collections import Counter

import pytest

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from tests.support.background import BackgroundStarts
from tests.support.server import Server, body, stream_times, words

pytestmark = pytest.mark.process

STREAMS = 4
LONG_PROMPT = 2500
FLAGS = ("--max-concurrency", "8", "--max-prefill-tokens", "4096", "--device", "cpu")


def _handle_id(engine, stream) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with engine._state_lock:
            live = engine._by_request.get(stream.request_id)
        if live is not None:
            return live.handle.id
        time.sleep(0.005)
    raise AssertionError(f"request {stream.request_id} never reached the scheduler")


def _long_prompt_frames(engine, rng: random.Random) -> tuple[list, set[int], int]:
    """Four streams decoding, then the long prompt: the trace records of the
    frames that consumed it, the streams' handle ids and the prompt's."""
    vocab = engine.facts.vocab_size - 8  # clear of the special tokens at the end
    streams = [
        engine.submit([rng.randrange(vocab) for _ in range(6)], 200, ignore_eos=True)
        for _ in range(STREAMS)
    ]
    ids = {_handle_id(engine, s) for s in streams}
    deadline = time.monotonic() + 120
    while min(len(s.token_ids) for s in streams) < 3:  # all four are decoding
        assert time.monotonic() < deadline, "the streams did not start decoding"
        time.sleep(0.01)
    with engine._state_lock:
        engine.scheduler.drain_trace()  # only what follows the long prompt's arrival
    long = engine.submit([rng.randrange(vocab) for _ in range(LONG_PROMPT)], 4, ignore_eos=True)
    long_id = _handle_id(engine, long)
    assert long.result(timeout=300).token_ids
    with engine._state_lock:
        trace = engine.scheduler.drain_trace()
    for s in streams:
        s.cancel()
    for s in streams:
        s.result(timeout=60)
    records = [r for r in trace if long_id in r.requests and r.prompt_tokens > 0]
    assert sum(r.prompt_tokens for r in records) == LONG_PROMPT
    for r in records:
        assert r.requests[r.prompt_row] == long_id
    return records, ids, long_id


def _show(records) -> list[tuple]:
    return [(r.graph, r.prompt_tokens, r.decode_rows, r.reason) for r in records]


def test_long_prompt_rides_with_all_four_decoders_in_process():
    """On a fresh deployment the long prompt is consumed by one mixed frame that
    serves all four decoders.

    That frame is a discovery: every mixed shape is unmeasured, and among
    indeterminate candidates the most useful one wins (spec, "Duration
    estimates"): B=8 C=4096, the whole prompt plus the four decoders.  Later
    arrivals on the same deployment are printed, not asserted: discovery then
    walks the remaining unmeasured shapes in order of useful value (B=4 with
    three decoders, B=2 with one, prefill alone, then smaller capacities), and
    with measured CPU costs value per time often prefers 64-token prefill
    frames beside separate decode frames, because on this CPU runtime a mixed
    frame costs about as much as the prefill and decode frames it replaces
    (docs/scheduler.md, "Mixed programs").
    """
    config = DeploymentConfig(
        tensor_parallel_size=1, max_concurrency=8, max_prefill_tokens=4096, num_pages=1024,
        device="cpu", startup_timeout_s=180, mixed_prefill=True,
    )  # fmt: skip
    rng = random.Random(7)
    with LocalDeployment(config) as d:
        records, ids, long_id = _long_prompt_frames(d.engine, rng)
        print("\nfresh: long prompt frames (graph, prompt tokens, decode rows, reason):")
        print(f"  {_show(records)}")
        for r in records:
            assert r.kind == "mixed", _show(records)
            assert set(r.requests) - {long_id} == ids, _show(records)  # all four decoders
            assert r.decode_rows == STREAMS
        for attempt in range(2):
            later, _, _ = _long_prompt_frames(d.engine, rng)
            print(f"arrival {attempt + 2}: {_show(later)}")


async def _scenario(server: Server, prompt: str) -> tuple[list, tuple, dict, dict]:
    seen: list[list[float]] = [[] for _ in range(STREAMS)]
    decode = [
        asyncio.create_task(stream_times(server.base, body(words(4, i), 200), seen[i]))
        for i in range(STREAMS)
    ]
    while min(len(times) for times in seen) < 3:
        await asyncio.sleep(0.01)
    before = server.metrics()
    arrived = time.monotonic()
    long = await stream_times(server.base, body(prompt, 4))
    after = server.metrics()
    decodes = await asyncio.gather(*decode)
    return decodes, (arrived, *long), before, after


def _gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1e3 for a, b in itertools.pairwise(times)]


def _gaps_scenario(server: Server, label: str) -> tuple:
    """The long prompt during four decode streams on ``server`` (ended here): the
    frames by kind while it ran, each stream's stall around it, its first token."""
    try:
        prompt = server.prompt_of(LONG_PROMPT)
        decodes, (arrived, long_times, long_usage), before, after = asyncio.run(
            _scenario(server, prompt)
        )
    finally:
        assert server.stop() == 0
    assert long_usage["completion_tokens"] == 4 and long_usage["prompt_tokens"] >= 2200
    delta = {
        k.split(":", 1)[1]: after[k] - before.get(k, 0.0)
        for k in after
        if k.startswith("flare_frames_total:") and after[k] != before.get(k, 0.0)
    }
    stall = []  # each stream's longest gap around the long prompt's consumption
    for times, usage in decodes:
        assert usage["completion_tokens"] == 200
        around = [t for t in times if t >= arrived - 0.5]
        stall.append(max(_gaps_ms(around), default=0.0))
    first_token_ms = (long_times[0] - arrived) * 1e3
    if label == "mixed":
        assert delta.get("prefill", 0) == 0, delta  # no prefill-only frame stalled them
        assert delta.get("mixed", 0) >= 1, delta
    else:
        assert delta.get("prefill", 0) >= 1, delta
    return delta, stall, first_token_ms, decodes


def test_sse_gaps_with_and_without_mixed_programs():
    report = {}
    configs = {"separate": (), "mixed": ("--mixed-prefill",)}
    # Both servers start at once (their start-ups overlap); each scenario runs alone.
    makers = {label: (functools.partial(Server, *FLAGS, *extra), Server.stop)
              for label, extra in configs.items()}  # fmt: skip
    starts = BackgroundStarts(makers, Counter(list(configs)))
    try:
        for label in configs:
            report[label] = _gaps_scenario(starts.take(label), label)
    finally:
        starts.close()
    print()
    for label, (delta, stall, first_ms, decodes) in report.items():
        print(f"{label}: frames by kind while the long prompt ran {delta}")
        print(f"  long prompt first token after {first_ms:.0f} ms")
        for i, (times, _) in enumerate(decodes):
            gaps = _gaps_ms(times)
            print(
                f"  stream {i}: SSE gaps median {sorted(gaps)[len(gaps) // 2]:.1f} ms, "
                f"max {max(gaps):.1f} ms, max around the long prompt {stall[i]:.1f} ms"
            )
