"""``GET /debug/trace`` on a real ``flare run`` (frontend, coordinator, rank processes):
absent without ``--debug-endpoints``, behind the API key with it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.background import BackgroundStarts, wanted
from tests.support.server import Server

pytestmark = pytest.mark.process

KEY = "trace-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "traces" / "run.jsonl"


@pytest.fixture(scope="module", autouse=True)
def started(request: pytest.FixtureRequest, trace_path: Path) -> Iterator[BackgroundStarts]:
    """The servers this module's selected tests take, started together (their
    start-ups overlap) as its first test begins; each test stops its own."""
    makers = {
        "plain_server": (lambda: Server("--api-key", KEY), Server.stop),
        "debug_server": (
            lambda: Server("--debug-endpoints", "--api-key", KEY, "--trace", str(trace_path)),
            Server.stop,
        ),
    }
    starts = BackgroundStarts(makers, wanted(request, list(makers)))
    yield starts
    starts.close()


@pytest.fixture
def plain_server(started: BackgroundStarts) -> Server:
    """``flare run --api-key KEY``, the test's own to stop."""
    return started.take("plain_server")


@pytest.fixture
def debug_server(started: BackgroundStarts) -> Server:
    """``flare run --debug-endpoints --api-key KEY --trace PATH``, the test's own to stop."""
    return started.take("debug_server")


def test_absent_without_the_flag_even_with_the_key(plain_server):
    server = plain_server
    try:
        assert httpx.get(f"{server.base}/debug/trace", headers=AUTH).status_code == 404
        assert httpx.get(f"{server.base}/debug/trace").status_code == 401  # the key comes first
        assert httpx.get(f"{server.base}/debug/ranks", headers=AUTH).status_code == 404
        profile = httpx.post(f"{server.base}/debug/profile", headers=AUTH)
        assert profile.status_code == 404
    finally:
        server.stop()


def test_needs_the_key_and_returns_the_trace_lines(debug_server, trace_path):
    path, server = trace_path, debug_server
    url = f"{server.base}/debug/trace"
    try:
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        body = {"prompt": "hello there", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        assert server.post("/v1/completions", body, headers=AUTH).status_code == 200
        deadline = time.monotonic() + 10
        previous = -1
        while True:  # the writer thread renders within its poll period; the request's
            # frames (a terminal snapshot may follow its last token) are all written
            # once the count holds still
            answer = httpx.get(url, headers=AUTH, timeout=30).json()
            if answer["written"] >= 6 and answer["written"] == previous:
                break
            if time.monotonic() > deadline:
                break
            previous = answer["written"]
            time.sleep(0.5)
        frames = answer["frames"]
        assert answer["dropped"] == 0 and len(frames) == answer["written"] >= 6
        assert [f["fence"] for f in frames] == sorted(f["fence"] for f in frames)
        assert answer["last_fence"] == frames[-1]["fence"]
        assert all(len(f["ranks"]) == 1 and f["lanes"]["request"] for f in frames)
        later = httpx.get(url, params={"since": frames[-3]["fence"]}, headers=AUTH).json()
        assert [f["fence"] for f in later["frames"]] == [f["fence"] for f in frames[-2:]]
        one = httpx.get(url, params={"limit": 1}, headers=AUTH).json()
        assert [f["fence"] for f in one["frames"]] == [frames[-1]["fence"]]
        bad = httpx.get(url, params={"since": "x"}, headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
        metrics = server.metrics_with(AUTH)
        assert metrics["flare_trace_lines_total"] >= 6 and metrics["flare_trace_dropped_total"] == 0
    finally:
        assert server.stop() == 0
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    assert lines[0]["event"] == "start" and lines[-1]["event"] == "end"
    assert [line for line in lines if line["event"] == "frame"] == frames  # the same lines
