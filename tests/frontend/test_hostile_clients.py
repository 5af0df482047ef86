"""The frontend under hostile clients (docs/serving.md, "Hostile clients and limits";
issue 23): big bodies, many messages, slow request heads, a bounded connection
flood and an upload cut off midway, against a real ``flare run`` on 127.0.0.1
(in process, the limits' answers and the preprocessing workers' wire and time
limit: test_preprocess.py).  scripts/hostile_clients.py measures the same attacks
at full size.

Timing bounds are looser than the goals the script measures (/health within 0.1 s
while a big body is handled): this machine's CPUs are shared and noisy, and the
code before these changes stalled for seconds, far beyond them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import openai
import psutil
import pytest

from runtime.deploy.launch import free_port
from runtime.frontend.preprocess.limits import MAX_MESSAGES
from runtime.frontend.protocol.images import NOT_ACCEPTED
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir
from tests.support.images import (
    animated_gif,
    data_uri,
    encoded,
    image_chat,
    png,
    png_header,
    truncated_png,
)
from tests.support.server import ROOT, START_S

pytestmark = pytest.mark.process

HOST = "127.0.0.1"
HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 200
SERVER_FDS = 1024  # the server's open-file limit (soft and hard): the flood exceeds it
FLOOD = 1200  # idle connections of the flood: more than the server's descriptors
HEALTH_BOUND_S = 0.5  # while one big body is handled (the goal, measured by the script: 0.1)
GAP_BOUND_S = 0.5  # a stream's largest gap beyond its normal one, likewise
FLOOD_HEALTH_BOUND_S = 1.0


# ------------------------------------------------------------------ the server


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (SERVER_FDS, SERVER_FDS))


class HostileServer:
    """``flare run`` with a short header timeout, a small connection limit and a
    small open-file limit; its output in a file, read by the tests."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="flare-test-")
        self.port = free_port()
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in close()
        flags = [
            "--max-concurrency",
            "4",
            "--max-prefill-tokens",
            "4096",
            "--device",
            "cpu",
            "--header-timeout",
            str(HEADER_TIMEOUT_S),
            "--max-connections",
            str(MAX_CONNECTIONS),
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "run", "--port", str(self.port), *flags],
            env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=self.tmp),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_limit_fds,
        )
        deadline = time.monotonic() + START_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"flare run did not become healthy: {self.output()}")
            time.sleep(0.3)

    def healthy(self) -> bool:
        with contextlib.suppress(OSError, http.client.HTTPException):
            return request(self.port, "GET", "/health", timeout=2)[0] == 200
        return False

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def lines(self) -> int:
        return self.output().count("\n")

    def rss(self) -> int:
        """The frontend's RSS, its preprocessing workers' included."""
        proc = psutil.Process(self.proc.pid)
        total = proc.memory_info().rss
        for child in proc.children():
            with contextlib.suppress(psutil.Error):
                if "runtime.frontend.preprocess" in " ".join(child.cmdline()):
                    total += child.memory_info().rss
        return total

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    s = HostileServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def request(port: int, method: str, path: str, body: bytes | None = None, timeout=120.0):
    """(status, parsed JSON or raw bytes) over a fresh connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    with contextlib.suppress(ValueError):
        return response.status, json.loads(data)
    return response.status, data


class Watch:
    """/health every 20 ms on a keep-alive connection, and a streaming completion's
    chunk times, in background threads, while an attack is sent."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.probes: list[tuple[float, float]] = []  # (start, latency)
        self.chunks: list[float] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._probe, daemon=True),
            threading.Thread(target=self._stream, daemon=True),
        ]
        for t in self.threads:
            t.start()
        while len(self.chunks) < 20:  # the stream flows
            time.sleep(0.05)

    def _probe(self) -> None:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=60)
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                conn.request("GET", "/health")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(HOST, self.port, timeout=60)
            self.probes.append((start, time.monotonic() - start))
            self.stop.wait(0.02)
        conn.close()

    def _stream(self) -> None:
        body = json.dumps(
            {
                "prompt": "alpha beta gamma",
                "max_tokens": 3000,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            }
        )
        conn = http.client.HTTPConnection(HOST, self.port, timeout=60)
        conn.request(
            "POST", "/v1/completions", body=body, headers={"content-type": "application/json"}
        )
        response = conn.getresponse()
        while not self.stop.is_set():
            line = response.fp.readline()
            if not line or line.strip() == b"data: [DONE]":
                break
            if line.startswith(b"data: ") and b'"text":"' in line:
                self.chunks.append(time.monotonic())
        conn.close()

    def max_gap(self, lo: float, hi: float) -> float:
        pairs = zip(self.chunks, self.chunks[1:])
        return max((b - a for a, b in pairs if b > lo and a < hi), default=0.0)

    def max_probe(self, lo: float, hi: float) -> float:
        return max((lat for s, lat in self.probes if s < hi and s + lat > lo), default=0.0)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)


def attack(server: HostileServer, path: str, body: bytes) -> tuple[int, object, float, float]:
    """Send one hostile body while /health and a stream are watched: (status, answer,
    the slowest /health, the stream's largest gap beyond its normal one)."""
    watch = Watch(server.port)
    try:
        time.sleep(1.0)
        normal = watch.max_gap(0, time.monotonic())
        start = time.monotonic()
        status, answer = request(server.port, "POST", path, body)
        end = time.monotonic() + 0.3
        time.sleep(0.4)
        health = watch.max_probe(start, end)
        excess = max(0.0, watch.max_gap(start, end) - normal)
    finally:
        watch.close()
    return status, answer, health, excess


def error_of(answer: object) -> dict:
    assert isinstance(answer, dict) and "error" in answer, answer
    return answer["error"]


# ------------------------------------------------------------------ big bodies


def test_a_big_tokenize_is_refused_naming_its_limit_and_stalls_nobody(server):
    text = "alpha beta gamma delta " * 200_000  # 4.6 MB
    status, answer, health, excess = attack(
        server, "/tokenize", json.dumps({"prompt": text}).encode()
    )
    error = error_of(answer)
    assert status == 400 and error["param"] == "prompt", answer
    assert "/tokenize's limit of 16384 tokens" in error["message"]
    assert health < HEALTH_BOUND_S, f"/health took {health:.3f} s"
    assert excess < GAP_BOUND_S, f"a stream waited {excess:.3f} s longer than usual"


def test_a_chat_of_many_messages_is_refused_at_once(server):
    messages = [{"role": "user", "content": ""}] * 200_000
    status, answer, health, excess = attack(
        server, "/v1/chat/completions", json.dumps({"messages": messages}).encode()
    )
    error = error_of(answer)
    assert status == 400 and error["param"] == "messages", answer
    assert f"at most {MAX_MESSAGES}" in error["message"]
    assert health < HEALTH_BOUND_S and excess < GAP_BOUND_S, (health, excess)


def test_a_prompt_of_millions_of_token_ids_is_refused_by_its_length(server):
    body = json.dumps({"prompt": [5] * 3_000_000, "max_tokens": 1}).encode()
    status, answer, health, excess = attack(server, "/v1/completions", body)
    error = error_of(answer)
    assert status == 400 and error["code"] == "context_length_exceeded", answer
    assert "3000000 token ids" in error["message"]
    assert health < HEALTH_BOUND_S and excess < GAP_BOUND_S, (health, excess)


def test_a_body_of_a_million_keys_stalls_nobody(server):
    body = ("{" + ",".join(f'"k{i}":0' for i in range(1_000_000)) + "}").encode()
    status, answer, health, excess = attack(server, "/v1/completions", body)
    assert status == 400 and error_of(answer)["param"] == "prompt", answer
    assert health < HEALTH_BOUND_S and excess < GAP_BOUND_S, (health, excess)


def test_detokenize_refuses_more_ids_than_its_limit(server):
    status, answer = request(
        server.port, "POST", "/detokenize", json.dumps({"tokens": [5] * 1_000_000}).encode()
    )
    error = error_of(answer)
    assert status == 400 and error["param"] == "tokens", answer
    assert "/detokenize takes at most 16384" in error["message"]


def test_a_body_over_the_size_limit_is_a_413_naming_it(server):
    body = b'{"prompt": "' + b"a" * (33 << 20) + b'"}'
    status, answer = request(server.port, "POST", "/v1/completions", body)
    error = error_of(answer)
    assert status == 413 and error["code"] == "request_too_large", answer
    assert "limit of 33554432 bytes" in error["message"]


def test_the_frontends_memory_returns_after_big_bodies(server):
    big = [
        ("/tokenize", json.dumps({"prompt": "alpha beta " * 1_000_000}).encode()),
        ("/v1/completions", json.dumps({"prompt": [7] * 3_000_000}).encode()),
        ("/detokenize", json.dumps({"tokens": [5] * 3_000_000}).encode()),
    ]
    request(server.port, "POST", "/tokenize", json.dumps({"prompt": "warm " * 9000}).encode())
    time.sleep(1.0)
    start = server.rss()
    for path, body in big:
        assert request(server.port, "POST", path, body)[0] == 400
    deadline = time.monotonic() + 15
    while server.rss() > start * 1.1 and time.monotonic() < deadline:
        time.sleep(0.5)
    after = server.rss()
    assert after <= start * 1.1, f"RSS {start >> 20} MiB before, {after >> 20} MiB after"


def test_large_bodies_within_the_limits_are_served_by_the_workers(server, tokenizer):
    body = {"prompt": [100] * 500, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    padded = json.dumps(body).encode() + b" " * 20000  # over 16 KiB: prepared by a worker
    status, answer = request(server.port, "POST", "/v1/completions", padded)
    assert status == 200 and answer["usage"]["prompt_tokens"] == 500, answer
    messages = [{"role": "user", "content": f"turn {i}"} for i in range(40)]  # costly: a worker
    body = {"messages": messages, "max_tokens": 2}
    status, answer = request(server.port, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer
    text = "alpha " * 3500
    status, answer = request(
        server.port, "POST", "/tokenize", json.dumps({"prompt": text}).encode()
    )
    assert status == 200 and answer["count"] == len(tokenizer.encode(text)), answer
    status, answer = request(
        server.port, "POST", "/detokenize", json.dumps({"tokens": answer["tokens"]}).encode()
    )
    assert status == 200 and answer["prompt"] == text, answer


# ------------------------------------------------------------------ hostile images

IMAGE_FIELD = "messages[0].content[1].image_url.url"
HOSTILE_IMAGES = {
    "truncated PNG": (image_chat(data_uri(truncated_png())), IMAGE_FIELD,
                      "cannot be decoded as a PNG image"),
    "100,000 x 100,000 header": (image_chat(data_uri(png_header(100_000, 100_000))),
                                 IMAGE_FIELD, "100000 x 100000 = 10000000000 pixels"),
    "non-image bytes": (image_chat(data_uri(b"%PDF-1.7 not an image" * 10)), IMAGE_FIELD,
                        "is not a PNG, JPEG, WebP or GIF image"),
    "GIF of 1,000 frames": (image_chat(data_uri(animated_gif(1000), "image/gif")), IMAGE_FIELD,
                            "more than 32 frames"),
    "remote URL": (image_chat("https://example.com/cat.png"), IMAGE_FIELD,
                   "does not fetch images"),
    "1,000 images": (image_chat(*[data_uri(png(2, 2))] * 1000), "messages",
                     "at most 16 per request (--limit-mm-per-prompt)"),
}  # fmt: skip


def chat_works(port: int) -> bool:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    status, answer = request(port, "POST", "/v1/chat/completions", json.dumps(body).encode())
    return status == 200 and answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("name", list(HOSTILE_IMAGES))
def test_a_hostile_image_is_a_400_naming_it_and_the_server_stays_healthy(server, name):
    body, param, words = HOSTILE_IMAGES[name]
    status, answer = request(server.port, "POST", "/v1/chat/completions", json.dumps(body).encode())
    error = error_of(answer)
    assert status == 400 and error["param"] == param and words in error["message"], answer
    assert chat_works(server.port)


def test_images_are_decoded_off_the_event_loop(server):
    """Images of the most pixels each (4096 x 4096, compressible: 300 MB of pixels
    from a 0.5 MB body, half a second each to decode), decoded in a worker while
    /health and a stream are watched; then refused by the text-only model."""
    from PIL import Image

    big = [encoded(Image.new("RGB", (4096, 4096), (i, 2 * i, 3 * i))) for i in range(6)]
    body = image_chat(*[data_uri(b) for b in big])
    start = time.monotonic()
    status, answer, health, excess = attack(
        server, "/v1/chat/completions", json.dumps(body).encode()
    )
    assert status == 400 and error_of(answer)["message"] == NOT_ACCEPTED, answer
    assert health < HEALTH_BOUND_S and excess < GAP_BOUND_S, (health, excess)
    assert time.monotonic() - start < 60


def test_a_valid_image_on_the_text_only_model_is_a_400_through_the_openai_client(server):
    client = openai.OpenAI(base_url=f"http://{HOST}:{server.port}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id, **image_chat(data_uri(png()))
        )  # fmt: skip
    assert info.value.status_code == 400
    assert info.value.body["message"] == NOT_ACCEPTED and info.value.body["param"] == IMAGE_FIELD
    assert chat_works(server.port)


# ------------------------------------------------------------------ connections


def test_a_slow_request_head_is_closed_with_a_408(server):
    with socket.create_connection((HOST, server.port)) as sock:
        sock.sendall(b"GET /hea")
        sock.settimeout(HEADER_TIMEOUT_S + 5)
        start = time.monotonic()
        data = sock.recv(4096)
        waited = time.monotonic() - start
        assert data.startswith(b"HTTP/1.1 408"), data
        assert b"--header-timeout" in data
        assert sock.recv(4096) == b""  # and closed
    assert waited < HEADER_TIMEOUT_S + 1.5


def test_a_connection_flood_is_bounded_and_health_answers(server):
    """More idle connections than the server has descriptors: it holds at most
    --max-connections (the longest-waiting get a 503 and are closed), /health
    answers on a new connection, and the log does not flood."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 256:
        pytest.skip(f"this process may open {hard} files, the flood needs {FLOOD + 256}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 256), hard))
    lines = server.lines()
    socks = []
    try:
        for _ in range(FLOOD):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((HOST, server.port))
            socks.append(sock)
        time.sleep(0.5)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.send(b"GET /hea")
        time.sleep(0.5)
        slowest = 0.0
        for _ in range(5):
            start = time.monotonic()
            status, _ = request(server.port, "GET", "/health", timeout=10)
            slowest = max(slowest, time.monotonic() - start)
            assert status == 200
            time.sleep(0.1)
        assert slowest < FLOOD_HEALTH_BOUND_S, f"/health took {slowest:.3f} s"
        answers: dict[str, int] = {}
        for sock in socks:
            try:
                data = sock.recv(64)
                what = data[:12].decode() or "closed"
            except BlockingIOError:
                what = "open"
            except OSError:
                what = "reset"
            answers[what] = answers.get(what, 0) + 1
        # At most --max-connections held; the others closed (the longest-waiting with
        # a 503, a few reset when their request head came after the close).
        assert answers.get("open", 0) <= MAX_CONNECTIONS, answers
        assert answers.get("HTTP/1.1 503", 0) > FLOOD // 2, answers
    finally:
        for sock in socks:
            sock.close()
    time.sleep(1.0)
    output = server.output()
    assert "Too many open files" not in output
    assert server.lines() - lines < 50, output[-3000:]


def test_a_client_that_leaves_mid_upload_costs_one_log_line(server):
    lines = server.lines()
    with socket.create_connection((HOST, server.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 5000000\r\n\r\n" + b'{"prompt": "' + b"a" * 1_000_000
        )
        time.sleep(0.3)
    time.sleep(1.0)
    new = server.output().splitlines()[lines:]
    assert len(new) == 1 and "disconnected during the upload" in new[0], new
    assert server.healthy()
