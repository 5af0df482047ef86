"""The debug link: the frontend's ``/debug/*`` routes asking the coordinator process.

Only with ``flare run --debug-endpoints``.  The frontend binds a DEALER socket
(``ipc://`` in its private 0700 run directory, beside the API sockets) and
passes its endpoint as ``--api-debug``; the coordinator connects a REP socket
served by one thread (:class:`DebugService`), apart from the engine thread and
the request bridge, so a large answer never delays a token.

Messages are JSON objects, one per ZeroMQ message, versioned by ``"v"``:

* ``{"v": 1, "nonce": N, "query": "trace", "since": FENCE, "limit": L}``
  (``limit`` optional: the most lines, the newest kept) is answered by
  ``{"v": 1, "nonce": N, "ok": true, "written": W, "dropped": D,
  "frames": [LINE, ...]}`` where each ``LINE`` is a trace line (an object) of a
  frame after ``FENCE``, oldest first, from the engine's ring of recent lines;
* ``{"v": 1, "nonce": N, "query": "ranks"}`` by ``{..., "ok": true, "ranks":
  [STATUS, ...]}``, every rank's answer to ``Control("inspect")``
  (:meth:`RankStatus.to_json`), by rank;
* ``{"v": 1, "nonce": N, "query": "profile", "frames": F, "timeout": S}`` by
  ``{..., "ok": true, "directory": DIR, "frames": {RANK: COUNT}, "files":
  [PATH, ...]}`` once every rank profiled its next ``F`` frames (``COUNT`` 0:
  that rank could not write its trace);
* a failure by ``{"v": 1, "nonce": N, "ok": false, "error": "..."}``.
"""

from __future__ import annotations

import json
import logging
import threading

import zmq

from runtime.coordinator.engine.config import EngineError
from runtime.coordinator.engine.core import Engine
from runtime.transport.channels import make_socket
from runtime.transport.control import profile_path
from runtime.transport.links import LINK_VERSION

log = logging.getLogger("runtime.coordinator.debug")

POLL_MS = 100
MAX_QUERY_BYTES = 4096
QUERIES = ("trace", "ranks", "profile")
MAX_PROFILE_TIMEOUT_S = 600
INSPECT_TIMEOUT_S = 5.0


def parse_query(data: bytes) -> dict:
    """A query's fields, or ValueError naming what is wrong."""
    if len(data) > MAX_QUERY_BYTES:
        raise ValueError(f"a query has at most {MAX_QUERY_BYTES} bytes, got {len(data)}")
    query = json.loads(data)
    if not isinstance(query, dict) or query.get("v") != LINK_VERSION:
        raise ValueError(f"not a version-{LINK_VERSION} query object")
    nonce = query.get("nonce")
    if isinstance(nonce, bool) or not isinstance(nonce, int):
        raise ValueError("nonce must be an integer")
    if query.get("query") not in QUERIES:
        raise ValueError(f"unknown query {query.get('query')!r}")
    for name in ("since", "limit", "frames", "timeout"):
        value = query.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return query


def trace_answer(engine: Engine, nonce: int, since: int, limit: int | None) -> bytes:
    """The answer to a trace query: the ring's lines are JSON already, joined as they are."""
    trace = engine.trace
    if trace is None:
        return error_answer(nonce, "the engine is not tracing")
    lines = trace.lines_since(since, limit)
    counters = trace.counters()
    head = json.dumps(
        {"v": LINK_VERSION, "nonce": nonce, "ok": True,
         "written": counters["trace_lines"], "dropped": counters["trace_dropped"]},
        separators=(",", ":"),
    )  # fmt: skip
    return f'{head[:-1]},"frames":[{",".join(lines)}]}}'.encode()


def ranks_answer(engine: Engine, nonce: int) -> bytes:
    try:
        statuses = engine.inspect_ranks(INSPECT_TIMEOUT_S)
    except EngineError as exc:
        return error_answer(nonce, str(exc))
    ranks = [status.to_json() for status in statuses]
    return json.dumps({"v": LINK_VERSION, "nonce": nonce, "ok": True, "ranks": ranks}).encode()


def profile_answer(
    engine: Engine, nonce: int, directory: str | None, frames: int, timeout_s: int
) -> bytes:
    if directory is None:
        return error_answer(nonce, "the ranks have no profile directory (--profile-dir)")
    if not 1 <= frames <= 4096:
        return error_answer(nonce, f"frames must lie in [1, 4096], got {frames}")
    if not 1 <= timeout_s <= MAX_PROFILE_TIMEOUT_S:
        return error_answer(
            nonce, f"timeout must lie in [1, {MAX_PROFILE_TIMEOUT_S}] seconds, got {timeout_s}"
        )
    try:
        profiled, profile = engine.profile_ranks(frames, float(timeout_s))
    except EngineError as exc:
        return error_answer(nonce, str(exc))
    files = [profile_path(directory, profile, rank) for rank, n in profiled.items() if n > 0]
    answer = {
        "v": LINK_VERSION, "nonce": nonce, "ok": True, "directory": directory,
        "frames": {str(rank): n for rank, n in profiled.items()}, "files": files,
    }  # fmt: skip
    return json.dumps(answer).encode()


def error_answer(nonce: int, error: str) -> bytes:
    return json.dumps({"v": LINK_VERSION, "nonce": nonce, "ok": False, "error": error}).encode()


class DebugService:
    """Answers the frontend's debug queries from a thread of its own until :meth:`close`."""

    def __init__(self, engine: Engine, endpoint: str, profile_dir: str | None = None) -> None:
        if not endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"the debug endpoint must be ipc:// or tcp://, got {endpoint!r}")
        self.engine = engine
        self.profile_dir = profile_dir
        self._context = zmq.Context()
        self._socket = make_socket(self._context, zmq.REP)
        self._socket.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flare-debug", daemon=True)

    def start(self) -> DebugService:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self._socket.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(POLL_MS):
                continue
            data = self._socket.recv()
            try:
                query = parse_query(data)
            except ValueError as exc:  # JSONDecodeError is a ValueError
                log.warning("debug link: refused a query: %s", exc)
                self._socket.send(error_answer(-1, f"bad query: {exc}"))
                continue
            self._socket.send(self._answer(query))

    def _answer(self, query: dict) -> bytes:
        nonce = query["nonce"]
        if query["query"] == "ranks":
            return ranks_answer(self.engine, nonce)
        if query["query"] == "profile":
            frames, timeout = query.get("frames", 1), query.get("timeout", 60)
            return profile_answer(self.engine, nonce, self.profile_dir, frames, timeout)
        limit = query.get("limit") or None
        return trace_answer(self.engine, nonce, query.get("since", 0), limit)
