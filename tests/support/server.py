"""A `flare run` process tree for HTTP tests, and client-side helpers.

``Server()`` starts ``flare run`` (frontend, coordinator, rank) on a free
loopback port and waits for /health (runtime.loadgen.launcher, the scripts'
launcher too); ``Server(url=...)`` wraps a server someone else started
(``FLARE_SCHEDULER_TEST_URL``), e.g. a GPU deployment.
"""

from __future__ import annotations

import contextlib
import json
import signal
import ssl
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runtime.loadgen.launcher import ROOT, ServerProcess

__all__ = ["ROOT", "START_S", "Server", "Stream", "body", "stream_times", "words"]

START_S = 180.0
# The spec's HTTP scenarios: four request slots, a 4096-token prefill capacity.
FLAGS = ["--max-concurrency", "4", "--max-prefill-tokens", "4096", "--device", "cpu"]
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "light", "sand"]


class Server(ServerProcess):
    """``flare run FLAGS *extra``, stopped with SIGINT (as Ctrl-C would), killed after 60 s.

    The processes' run directories (ipc sockets) go to a private temporary
    directory, so a test that kills a process leaves nothing behind in the
    system temp directory.
    """

    def __init__(self, *extra: str, url: str | None = None) -> None:
        self.mode = ""  # what a parametrized fixture started it as
        self.trace: Path | None = None  # the --trace file a fixture gave it, if any
        if url is not None:
            self.base, self.port, self.proc = url.rstrip("/"), None, None
            return
        super().__init__(
            [*FLAGS, *extra],
            start_timeout_s=START_S,
            stop_timeout_s=60.0,
            stop_signal=signal.SIGINT,
            own_group=False,
            tmp_prefix="flare-test-",
            tail_lines=None,
        )

    def output(self) -> str:
        return "" if self.proc is None else super().output()

    def stop(self) -> int | None:
        return 0 if self.proc is None else super().stop()

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
    base: str,
    request: dict,
    times: list[float] | None = None,
    headers: dict | None = None,
    client: httpx.AsyncClient | None = None,
) -> tuple[list[float], dict]:
    """Arrival time of every content chunk (appended to ``times`` as they come), and usage.

    Pass ``client`` (one shared client, made before the requests) where streams
    must arrive together: making a client takes tens of milliseconds, hundreds
    on a loaded machine, which staggers requests that each make their own.
    """
    times = [] if times is None else times
    usage: dict = {}
    async with contextlib.AsyncExitStack() as stack:
        http = client or await stack.enter_async_context(httpx.AsyncClient(timeout=300))
        response = await stack.enter_async_context(
            http.stream("POST", f"{base}/v1/completions", json=request, headers=headers)
        )
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


class Stream(threading.Thread):
    """A streaming completion (long by default) read in the background; keeps its
    status code, every data line and when it ended."""

    def __init__(
        self, base: str, verify: ssl.SSLContext | bool = True, max_tokens: int = 3000
    ) -> None:
        super().__init__(daemon=True)
        self.base, self.verify, self.max_tokens = base, verify, max_tokens
        self.status: int | None = None
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            request = body(words(5), self.max_tokens)
            url = f"{self.base}/v1/completions"
            with httpx.stream("POST", url, json=request, timeout=60, verify=self.verify) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
        except httpx.HTTPError as exc:
            self.error = exc
        self.ended_at = time.monotonic()

    def chunks(self) -> list[dict]:
        return [json.loads(line) for line in self.lines if line != "[DONE]"]

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for k in self.chunks() for c in k.get("choices", [])
                if c["finish_reason"]]  # fmt: skip
