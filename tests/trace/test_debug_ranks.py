"""Rank-level debugging on a real ``flare run`` at TP=2 (frontend, coordinator, two
rank processes): ``GET /debug/ranks`` and ``flare ranks status``, the per-rank
Prometheus metrics, and ``POST /debug/profile``."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.cli import main as flare_main
from runtime.transport.completion import STAGE_NAMES
from tests.support.server import Server, body, stream_times

pytestmark = pytest.mark.process

KEY = "ranks-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    profiles = tmp_path_factory.mktemp("profiles") / "out"
    server = Server(
        "-tp", "2", "--debug-endpoints", "--api-key", KEY, "--profile-dir", str(profiles)
    )
    server.profiles = profiles
    yield server
    assert server.stop() == 0


def ranks(server) -> list[dict]:
    response = httpx.get(f"{server.base}/debug/ranks", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["ranks"]


def test_ranks_show_a_running_requests_slots_and_free_them_after(server, capsys):
    idle = ranks(server)
    assert [r["rank"] for r in idle] == [0, 1] and all(r["world_size"] == 2 for r in idle)
    assert all(not r["slots"] for r in idle)
    assert all(r["programs"] and r["rss_bytes"] > 0 and r["device"] == "cpu" for r in idle)

    async def while_running() -> list[dict]:
        times: list[float] = []
        request = body("one two three", 200)
        task = asyncio.create_task(stream_times(server.base, request, times, AUTH))
        while len(times) < 3:  # the request is decoding
            await asyncio.sleep(0.02)
        seen = await asyncio.to_thread(ranks, server)
        await task
        return seen

    seen = asyncio.run(while_running())
    for status in seen:  # every rank holds the request's slot: one slot, pages, a pending token
        assert len(status["slots"]) == 1, status
        slot = status["slots"][0]
        assert slot["generation"] >= 1 and slot["page_count"] >= 1 and slot["next_position"] > 3
    assert seen[0]["slots"] == seen[1]["slots"]  # the ranks agree on the slot table
    # The CLI prints the same, a table per rank.
    code = flare_main(["ranks", "status", "--url", server.base, "--api-key", KEY])
    out = capsys.readouterr().out
    assert code == 0 and "rank 0/2 on cpu" in out and "rank 1/2 on cpu" in out
    assert out.count("no slots in use") == 2  # the request finished: its slots are gone
    assert all(not r["slots"] for r in ranks(server))


def test_ranks_route_needs_the_key_and_the_cli_says_why(server, capsys):
    assert httpx.get(f"{server.base}/debug/ranks").status_code == 401
    assert flare_main(["ranks", "status", "--url", server.base, "--api-key", "wrong"]) == 1
    assert "HTTP 401" in capsys.readouterr().out


def test_per_rank_metrics(server):
    request = {"prompt": "alpha beta", "max_tokens": 8, "ignore_eos": True}
    assert server.post("/v1/completions", request, headers=AUTH).status_code == 200
    text = httpx.get(f"{server.base}/metrics", headers=AUTH).text
    httpx.get(f"{server.base}/metrics", headers=AUTH)  # the first read asks for memory
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    for rank in ("0", "1"):
        device = samples[
            ("flare_rank_device_seconds_total", (("class", "ordinary"), ("rank", rank)))
        ]
        assert device > 0
        for stage in STAGE_NAMES:
            key = ("flare_rank_host_seconds_total", (("rank", rank), ("stage", stage)))
            assert samples[key] >= 0
        assert samples[("flare_rank_host_seconds_total", (("rank", rank), ("stage", "wait")))] > 0
        assert samples[("flare_rank_last_fence", (("rank", rank),))] >= 8
    count = samples[("flare_rank_skew_seconds_count", ())]
    assert count >= 8
    assert samples[("flare_rank_skew_seconds_bucket", (("le", "+Inf"),))] == count
    # Memory arrives with the engine's next inspection of the ranks (every 2 s while read).
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(f"{server.base}/metrics", headers=AUTH).text
        if "flare_rank_rss_bytes{" in text:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    rss = [line for line in text.splitlines() if line.startswith("flare_rank_rss_bytes{")]
    assert len(rss) == 2 and all(float(line.split()[-1]) > 1e6 for line in rss)
    assert "flare_rank_device_allocated_bytes{" not in text  # CPU ranks have no device


def test_profile_writes_one_trace_per_rank(server):
    url = f"{server.base}/debug/profile"
    assert httpx.post(url, params={"frames": 2}).status_code == 401
    bad = httpx.post(url, params={"frames": 0}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "frames"

    async def profile_while_serving() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as http:
            answer = asyncio.create_task(
                http.post(url, params={"frames": 3, "timeout": 60}, headers=AUTH)
            )
            await asyncio.sleep(0.5)  # the ranks have the profile request before the frames
            request = {"prompt": "gamma", "max_tokens": 6, "ignore_eos": True}
            served = await http.post(f"{server.base}/v1/completions", json=request, headers=AUTH)
            assert served.status_code == 200, served.text
            return await answer

    response = asyncio.run(profile_while_serving())
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["frames"] == {"0": 3, "1": 3}
    assert answer["directory"] == os.path.abspath(server.profiles)
    assert [os.path.basename(f) for f in answer["files"]] == ["rank0.json", "rank1.json"]
    for path in answer["files"]:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        with open(path) as f:
            trace = json.load(f)
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"check+pack", "launch", "wait", "publish"} <= names  # the rank's stages
        assert any(name and name.startswith("aten::") for name in names)  # the operators
