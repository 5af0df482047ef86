"""``flare run`` serving: the frontend process starts the coordinator and serves HTTP.

Process layout (``../ARCHITECTURE.md``)::

    flare run (frontend: uvicorn + FastAPI)
      └─ python -m runtime.coordinator   (engine, scheduler; same flags)
           └─ python -m runtime.ranks × N (torchrun environment)

The frontend binds the API sockets, starts the coordinator with its own flags
plus the endpoints, waits for the coordinator's first status (on CUDA rank 0
shows the graph capture's progress on a terminal meanwhile), prints a one-line
summary and serves until Ctrl-C or SIGTERM; then it stops the coordinator,
which stops the ranks.

On SIGTERM/SIGINT without ``--drain-timeout`` every open request ends at once
with finish_reason "abort" (running or still waiting for a slot); with
``--drain-timeout S`` new requests get 503 while open ones may finish for up
to S seconds, then the rest end with "abort" (a second signal aborts at
once).  Either way the coordinator and its ranks are stopped and the exit
code is 0.  The coordinator's heartbeat (``--heartbeat-interval``) is watched
by :meth:`runtime.frontend.server.admission.Gate.watch`; see docs/serving.md,
"Reliability".
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass, field

import uvicorn

from runtime.catalog import describe_counts
from runtime.deploy.launch import spawn_coordinator
from runtime.frontend.chat import load_chat_template
from runtime.frontend.client import CoordinatorClient, CoordinatorGone
from runtime.frontend.connections import (
    ACCEPT_BATCH,
    DEFAULT_HEADER_TIMEOUT_S,
    ConnectionGuard,
    default_max_connections,
    fd_headroom,
    quiet_accept_errors,
    raise_fd_limit,
    widen_listen_backlog,
)
from runtime.frontend.debug import DebugLink
from runtime.frontend.defaults import GenerationDefaults, load_generation_defaults
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.preprocess.image_processor import ImageProcessorConfig
from runtime.frontend.preprocess.image_tokens import ImageTokens, load_vision
from runtime.frontend.preprocess.pool import DEFAULT_WORKERS, PreprocessPool
from runtime.frontend.protocol.images import ImageLimits
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.server.admission import Gate
from runtime.frontend.server.app import create_app
from runtime.frontend.server.state import Frontend
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.logs import basic_config, install_rate_limit

log = logging.getLogger("runtime.frontend")

READY_POLL_S = 0.5
DRAIN_POLL_S = 0.05
STOP_COORDINATOR_S = 60.0  # its engine stops, then its ranks
STOP_FAILED_COORDINATOR_S = 5.0  # one that is silent or failed: SIGKILL after this
WATCH_S = 0.1  # how often _watch looks whether the coordinator process exited
# A coordinator whose engine failed exits by itself within a few seconds (its
# ranks get 2 s, runtime.deploy.local); one still there after this is stopped.
FAILED_EXIT_S = 8.0
GRACEFUL_SHUTDOWN_S = 5  # uvicorn's wait for responses still being written


@dataclass(frozen=True)
class ServeOptions:
    model_dir: str
    host: str
    port: int
    api_key: str | tuple[str, ...] | None  # --api-key: the keys (several: tenants)
    startup_timeout_s: float
    coordinator_args: tuple[str, ...]  # the run flags, passed on unchanged
    chat_template: str | None = None  # --chat-template FILE (None: the model's)
    max_choices_per_request: int = 1024  # --max-choices-per-request: prompts x n bound
    debug_endpoints: bool = False  # --debug-endpoints: the /debug/* routes
    heartbeat_interval_s: float = 1.0  # --heartbeat-interval (the coordinator's own flag)
    heartbeat_timeout_s: float = 10.0  # --heartbeat-timeout: silence that means stuck
    drain_timeout_s: float = 0.0  # --drain-timeout: 0 aborts open requests at once
    max_waiting_requests: int | None = None  # --max-waiting-requests (None: no limit)
    ssl_keyfile: str | None = None  # --ssl-keyfile, --ssl-certfile: HTTPS
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # --ssl-ca-certs: client certificates required
    log_level: str = "warning"  # --log-level: this process's (the coordinator gets the flag)
    # Hostile clients (docs/serving.md, "Hostile clients and limits"):
    max_connections: int | None = None  # --max-connections (None: from the fd limit)
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # --header-timeout
    preprocess_workers: int = DEFAULT_WORKERS  # --preprocess-workers (0: none)
    # --limit-mm-per-prompt, --max-image-bytes, --max-image-pixels, --max-image-frames
    image_limits: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s:g})"
            )
        if not 0 <= self.drain_timeout_s < float("inf"):
            raise ValueError(f"drain_timeout_s must be >= 0 seconds, got {self.drain_timeout_s!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs needs ssl_certfile and ssl_keyfile")
        self._check_hostile_limits()

    def _check_hostile_limits(self) -> None:
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not 0 < self.header_timeout_s < float("inf"):
            raise ValueError(f"header_timeout_s must be > 0 seconds, got {self.header_timeout_s!r}")
        if self.preprocess_workers < 0:
            raise ValueError(f"preprocess_workers must be >= 0, got {self.preprocess_workers}")


class StartupError(RuntimeError):
    pass


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the stop signal once it has stopped.

    uvicorn re-raises SIGINT/SIGTERM after a graceful shutdown, which would end
    this process before it stops the coordinator; here a signal only asks the
    server to exit, and :func:`serve` cleans up and returns 0.  Open requests
    end at once with finish_reason "abort" (streams get their last chunk and
    ``[DONE]``) rather than being cut when the graceful period runs out; with
    a drain period (``drain_s``) they may finish first, new ones getting 503.
    """

    def __init__(
        self, config: uvicorn.Config, client: CoordinatorClient, gate: Gate, drain_s: float = 0.0
    ) -> None:
        super().__init__(config)
        self.client = client
        self.gate = gate
        self.drain_s = drain_s
        self.draining: asyncio.Task | None = None
        self.loop = asyncio.get_running_loop()  # built inside the serving coroutine

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_s > 0 and self.draining is None and not self.should_exit:
            self.loop.call_soon_threadsafe(self._start_drain)
            return
        self.loop.call_soon_threadsafe(self._abort)
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        if self.draining is None and not self.should_exit:
            self.draining = self.loop.create_task(self._drain(), name="flare-drain")

    async def _drain(self) -> None:
        """New requests get 503; open ones finish, until the drain period ends."""
        deadline = time.monotonic() + self.drain_s
        self.gate.drain_until = deadline
        log.info(
            "draining: %d open requests (choices) may finish within %g s; new ones get 503",
            self.gate.open,
            self.drain_s,
        )
        while self.gate.open > 0 and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.gate.open > 0:
            log.warning("the drain period ended: %d open requests end as aborted", self.gate.open)
        self._abort()
        self.should_exit = True

    def _abort(self) -> None:
        self.gate.stopping = True
        self.client.abort_all()

    @contextlib.contextmanager
    def capture_signals(self):
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def _start_coordinator(
    client: CoordinatorClient, opts: ServeOptions, debug: DebugLink | None
):
    endpoints = client.endpoints
    api = ["--api-requests", endpoints.requests, "--api-outputs", endpoints.outputs]
    if debug is not None:
        api += ["--api-debug", debug.endpoint]
    proc = spawn_coordinator([*opts.coordinator_args, *api])
    deadline = time.monotonic() + opts.startup_timeout_s
    while True:
        try:
            return proc, await client.wait_ready(READY_POLL_S)
        except CoordinatorGone:
            if proc.poll() is not None:
                raise StartupError(
                    f"the coordinator exited with code {proc.returncode} during start-up"
                ) from None
            if time.monotonic() > deadline:
                proc.terminate()
                raise StartupError(
                    f"the coordinator was not serving after {opts.startup_timeout_s:g} s"
                ) from None


def _stop_coordinator(proc, grace_s: float = STOP_COORDINATOR_S) -> None:
    """SIGTERM (the coordinator stops its ranks), SIGKILL after ``grace_s`` (its
    ranks then get SIGTERM as their parent dies, runtime.deploy.launch)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except Exception:
            log.error("the coordinator did not stop within %g s: killed", grace_s)
            proc.kill()
            proc.wait()


def _serving_limits(
    status, opts: ServeOptions, vision: tuple[ImageTokens, ImageProcessorConfig] | None
) -> ServingLimits:
    return ServingLimits(
        status.model_name,
        status.vocab_size,
        status.max_context,
        kv_tokens=status.kv_tokens,
        max_choices=opts.max_choices_per_request,
        # A LLaVA model takes images (docs/serving.md, "Images").
        images=opts.image_limits,
        accepts_images=vision is not None,
        image_tokens=None if vision is None else vision[0],
    )


async def _start_pool(
    limits: ServingLimits,
    template,
    defaults: GenerationDefaults,
    opts: ServeOptions,
    processor: ImageProcessorConfig | None,
) -> PreprocessPool:
    pool = PreprocessPool(
        limits,
        template,
        defaults,
        opts.model_dir,
        opts.preprocess_workers,
        image_processor=processor,
    )
    try:
        await pool.start()
    except Exception as exc:
        await pool.close()  # the workers that did start
        raise StartupError(f"the preprocessing workers did not start: {exc}") from None
    return pool


async def _serve(
    opts: ServeOptions,
    tokenizer: ModelTokenizer,
    template,
    defaults: GenerationDefaults,
    vision: tuple[ImageTokens, ImageProcessorConfig] | None = None,
) -> int:
    client = CoordinatorClient()
    debug = DebugLink(client.run_dir) if opts.debug_endpoints else None
    proc = None
    gate: Gate | None = None
    pool: PreprocessPool | None = None
    try:
        started = time.monotonic()
        proc, status = await _start_coordinator(client, opts, debug)
        limits = _serving_limits(status, opts, vision)
        processor = None if vision is None else vision[1]
        if opts.preprocess_workers > 0:  # large bodies are prepared there
            pool = await _start_pool(limits, template, defaults, opts, processor)
        gate = Gate(
            client,
            opts.heartbeat_timeout_s,
            resident=status.max_concurrency,
            max_waiting=opts.max_waiting_requests,
        )
        frontend = Frontend(
            client,
            tokenizer,
            template,
            limits,
            ServingMetrics(status.model_name),
            opts.api_key,
            defaults,
            debug=debug,
            gate=gate,
            preprocess=pool,
            image_processor=processor,
        )
        app = create_app(frontend)
        quiet_accept_errors(asyncio.get_running_loop())
        # What start-up made lives as long as the process: out of the collector's way
        # (a full collection of it stalled the event loop for ~0.1 s).
        gc.collect()
        gc.freeze()
        server = _Server(uvicorn_config(app, opts), client, gate, opts.drain_timeout_s)
        watcher = asyncio.create_task(_watch(proc, server, client, gate))
        liveness = asyncio.create_task(gate.watch(), name="flare-coordinator-liveness")
        scheme = "https" if opts.ssl_certfile else "http"
        scheme_host = f"[{opts.host}]" if ":" in opts.host else opts.host
        summary = (
            f"flare: serving {status.model_name} with TP={status.tensor_parallel_size}, "
            f"catalog of {describe_counts(status.graph_estimates_ns)}, "
            f"at {scheme}://{scheme_host}:{opts.port}/v1"
        )
        announce = asyncio.create_task(_announce(server, summary, started))
        backlog = asyncio.create_task(widen_listen_backlog(server))
        await server.serve()
        for task in (watcher, liveness, announce, backlog):
            task.cancel()
        return 0 if proc.poll() is None else 1
    finally:
        if proc is not None:
            # A silent coordinator (stopped, hung) gets its heartbeat timeout, not a
            # minute; one whose engine failed a few seconds.
            stuck = gate is not None and gate.stuck() is not None
            grace = STOP_COORDINATOR_S
            if stuck:
                grace = max(STOP_FAILED_COORDINATOR_S, opts.heartbeat_timeout_s)
            elif client.failure is not None:
                grace = STOP_FAILED_COORDINATOR_S
            await asyncio.get_running_loop().run_in_executor(None, _stop_coordinator, proc, grace)
        if debug is not None:
            debug.close()
        if pool is not None:
            await pool.close()
        await client.close()


def uvicorn_config(app, opts: ServeOptions) -> uvicorn.Config:
    """uvicorn's settings: HTTPS with ``--ssl-keyfile``/``--ssl-certfile`` (client
    certificates required with ``--ssl-ca-certs``), as vLLM passes them; the
    request-head timeout and the connection limit (runtime.frontend.connections:
    ``--header-timeout``, ``--max-connections``, by default the descriptor limit
    less a reserve); uvicorn's own log lines rate-limited like this process's."""
    tls = {}
    if opts.ssl_certfile is not None:
        tls = {"ssl_keyfile": opts.ssl_keyfile, "ssl_certfile": opts.ssl_certfile}
        if opts.ssl_ca_certs is not None:
            tls |= {"ssl_ca_certs": opts.ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    max_connections = opts.max_connections or default_max_connections()
    guard = ConnectionGuard(max_connections, opts.header_timeout_s)
    fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if max_connections + fd_headroom() > fd_limit:
        log.warning(
            "--max-connections %d leaves too few of the %d open files this process may have: "
            "a flood of connections can exhaust them",
            max_connections,
            fd_limit,
        )
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=guard.protocol_class(),
        backlog=ACCEPT_BATCH,  # accepted per event-loop turn; the kernel queues more
        **tls,
    )
    for name in ("uvicorn", "uvicorn.access"):  # configured by uvicorn.Config just now
        install_rate_limit(logging.getLogger(name))
    return config


async def _announce(server: uvicorn.Server, summary: str, started: float) -> None:
    """The one-line summary, once the socket listens."""
    while not server.started:
        await asyncio.sleep(0.02)
    print(f"{summary} (ready in {time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)


def _check_port(host: str, port: int) -> None:
    """Fail before the model loads if the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


async def _watch(proc, server: uvicorn.Server, client: CoordinatorClient, gate: Gate) -> None:
    """Stop serving when the coordinator exits, or fails and does not exit by itself.

    Exit code 0 is a stop someone asked for (a signal of its own): open requests
    end as aborted.  Any other exit (its engine failed, it was killed) loses the
    open requests' work: each ends with an error (a 500, an SSE error event),
    /health and new requests get 503 naming the exit.
    """
    failed_at = None
    while proc.poll() is None:
        await asyncio.sleep(WATCH_S)
        if client.failure is None:
            continue
        failed_at = failed_at or time.monotonic()
        if time.monotonic() - failed_at > FAILED_EXIT_S:  # its shutdown hangs: stop it
            reason = (
                f"the coordinator did not exit within {FAILED_EXIT_S:g} s of its engine's "
                f"failure ({client.failure})"
            )
            log.error("%s; stopping (%d open requests fail)", reason, client.lose(reason))
            server.should_exit = True
            return
    code = proc.returncode
    if code == 0:
        log.error("the coordinator exited (code 0: stopped by a signal of its own); stopping")
        gate.stopping = True
        client.abort_all()
    else:
        how = f"exited with code {code}"
        if code < 0:
            with contextlib.suppress(ValueError):
                how = f"was killed by {signal.Signals(-code).name}"
        failure = f" ({client.failure})" if client.failure else ""
        reason = f"the coordinator {how}{failure}"
        log.error("%s; stopping (%d open requests fail)", reason, client.lose(reason))
    server.should_exit = True


def serve(opts: ServeOptions) -> int:
    """Run the HTTP deployment until interrupted; the exit code."""
    # A flood of one message is a burst and a count (the handler is rate-limited).
    basic_config(opts.log_level.upper(), "[frontend] %(levelname)s %(message)s")
    raise_fd_limit()  # room for --max-connections (its default follows the new limit)
    try:
        tokenizer = ModelTokenizer.from_dir(opts.model_dir)
        template = load_chat_template(opts.model_dir, tokenizer, opts.chat_template)
        defaults = load_generation_defaults(opts.model_dir, tokenizer.eos_token_ids)
        vision = load_vision(opts.model_dir)  # None: a text-only model
    except ValueError as exc:  # names the file or the flag
        print(f"flare: {exc}", file=sys.stderr)
        return 1
    if defaults.given:
        taken = ", ".join(
            f"{key}={getattr(defaults, 'max_tokens' if key == 'max_new_tokens' else key)}"
            for key in defaults.given
        )
        log.info("request defaults from the model's generation_config.json: %s", taken)
    try:
        _check_port(opts.host, opts.port)
        return asyncio.run(_serve(opts, tokenizer, template, defaults, vision))
    except StartupError as exc:
        print(f"flare: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
