"""``/debug/*`` routes, present only with ``flare run --debug-endpoints``.

``GET /debug/trace?since=FENCE&limit=N``: the coordinator's recent trace lines
of frames after ``FENCE`` (default 0: every line still kept), oldest first, at
most the newest ``N``: ``{"frames": [...], "written": W, "dropped": D,
"last_fence": F}`` (``last_fence``: the newest frame returned, else ``FENCE``;
pass it as the next ``since`` to follow the trace).  Without ``--trace FILE``
the coordinator still keeps its ring of recent lines for this route.

``GET /debug/ranks``: ``{"ranks": [STATUS, ...]}``, every rank's answer to
``Control("inspect")`` (slots in use, pending tokens, pages held, programs and
their capture status, frames run, last fence, memory); ``flare ranks status``
prints it.

``POST /debug/profile?frames=N&timeout=S``: every rank runs ``torch.profiler``
over its next ``N`` frames (default 1) and writes its trace under the
``--profile-dir``; answered once all have, within ``S`` seconds (default 60;
a server without traffic answers 409 after it, and the traces appear once the
frames have run): ``{"directory": DIR, "frames": {RANK: N}, "files": [...]}``.

The API key guards these routes like every other (``ApiKeyMiddleware``).  The
frontend asks the coordinator over the debug link (:mod:`runtime.coordinator.debug`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runtime.frontend.client import CoordinatorGone
from runtime.frontend.protocol.errors import RequestError
from runtime.transport.channels import make_socket
from runtime.transport.links import LINK_VERSION

DEBUG_SOCKET = "debug"  # in the frontend's run directory
QUERY_TIMEOUT_S = 5.0
INSPECT_TIMEOUT_S = 10.0  # the coordinator gives the ranks 5 s


class DebugLink:
    """The frontend's end of the debug link: one query at a time, answers matched by nonce."""

    def __init__(self, run_dir: str) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = make_socket(self._context, zmq.DEALER)
        self._socket.bind(f"ipc://{os.path.join(run_dir, DEBUG_SOCKET)}")
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._nonces = itertools.count(1)
        self._lock = asyncio.Lock()

    async def query(self, timeout_s: float = QUERY_TIMEOUT_S, **fields: int | str) -> dict:
        """Send one query; its answer (raises CoordinatorGone without one in time)."""
        async with self._lock:
            nonce = next(self._nonces)
            query = {"v": LINK_VERSION, "nonce": nonce, **fields}
            await self._socket.send_multipart([b"", json.dumps(query).encode()])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise CoordinatorGone(
                        f"no debug answer from the coordinator in {timeout_s:g} s"
                    )
                try:
                    parts = await asyncio.wait_for(self._socket.recv_multipart(), remaining)
                except asyncio.TimeoutError:
                    continue
                answer = json.loads(parts[-1])
                if answer.get("nonce") == nonce or answer.get("nonce") == -1:
                    return answer  # else: the late answer of a query that timed out

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def _int_param(request: Request, name: str, default: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise RequestError(400, f"{name} must be an integer, got {text!r}", name) from None
    if value < 0:
        raise RequestError(400, f"{name} must be >= 0, got {value}", name)
    return value


async def _ask(link: DebugLink, timeout_s: float = QUERY_TIMEOUT_S, **fields: int | str):
    """The coordinator's answer, or the error response to return instead."""
    try:
        answer = await link.query(timeout_s, **fields)
    except CoordinatorGone as exc:
        error = RequestError(503, str(exc), None, "service_unavailable")
        return JSONResponse(error.to_json(), status_code=503)
    if not answer.get("ok"):
        error = RequestError(409, answer.get("error", "refused"), None, "server_error")
        return JSONResponse(error.to_json(), status_code=409)
    return answer


def add_debug_routes(app: FastAPI, link: DebugLink) -> None:
    """The ``/debug/*`` routes on ``app``, answered through ``link``."""

    @app.get("/debug/trace")
    async def debug_trace(request: Request) -> Response:
        try:
            since = _int_param(request, "since", 0)
            limit = _int_param(request, "limit", 0)
        except RequestError as exc:
            return JSONResponse(exc.to_json(), status_code=exc.status)
        answer = await _ask(link, query="trace", since=since, limit=limit)
        if isinstance(answer, Response):
            return answer
        frames = answer["frames"]
        return JSONResponse(
            {
                "frames": frames,
                "written": answer["written"],
                "dropped": answer["dropped"],
                "last_fence": frames[-1]["fence"] if frames else since,
            }
        )

    @app.get("/debug/ranks")
    async def debug_ranks() -> Response:
        answer = await _ask(link, INSPECT_TIMEOUT_S, query="ranks")
        if isinstance(answer, Response):
            return answer
        return JSONResponse({"ranks": answer["ranks"]})

    @app.post("/debug/profile")
    async def debug_profile(request: Request) -> Response:
        try:
            frames = _int_param(request, "frames", 1)
            timeout = _int_param(request, "timeout", 60)
        except RequestError as exc:
            return JSONResponse(exc.to_json(), status_code=exc.status)
        for name, value, high in (("frames", frames, 4096), ("timeout", timeout, 600)):
            if not 1 <= value <= high:
                error = RequestError(400, f"{name} must lie in [1, {high}], got {value}", name)
                return JSONResponse(error.to_json(), status_code=400)
        answer = await _ask(link, timeout + 5.0, query="profile", frames=frames, timeout=timeout)
        if isinstance(answer, Response):
            return answer
        return JSONResponse({key: answer[key] for key in ("directory", "frames", "files")})
