"""200 streaming clients that disconnect mid-stream, against a real `flare run`
(frontend, coordinator, one CPU rank): every request is cancelled in the
coordinator, the running and waiting gauges and the KV pages requests hold go
back to 0, and a new request completes within 5 s."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.server import Server, body, words

pytestmark = pytest.mark.process

CLIENTS = 200
# Far more tokens than a client waits for: no request can finish on its own
# before its client leaves, so every one of them must end as a cancellation.
MAX_TOKENS = 2000
SETTLE_S = 60.0  # bounds the wait for the coordinator to wind down


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # 32 slots: most clients wait for one, then get their first chunk once
    # earlier clients left; the pool holds every resident worst case.
    s = Server("--max-num-seqs", "32")
    yield s
    assert s.stop() == 0


async def _leave_mid_stream(base: str, index: int) -> tuple[int, bool]:
    """Stream one completion, close the connection after its first (even index)
    or second (odd) chunk with text; (chunks seen, whether it saw a finish)."""
    prompt = words(4 + index % 37, seed=index)
    wanted = 1 + index % 2
    seen, finished = 0, False
    async with (
        httpx.AsyncClient(timeout=120) as http,
        http.stream("POST", f"{base}/v1/completions", json=body(prompt, MAX_TOKENS)) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0] if chunk["choices"] else {}
            finished = finished or choice.get("finish_reason") is not None
            if choice.get("text"):
                seen += 1
            if seen >= wanted:
                break  # leaving the block closes the unread response's connection
    return seen, finished


async def _all_leave(base: str) -> list[tuple[int, bool]]:
    return await asyncio.gather(*(_leave_mid_stream(base, i) for i in range(CLIENTS)))


def _plain(prompt: str, max_tokens: int) -> dict:
    """A non-streamed greedy completion's body."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _settled(server: Server, before: dict[str, float]) -> dict[str, float]:
    """The metrics once every request has been cancelled and its slot and pages
    are free (or the last sample when SETTLE_S passed)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        m = server.metrics()
        cancelled = m["flare_engine_requests_cancelled_total"]
        idle = (
            cancelled - before["flare_engine_requests_cancelled_total"] >= CLIENTS
            and m["flare_num_requests_running"] == 0
            and m["flare_num_requests_waiting"] == 0
            and m["flare_frames_in_flight"] == 0
            and m["flare_kv_pages_used"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_200_clients_disconnect_mid_stream(server):
    # A first request so every counter exists and first-use costs are paid.
    first = server.post("/v1/completions", _plain(words(8), 4))
    assert first.status_code == 200
    before = server.metrics()

    results = asyncio.run(_all_leave(server.base))
    assert [seen >= 1 + i % 2 for i, (seen, _) in enumerate(results)] == [True] * CLIENTS
    assert not any(finished for _, finished in results)  # every client left mid-stream

    m = _settled(server, before)

    def delta(name: str) -> float:
        return m[name] - before[name]

    # Every request reached the coordinator and ended there as a cancellation.
    assert delta("flare_engine_requests_submitted_total") == CLIENTS
    assert delta("flare_engine_requests_cancelled_total") == CLIENTS
    assert delta("flare_engine_requests_finished_total") == 0
    # Nothing resident, queued or in flight; requests hold no page, and every
    # page the prefix cache kept is idle (evictable) again.
    assert m["flare_num_requests_running"] == 0
    assert m["flare_num_requests_waiting"] == 0
    assert m["flare_frames_in_flight"] == 0
    assert m["flare_kv_pages_used"] == 0
    assert m["flare_kv_pages_cached"] == m["flare_kv_pages_cached_idle"]
    # The frontend counted no finished stream for them (none reached its end).
    assert m.get("flare_request_success_total", 0.0) == before.get(
        "flare_request_success_total", 0.0
    )

    # The server is not left wedged: a new request completes within 5 s.
    started = time.monotonic()
    out = httpx.post(f"{server.base}/v1/completions", json=_plain(words(12, seed=3), 8), timeout=5)
    assert out.status_code == 200
    assert out.json()["choices"][0]["finish_reason"] == "length"
    assert time.monotonic() - started < 5.0
    assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200
