"""The serving process tree over its life: API key and config precedence, clients
that leave, a rank or the coordinator dying, Ctrl-C with streams open."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from runtime.ranks.model import default_model_dir
from tests.support.background import BackgroundStarts, wanted
from tests.support.server import Server, body, words

pytestmark = pytest.mark.process

AUTH = {"authorization": "Bearer sekrit"}


def children(server: Server, module: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if module in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


def wait_for(predicate, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.fixture(scope="module", autouse=True)
def started(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundStarts]:
    """The servers this module's selected tests take (``server``, ``keyed_server``),
    started together as its first test begins."""
    keyed = tmp_path_factory.mktemp("keyed")
    makers = {
        "server": (Server, Server.stop),
        "keyed_server": (lambda: api_key_server(keyed), Server.stop),
    }
    starts = BackgroundStarts(makers, wanted(request, list(makers)))
    yield starts
    starts.close()


@pytest.fixture
def server(started: BackgroundStarts) -> Server:
    """A default server of this test's own: the test stops it (or has it exit)."""
    return started.take("server")


@pytest.fixture
def keyed_server(started: BackgroundStarts) -> Server:
    """:func:`api_key_server`'s server, the test's own to stop."""
    return started.take("keyed_server")


class Stream(threading.Thread):
    """A long streaming request read in the background; keeps every data line."""

    def __init__(self, server: Server, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.server, self.headers = server, headers or {}
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.server.base}/v1/completions", timeout=60,
                              json=body(words(5), 3000), headers=self.headers) as r:  # fmt: skip
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
        except httpx.HTTPError as exc:
            self.error = exc

    def finish_reasons(self) -> list[str]:
        out = []
        for line in self.lines:
            if line != "[DONE]":
                chunk = json.loads(line)
                out += [c["finish_reason"] for c in chunk.get("choices", []) if c["finish_reason"]]
        return out


def api_key_server(tmp_path: Path) -> Server:
    """A server with an API key, a config file the command line overrides, and the
    embedded model with a generation_config.json and a chat template of our own."""
    config = tmp_path / "serve.toml"
    config.write_text("[run]\nnum-pages = 64\nmax-concurrency = 2\n")
    # The embedded model with a generation_config.json, and a chat template of our own.
    model = tmp_path / "model"
    model.mkdir()
    for file in Path(default_model_dir()).iterdir():
        (model / file.name).symlink_to(file)
    (model / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 3}')
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}#{{ m.content }}{% endfor %}=")
    s = Server("--api-key", "sekrit", "--config", str(config), "--num-pages", "200",
               "--max-choices-per-request", "8", "--model", str(model),
               "--chat-template", str(template))  # fmt: skip
    return s


def test_api_key_config_precedence_and_a_leaving_client(keyed_server: Server):
    s = keyed_server
    try:
        assert "sekrit" not in " ".join(" ".join(p.cmdline()) for p in children(s, "coordinator"))
        assert httpx.get(f"{s.base}/health").status_code == 200
        assert httpx.get(f"{s.base}/v1/models").status_code == 401
        assert httpx.get(f"{s.base}/metrics").status_code == 401
        r = s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        ok = openai.OpenAI(base_url=f"{s.base}/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model=ok.models.list().data[0].id, prompt="x",
                                     max_tokens=2).usage.completion_tokens >= 1  # fmt: skip
        # Prompts x n over --max-choices-per-request: a 400 naming n; "bearer" works too.
        lower = {"authorization": "bearer sekrit"}
        r = s.post("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}, headers=lower)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = s.post("/v1/completions", {"prompt": ["a"] * 9, "max_tokens": 1}, headers=lower)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert httpx.get(f"{s.base}/version").status_code == 200  # open, as in vLLM
        assert s.post("/tokenize", {"prompt": "x"}).status_code == 401
        assert s.post("/tokenize", {"prompt": "x"}, headers=lower).status_code == 200
        # --chat-template renders the messages; generation_config.json gives the defaults.
        ids = s.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]},
                     headers=AUTH).json()["tokens"]  # fmt: skip
        assert s.post("/detokenize", {"tokens": ids}, headers=AUTH).json()["prompt"] == "#hi="
        plain = {"prompt": words(6), "ignore_eos": True}
        first, again = (s.post("/v1/completions", plain, headers=AUTH).json() for _ in range(2))
        assert first["usage"]["completion_tokens"] == 3  # max_new_tokens
        assert first["choices"][0]["text"] == again["choices"][0]["text"]  # temperature 0
        metrics = s.metrics_with(AUTH)
        # The command line beat the file in the coordinator and the ranks too.
        assert metrics["flare_kv_pages_total"] == 200
        # A non-streaming client that gives up: its requests are cancelled, pages freed.
        long = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "n": 2}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{s.base}/v1/completions", headers=AUTH, timeout=1.0, json=long)
        assert wait_for(lambda: s.metrics_with(AUTH)["flare_kv_pages_used"] == 0, 10)
        assert s.metrics_with(AUTH)["flare_num_requests_running"] == 0
    finally:
        assert s.stop() == 0


def test_ctrl_c_ends_open_streams_cleanly(server: Server):
    s = server
    stream = Stream(s)
    assert wait_for(lambda: len(stream.lines) >= 3)
    s.proc.send_signal(signal.SIGINT)
    stream.join(30)
    assert not stream.is_alive() and stream.error is None
    assert stream.lines[-1] == "[DONE]" and stream.finish_reasons() == ["abort"]
    assert s.stop() == 0


def test_a_dead_rank_fails_requests_and_the_server_exits(server: Server):
    s = server
    stream = Stream(s)
    assert wait_for(lambda: len(stream.lines) >= 3)
    (rank,) = children(s, "runtime.ranks")
    rank.kill()
    stream.join(30)
    assert not stream.is_alive()
    assert any('"error"' in line for line in stream.lines) or "abort" in stream.finish_reasons()
    assert wait_for(lambda: s.proc.poll() is not None, 30)
    assert s.stop() == 1  # the coordinator exited on the engine failure, then the frontend


def test_a_dead_coordinator_fails_streams_and_the_server_exits(server: Server):
    s = server
    stream = Stream(s)
    assert wait_for(lambda: len(stream.lines) >= 3)
    (coordinator,) = children(s, "runtime.coordinator")
    ranks = children(s, "runtime.ranks")
    assert ranks
    coordinator.kill()
    stream.join(30)
    assert not stream.is_alive() and stream.lines[-1] == "[DONE]"
    # The work is lost: an error event naming the exit, not an operator's "abort".
    assert stream.finish_reasons() == []
    (error,) = [json.loads(x)["error"] for x in stream.lines[:-1] if '"error"' in x]
    assert "the coordinator was killed by SIGKILL" in error["message"]
    assert wait_for(lambda: s.proc.poll() is not None, 30)
    assert s.stop() == 1
    assert wait_for(lambda: not any(r.is_running() and r.status() != "zombie" for r in ranks))
