"""The HTTP frontend's reliability (docs/serving.md, "Reliability"): HTTPS, the
queue limit's 429 with /health answering under full load, SIGTERM without a
drain period aborting running and waiting requests alike with no process left,
a stuck (SIGSTOPped) coordinator; and, in process, the Gate's recovery and the
flags' errors.  The drain period is tests/server/test_shutdown.py."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi.testclient import TestClient

from runtime.cli.app import build_parser
from runtime.cli.flags.serving import serving_options
from runtime.cli.parsing import run_parser as _run_parser
from runtime.deploy.launch import free_port
from runtime.frontend.chat import load_chat_template
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.server.admission import Gate
from runtime.frontend.server.app import create_app
from runtime.frontend.server.state import Frontend
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir
from tests.support.background import BackgroundStarts, wanted
from tests.support.processes import all_gone, tree, wait_for
from tests.support.scripted_client import MODEL, ScriptedClient, script_for
from tests.support.server import ROOT, START_S, Server, Stream

pytestmark = pytest.mark.process

SEQ_FLAGS = ["--max-num-seqs", "1", "--max-prefill-tokens", "4096", "--device", "cpu"]
HEARTBEAT = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "2"]


# ------------------------------------------------------------------ helpers


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flare test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class HttpsServer:
    """``flare run`` over HTTPS (tests.support.server.Server speaks plain HTTP)."""

    def __init__(self, *extra: str) -> None:
        self.tmp = tempfile.mkdtemp(prefix="flare-test-")
        self.cert, key = self_signed(Path(self.tmp))
        self.verify = ssl.create_default_context(cafile=str(self.cert))
        self.port = free_port()
        self.base = f"https://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in close()
        flags = ["--ssl-certfile", str(self.cert), "--ssl-keyfile", str(key), *SEQ_FLAGS]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "run", "--port", str(self.port), *flags, *extra],
            env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=self.tmp),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + START_S
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"flare run did not become healthy: {self.output()}")
            time.sleep(0.3)

    def healthy(self) -> bool:
        try:
            return self.get("/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", verify=self.verify, **kwargs)

    def post(self, path: str, json_body: object, **kwargs) -> httpx.Response:
        kwargs.setdefault("timeout", 60)
        return httpx.post(f"{self.base}{path}", json=json_body, verify=self.verify, **kwargs)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def started(request: pytest.FixtureRequest) -> Iterator[BackgroundStarts]:
    """The servers this module's selected process tests take, started together as
    its first test begins: HTTPS with --max-waiting-requests 1, and one with short
    heartbeats."""
    makers = {
        "https_server": (lambda: HttpsServer("--max-waiting-requests", "1"), HttpsServer.close),
        "heartbeat_server": (lambda: Server(*HEARTBEAT), Server.stop),
    }
    starts = BackgroundStarts(makers, wanted(request, list(makers)))
    yield starts
    starts.close()


@pytest.fixture
def https_server(started: BackgroundStarts) -> HttpsServer:
    return started.take("https_server")


@pytest.fixture
def heartbeat_server(started: BackgroundStarts) -> Server:
    return started.take("heartbeat_server")


# ------------------------------------------------------------------ HTTPS, 429, abort


def test_https_overload_429_and_sigterm_aborts_running_and_waiting_requests(
    https_server: HttpsServer,
):
    s = https_server
    try:
        # The summary line follows the listening socket (health may answer first).
        announced = f"at https://127.0.0.1:{s.port}/v1"
        assert wait_for(lambda: announced in s.output(), timeout_s=10), s.output()
        # HTTPS verified against the test's own certificate; plain HTTP gets nothing.
        r = s.post("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused
            httpx.get(f"{s.base}/health", timeout=5)

        # One slot (--max-num-seqs 1) + --max-waiting-requests 1: two open choices fit.
        running = Stream(s.base, s.verify)
        assert wait_for(lambda: len(running.lines) >= 2, 60), running.error
        waiting = Stream(s.base, s.verify)
        assert wait_for(lambda: waiting.status is not None, 30)
        assert waiting.status == 200 and not waiting.lines  # admitted, waits for the slot
        r = s.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "--max-waiting-requests 1" in error["message"]
        # /health answers at once with the queue full (the timeout bounds the wait).
        assert s.get("/health", timeout=1.0).status_code == 200

        # SIGTERM, no drain period: the running and the waiting request both end as
        # "abort" at once, then every process of the run exits.
        procs = tree(s.proc.pid)
        assert len(procs) >= 3  # frontend, coordinator, rank
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        for stream in (running, waiting):
            stream.join(max(0.1, signalled + 4.0 - time.monotonic()))
        for stream in (running, waiting):
            assert not stream.is_alive() and stream.error is None
            assert stream.ended_at is not None and stream.ended_at - signalled <= 4.0
            assert stream.lines[-1] == "[DONE]" and stream.finish_reasons() == ["abort"]
            assert not any("error" in chunk for chunk in stream.chunks())
        assert s.proc.wait(timeout=60) == 0
        assert wait_for(lambda: all_gone(procs), 30), [p.pid for p in procs if p.is_running()]
    finally:
        s.close()


# ------------------------------------------------------------------ a stuck coordinator


def test_a_stopped_coordinator_gets_503_error_events_and_an_unhealthy_health(
    heartbeat_server: Server,
):
    s = heartbeat_server
    coordinator = None
    try:
        procs = tree(s.proc.pid)
        (coordinator,) = [p for p in procs if "runtime.coordinator" in " ".join(p.cmdline())]
        stream = Stream(s.base)
        assert wait_for(lambda: len(stream.lines) >= 3, 60)
        coordinator.suspend()  # SIGSTOP
        # A new completion: 503 within a few seconds (at once once the silence is noticed).
        new = {"prompt": "x", "max_tokens": 2}
        r = httpx.post(f"{s.base}/v1/completions", json=new, timeout=10)
        assert r.status_code == 503
        assert "stopped answering" in r.json()["error"]["message"]
        # The open stream ends with an error event, then [DONE].
        stream.join(10)
        assert not stream.is_alive() and stream.error is None
        assert stream.lines[-1] == "[DONE]"
        (error,) = [chunk["error"] for chunk in stream.chunks() if "error" in chunk]
        assert error["type"] == "service_unavailable" and "stopped answering" in error["message"]
        health = httpx.get(f"{s.base}/health", timeout=5)
        assert (
            health.status_code == 503 and "stopped answering" in health.json()["error"]["message"]
        )
        r = httpx.post(f"{s.base}/v1/completions", json={"prompt": "x"}, timeout=2)
        assert r.status_code == 503  # refused at once (the timeout bounds the wait)
    finally:
        if coordinator is not None:
            coordinator.resume()  # SIGCONT: it (or its ranks, gone meanwhile) ends the run
        code = s.stop()
    assert code in (0, 1)  # 1 when the ranks left the silent coordinator, which then failed
    assert wait_for(lambda: all_gone(procs), 30)


# ------------------------------------------------------------------ in process


class Heard:
    """A client whose ``last_heard`` the test sets; records fail_all."""

    def __init__(self) -> None:
        self.last_heard = time.monotonic()
        self.failed: list[str] = []

    def fail_all(self, reason: str) -> int:
        self.failed.append(reason)
        return 0


def test_the_gate_recovers_for_new_requests_when_the_coordinator_is_heard_again():
    client = Heard()
    gate = Gate(client, heartbeat_timeout_s=0.2)  # type: ignore[arg-type]

    async def scenario() -> None:
        watch = asyncio.create_task(gate.watch())
        try:
            assert gate.unavailable() is None
            client.last_heard -= 1.0  # silent for a second
            await asyncio.sleep(0.2)
            reason, retry = gate.unavailable()
            assert (
                retry >= 1 and "stopped answering" in reason and "--heartbeat-timeout 0.2" in reason
            )
            assert client.failed and "stopped answering" in client.failed[0]
            client.last_heard = time.monotonic()  # heard again (SIGCONT)
            assert gate.unavailable() is None
            await asyncio.sleep(0.15)
            assert gate.stuck_since is None
        finally:
            watch.cancel()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def test_the_queue_limit_counts_choices_and_releases_them(tokenizer):
    client = ScriptedClient(script_for(tokenizer, "ok"))
    client.last_heard = time.monotonic() + 3600  # heard "in the future": never stuck
    gate = Gate(client, resident=2, max_waiting=1)  # type: ignore[arg-type]
    template = load_chat_template(default_model_dir(), tokenizer)
    frontend = Frontend(client, tokenizer, template, ServingLimits(MODEL, 512, 4096),
                        ServingMetrics(MODEL), gate=gate)  # fmt: skip
    with TestClient(create_app(frontend)) as http:
        # Nothing open: even more choices than the limit are admitted (they can run).
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "n": 5})
        assert r.status_code == 200 and gate.open == 0  # released at the end
        gate.open = 2  # two choices open: a third fits (2 + 1), a request of two does not
        assert http.post("/v1/completions", json={"prompt": "x", "n": 1}).status_code == 200
        r = http.post("/v1/completions", json={"prompt": "x", "n": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        streamed = http.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert streamed.status_code == 200 and gate.open == 2  # the stream released its one
        gate.open = 0
        gate.drain_until = time.monotonic() + 10
        r = http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and 1 <= int(r.headers["retry-after"]) <= 10
        assert "draining" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 503


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--ssl-keyfile", "KEY"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "CERT"], "--ssl-certfile needs --ssl-keyfile"),
        (["--ssl-certfile", "CERT", "--ssl-keyfile", "/no/such/key"], "--ssl-keyfile /no/such"),
        (["--ssl-certfile", "CERT", "--ssl-keyfile", "OTHER"], "not a PEM certificate"),
        (["--ssl-ca-certs", "CERT"], "--ssl-ca-certs needs"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
        (["--max-waiting-requests", "-2"], "--max-waiting-requests"),
    ],
)
def test_bad_serving_flags_fail_naming_the_flag(tmp_path, capsys, argv, needle):
    cert, key = self_signed(tmp_path)
    other_key = tmp_path / "other.pem"  # a key of another certificate
    other_key.write_bytes(ec_key_pem())
    paths = {"CERT": str(cert), "KEY": str(key), "OTHER": str(other_key)}
    argv = [paths.get(arg, arg) for arg in argv]
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        args = parser.parse_args(["run", *argv])
        serving_options(args, _run_parser(parser))
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def ec_key_pem() -> bytes:
    return ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def test_https_flags_reach_uvicorn_with_client_certificates_required(tmp_path):
    from runtime.frontend.serve import ServeOptions, uvicorn_config

    cert, key = self_signed(tmp_path)
    opts = ServeOptions(str(tmp_path), "127.0.0.1", 1, None, 1.0, (), ssl_keyfile=str(key),
                        ssl_certfile=str(cert), ssl_ca_certs=str(cert))  # fmt: skip

    async def app(scope, receive, send) -> None:
        pass

    config = uvicorn_config(app, opts)
    config.load()
    assert config.is_ssl and config.ssl.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ValueError, match="ssl_keyfile and ssl_certfile"):
        ServeOptions(str(tmp_path), "127.0.0.1", 1, None, 1.0, (), ssl_certfile=str(cert))


def test_the_bridge_heartbeat_reaches_the_client_and_says_when_the_engine_stops():
    from runtime.coordinator.engine import Engine, EngineConfig
    from runtime.coordinator.engine.bridge import FrontendBridge, ServingInfo
    from runtime.frontend.client import CoordinatorClient
    from tests.support import fake_rank

    wait_s = 20.0
    timeouts = {"handshake_timeout_s": wait_s, "catalog_timeout_s": wait_s,
                "completion_timeout_s": wait_s}  # fmt: skip
    engine = Engine(EngineConfig(world_size=1, max_slots=1, **timeouts))
    processes = fake_rank.spawn_ranks(engine.bind(), 1, fake_rank.FakeSpec())
    engine.start()
    client = CoordinatorClient()
    info = ServingInfo(fake_rank.MODEL, fake_rank.VOCAB, fake_rank.MAX_CONTEXT, 1, 1, 4096)
    bridge = FrontendBridge(engine, client.endpoints, info, heartbeat_interval_s=0.05)
    thread = threading.Thread(target=bridge.serve, daemon=True)

    async def until(predicate) -> bool:
        deadline = time.monotonic() + wait_s
        while not predicate() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return predicate()

    async def go() -> None:
        await client.wait_ready(wait_s)
        assert await until(lambda: client.heartbeat is not None and client.heartbeat.seq >= 3)
        assert client.heartbeat.serving and time.monotonic() - client.last_heard < 5
        engine.stop()  # the bridge keeps beating, now saying it does not serve
        assert await until(lambda: not client.heartbeat.serving)
        await client.close()

    engine.run_in_thread()
    thread.start()
    try:
        asyncio.run(go())
    finally:
        bridge.stop()
        thread.join(wait_s)
        bridge.close()
        engine.stop()
        assert fake_rank.join_ranks(processes) == [fake_rank.EXIT_OK]
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        FrontendBridge(engine, client.endpoints, info, heartbeat_interval_s=0)
