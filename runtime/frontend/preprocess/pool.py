"""The frontend's pool of preprocessing workers (see :mod:`runtime.frontend.preprocess`):
it starts them, hands each a large body and checks its answer, and replaces one
that overruns its time, dies, or keeps memory it grew."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import sys
import time
from typing import Any

import msgpack

from runtime.frontend.chat import ChatTemplate
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.preprocess.image_processor import ImageProcessorConfig
from runtime.frontend.preprocess.memory import TRIM_BODY_BYTES, TRIMMER
from runtime.frontend.preprocess.wire import (
    FRAME,
    MAX_FRAME_BYTES,
    Body,
    WireError,
    body_size,
    error_from_wire,
    requests_from_wire,
    to_wire,
    unpack_header,
)
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import GenerationRequest, ServingLimits

log = logging.getLogger("runtime.frontend")

PREPARE_TIMEOUT_S = 30.0  # a worker's job: longer is a 413, and the worker is replaced
DEFAULT_WORKERS = 2
MAX_QUEUED_PER_WORKER = 4  # large requests waiting for a busy worker, per worker
RECYCLE_GROWTH_BYTES = 32 << 20  # a worker grown this much over its start is replaced
WORKER_START_S = 120.0
PIPE_BYTES = 1 << 20  # the pipe to a worker (Linux's default limit for one)
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.ready_rss = 0
        self.jobs = 0

    async def send(self, header: dict[str, Any], payload: Body = b"") -> None:
        """A frame; the payload slice by slice, so no copy of a large body is made
        (nor a long memcpy on the event loop)."""
        stdin = self.proc.stdin
        assert stdin is not None
        head = msgpack.packb(header, use_bin_type=True)
        stdin.write(FRAME.pack(len(head), body_size(payload)) + head)
        for chunk in [payload] if isinstance(payload, bytes) else payload:
            view = memoryview(chunk)
            for start in range(0, len(view), PIPE_BYTES):
                stdin.write(view[start : start + PIPE_BYTES])
                await stdin.drain()
        await stdin.drain()

    async def receive(self) -> tuple[dict[str, Any], bytes]:
        stdout = self.proc.stdout
        assert stdout is not None
        size_head, size_payload = FRAME.unpack(await stdout.readexactly(FRAME.size))
        if size_head > MAX_FRAME_BYTES or size_payload > MAX_FRAME_BYTES:
            raise WireError("a frame over the size limit")
        header = unpack_header(await stdout.readexactly(size_head))
        payload = await stdout.readexactly(size_payload) if size_payload else b""
        return header, payload

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


class PreprocessPool:
    """``workers`` preprocessing processes (see the module docstring); :meth:`start`
    before use (it waits until they are ready), :meth:`close` at the end."""

    def __init__(
        self,
        limits: ServingLimits,
        template: ChatTemplate,
        defaults: GenerationDefaults,
        model_dir: str,
        workers: int = DEFAULT_WORKERS,
        timeout_s: float = PREPARE_TIMEOUT_S,
        max_queued: int | None = None,
        image_processor: ImageProcessorConfig | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.limits = limits
        self.size = workers
        self.timeout_s = timeout_s
        self.max_queued = workers * MAX_QUEUED_PER_WORKER if max_queued is None else max_queued
        self.config = {
            "model_dir": str(model_dir),
            "limits": to_wire(limits),
            "template": to_wire(template),
            "defaults": to_wire(defaults),
            # The served model's preprocessor_config.json (None: a text-only model).
            "image_processor": None if image_processor is None else to_wire(image_processor),
        }
        self.workers: set[_Worker] = set()
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self.waiting = 0
        self.replaced = 0  # workers killed (time limit, death) or recycled (memory)
        self.closed = False
        self._tasks: set[asyncio.Task] = set()

    # -------------------------------------------------------------- life

    async def start(self) -> None:
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        for worker in workers:
            self.idle.put_nowait(worker)

    async def _spawn(self) -> _Worker:
        env = dict(os.environ)
        here = os.path.abspath(__file__)  # runtime/frontend/preprocess/pool.py
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))
        path = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = f"{root}{os.pathsep}{path}" if path else root
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "runtime.frontend.preprocess",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            limit=1 << 20,
        )
        _widen_pipe(proc.stdin)
        worker = _Worker(proc)
        self.workers.add(worker)
        try:
            await worker.send(self.config)
            header, _ = await asyncio.wait_for(worker.receive(), WORKER_START_S)
            if header.get("ready") is not True:
                raise WireError(f"not ready: {header.get('error')}")
            rss = header.get("rss")
            worker.ready_rss = rss if type(rss) is int else 0
        except BaseException:
            self._discard(worker)
            raise
        return worker

    def _discard(self, worker: _Worker) -> None:
        self.workers.discard(worker)
        worker.kill()
        if worker.proc.stdin is not None:
            worker.proc.stdin.close()
        self._background(worker.proc.wait())

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _replace(self, worker: _Worker, why: str) -> None:
        """Kill ``worker`` and start another in its place (in the background)."""
        self.replaced += 1
        self._discard(worker)
        if not self.closed:
            log.warning("preprocessing worker %d replaced: %s", worker.proc.pid, why)
            self._background(self._respawn())

    async def _respawn(self) -> None:
        delay = 0.5
        while not self.closed:
            try:
                worker = await self._spawn()
            except Exception as exc:
                log.error("a preprocessing worker failed to start (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            if self.closed:
                self._discard(worker)
            else:
                self.idle.put_nowait(worker)
            return

    async def close(self) -> None:
        self.closed = True
        for worker in list(self.workers):
            if worker.proc.stdin is not None:
                worker.proc.stdin.close()  # EOF: it exits
        for worker in list(self.workers):
            try:
                await asyncio.wait_for(worker.proc.wait(), 2.0)
            except asyncio.TimeoutError:
                worker.kill()
                await worker.proc.wait()
        self.workers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc.returncode is None]

    # -------------------------------------------------------------- jobs

    async def prepare(self, route: str, body: Body) -> list[GenerationRequest] | bytes:
        """The requests of a generation route's body, or the JSON response of a
        /tokenize or /detokenize body; RequestError for an invalid one or when the
        pool is overloaded (503) or the job overran its time (413)."""
        if self.waiting >= self.max_queued + self.size:
            raise RequestError(
                503,
                f"the server is preparing too many large requests ({self.waiting}); retry later",
                None,
                "service_unavailable",
            )
        self.waiting += 1
        try:
            try:
                worker = await asyncio.wait_for(self.idle.get(), self.timeout_s)
            except asyncio.TimeoutError:
                raise RequestError(
                    503,
                    f"no preprocessing worker was free within {self.timeout_s:g} s; retry later",
                    None,
                    "service_unavailable",
                ) from None
            # Shielded: a handler cancelled meanwhile leaves the job to finish (or be
            # timed out) and the worker to go back to the pool.
            job = asyncio.ensure_future(self._job(worker, route, body))
            job.add_done_callback(_retrieved)
            result, error = await asyncio.shield(job)
            del job  # (no reference cycle through a traceback keeps the body alive)
        finally:
            self.waiting -= 1
        if error is not None:
            try:
                raise error
            finally:  # no cycle (error -> traceback -> this frame -> error) holds the body
                error = None
        return result

    async def _job(
        self, worker: _Worker, route: str, body: Body
    ) -> tuple[Any, RequestError | None]:
        """(the result, None) or (None, the error): nothing raised, so no traceback
        (holding this frame, and the body) outlives the job in the task."""
        started = time.monotonic()
        try:
            header, payload = await asyncio.wait_for(
                self._exchange(worker, route, body), self.timeout_s
            )
        except asyncio.TimeoutError:
            self._replace(worker, f"a {route} job ran over {self.timeout_s:g} s")
            return None, RequestError(
                413,
                f"the request took more than {self.timeout_s:g} s to prepare (parse, render, "
                "tokenize): it is too large for this server",
                None,
                code="request_too_large",
            )
        except (OSError, EOFError, asyncio.IncompleteReadError, WireError) as exc:
            code = worker.proc.returncode
            self._replace(worker, f"it failed ({type(exc).__name__}; exit code {code})")
            return None, RequestError(
                500, "the request's preprocessing worker failed", None, "server_error"
            )
        finally:
            if body_size(body) >= TRIM_BODY_BYTES:
                TRIMMER.soon()
        worker.jobs += 1
        rss = header.get("rss")
        if type(rss) is int and rss > worker.ready_rss + RECYCLE_GROWTH_BYTES:
            self._replace(
                worker, f"its memory grew to {rss >> 20} MiB ({worker.ready_rss >> 20} at start)"
            )
        elif worker in self.workers:
            self.idle.put_nowait(worker)
        elapsed = time.monotonic() - started
        if elapsed > 1.0:
            log.info("a %d-byte %s body took %.1f s to prepare", body_size(body), route, elapsed)
        try:
            return self._result(route, header, payload)
        except WireError as exc:
            log.error("a preprocessing worker answered badly: %s", exc)
            return None, RequestError(
                500, "the request's preprocessing worker answered badly", None, "server_error"
            )

    @staticmethod
    async def _exchange(worker: _Worker, route: str, body: Body) -> tuple[dict[str, Any], bytes]:
        await worker.send({"route": route}, body)
        return await worker.receive()

    def _result(self, route: str, header: dict[str, Any], payload: bytes):
        """(the result, None) or (None, the request's error); WireError for a bad answer."""
        if "error" in header:
            return None, error_from_wire(header["error"])
        if route in ("tokenize", "detokenize"):
            if header.get("json") is not True:
                raise WireError("expected a JSON response")
            return payload, None
        return requests_from_wire(header.get("requests"), self.limits), None


def _widen_pipe(writer: asyncio.StreamWriter | None) -> None:
    """Linux: a 1 MiB pipe to the worker (not 64 KiB): a large body crosses in
    fewer event-loop turns."""
    pipe = writer.get_extra_info("pipe") if writer is not None else None
    if pipe is not None:
        with contextlib.suppress(OSError, ValueError):
            fcntl.fcntl(pipe.fileno(), F_SETPIPE_SZ, PIPE_BYTES)


def _retrieved(task: asyncio.Future) -> None:
    """A job's outcome counts as seen (its handler may have gone)."""
    if not task.cancelled():
        task.exception()


def _die_with_parent() -> None:
    """Linux: the worker gets SIGKILL if the frontend dies (no orphans)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
