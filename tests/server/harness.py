"""A `flare run` process tree for HTTP tests, and client-side helpers.

``Server()`` starts ``flare run`` (frontend, coordinator, rank) on a free
loopback port and waits for /health; ``Server.external(url)`` wraps a server
someone else started (``FLARE_SCHEDULER_TEST_URL``), e.g. a GPU deployment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
START_S = 180.0
# The spec's HTTP scenarios: four request slots, a 4096-token prefill capacity.
FLAGS = ["--max-concurrency", "4", "--max-prefill-tokens", "4096", "--device", "cpu"]
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "light", "sand"]


class Server:
    def __init__(self, *extra: str, url: str | None = None) -> None:
        self.port: int | None
        self.mode = ""  # what a parametrized fixture started it as
        self.proc: subprocess.Popen | None = None
        self.log = None
        if url is not None:
            self.base, self.port = url.rstrip("/"), None
            return
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # The processes' run directories (ipc sockets) go here, so a test that kills
        # a process leaves nothing behind in the system temp directory.
        self.tmp = tempfile.mkdtemp(prefix="flare-test-")
        env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=self.tmp)
        # A file, so a chatty server never blocks on a full pipe.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "run", "--port", str(self.port), *FLAGS, *extra],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + START_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flare run exited: {self.output()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("flare run did not become healthy")
            time.sleep(0.3)

    def output(self) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return code

    # -------------------------------------------------------------- client side
    def post(self, path: str, body: object, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", json=body, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample summed over labels but ``class`` and ``kind`` (kept as ``name:label``)."""
        return self.metrics_with({})

    def metrics_with(self, headers: dict[str, str]) -> dict[str, float]:
        text = httpx.get(f"{self.base}/metrics", headers=headers).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                for label in ("class", "kind"):
                    if label in sample.labels:
                        key += f":{sample.labels[label]}"
                out[key] = out.get(key, 0.0) + sample.value
        return out

    def tokens_per_word(self) -> float:
        """Prompt tokens per word of :func:`words` with this server's tokenizer."""
        usage = self.post("/v1/completions", {"prompt": words(200), "max_tokens": 1}).json()[
            "usage"
        ]
        return usage["prompt_tokens"] / 200

    def prompt_of(self, tokens: int, seed: int = 0) -> str:
        """A prompt of about ``tokens`` tokens (never more)."""
        return words(max(1, int(tokens / self.tokens_per_word()) - 2), seed)


def words(n: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


def body(prompt: str, max_tokens: int, stream: bool = True) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip


async def stream_times(
    base: str, request: dict, times: list[float] | None = None, headers: dict | None = None
) -> tuple[list[float], dict]:
    """Arrival time of every content chunk (appended to ``times`` as they come), and usage."""
    times = [] if times is None else times
    usage: dict = {}
    async with (
        httpx.AsyncClient(timeout=300, headers=headers) as http,
        http.stream("POST", f"{base}/v1/completions", json=request) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.monotonic())
    return times, usage
