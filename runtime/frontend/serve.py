"""``flare run`` serving: the frontend process starts the coordinator and serves HTTP.

Process layout (``../ARCHITECTURE.md``)::

    flare run (frontend: uvicorn + FastAPI)
      └─ python -m runtime.coordinator   (engine, scheduler; same flags)
           └─ python -m runtime.ranks × N (torchrun environment)

The frontend binds the API sockets, starts the coordinator with its own flags
plus the endpoints, waits for the coordinator's first status (the ranks print
their program-preparation progress bar meanwhile), prints a one-line summary
and serves until Ctrl-C or SIGTERM; then it stops the coordinator, which stops
the ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass

import uvicorn

from runtime.frontend.chat import load_chat_template
from runtime.frontend.client import CoordinatorClient, CoordinatorGone
from runtime.frontend.debug import DebugLink
from runtime.frontend.defaults import GenerationDefaults, load_generation_defaults
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.protocol import ServingLimits
from runtime.frontend.server import Frontend, create_app
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.launch import spawn_coordinator

log = logging.getLogger("runtime.frontend")

READY_POLL_S = 0.5


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


class StartupError(RuntimeError):
    pass


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the stop signal once it has stopped.

    uvicorn re-raises SIGINT/SIGTERM after a graceful shutdown, which would end
    this process before it stops the coordinator; here a signal only asks the
    server to exit, and :func:`serve` cleans up and returns 0.  Open requests
    end at once with finish_reason "abort" (streams get their last chunk and
    ``[DONE]``) rather than being cut when the graceful period runs out.
    """

    def __init__(self, config: uvicorn.Config, client: CoordinatorClient) -> None:
        super().__init__(config)
        self.client = client
        self.loop = asyncio.get_running_loop()  # built inside the serving coroutine

    def handle_exit(self, sig: int, frame) -> None:
        self.loop.call_soon_threadsafe(self.client.abort_all)
        super().handle_exit(sig, frame)

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


def _stop_coordinator(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except Exception:
            proc.kill()
            proc.wait()


async def _serve(
    opts: ServeOptions, tokenizer: ModelTokenizer, template, defaults: GenerationDefaults
) -> int:
    client = CoordinatorClient()
    debug = DebugLink(client.run_dir) if opts.debug_endpoints else None
    proc = None
    try:
        started = time.monotonic()
        proc, status = await _start_coordinator(client, opts, debug)
        limits = ServingLimits(
            status.model_name,
            status.vocab_size,
            status.max_context,
            kv_tokens=status.kv_tokens,
            max_choices=opts.max_choices_per_request,
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
        )
        app = create_app(frontend)
        config = uvicorn.Config(
            app, host=opts.host, port=opts.port, log_level="warning", timeout_graceful_shutdown=5
        )
        server = _Server(config, client)
        watcher = asyncio.create_task(_watch(proc, server, client))
        scheme_host = f"[{opts.host}]" if ":" in opts.host else opts.host
        summary = (
            f"flare: serving {status.model_name} with TP={status.tensor_parallel_size}, "
            f"{len(status.graph_estimates_ns)} prepared programs, "
            f"at http://{scheme_host}:{opts.port}/v1"
        )
        announce = asyncio.create_task(_announce(server, summary, started))
        await server.serve()
        watcher.cancel()
        announce.cancel()
        return 0 if proc.poll() is None else 1
    finally:
        if proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, _stop_coordinator, proc)
        if debug is not None:
            debug.close()
        await client.close()


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


async def _watch(proc, server: uvicorn.Server, client: CoordinatorClient) -> None:
    """Stop serving if the coordinator dies; open requests end as aborted."""
    while proc.poll() is None:
        await asyncio.sleep(0.5)
    log.error("the coordinator exited with code %s; stopping", proc.returncode)
    client.abort_all()
    server.should_exit = True


def serve(opts: ServeOptions) -> int:
    """Run the HTTP deployment until interrupted; the exit code."""
    logging.basicConfig(level=logging.INFO, format="[frontend] %(levelname)s %(message)s")
    try:
        tokenizer = ModelTokenizer.from_dir(opts.model_dir)
        template = load_chat_template(opts.model_dir, tokenizer, opts.chat_template)
        defaults = load_generation_defaults(opts.model_dir, tokenizer.eos_token_ids)
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
        return asyncio.run(_serve(opts, tokenizer, template, defaults))
    except StartupError as exc:
        print(f"flare: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
