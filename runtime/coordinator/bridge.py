"""The coordinator's side of the frontend link: API messages in, engine calls out.

The HTTP frontend is a process of its own (so HTTP load does not steal the
scheduler's time).  It binds two ZeroMQ sockets and passes their endpoints to
the coordinator process, which connects:

* ``requests`` (frontend PUSH -> coordinator PULL): :class:`Submit`,
  :class:`Cancel`, :class:`Publish`, :class:`StatusQuery`;
* ``outputs`` (coordinator PUSH -> frontend PULL): :class:`Output`,
  :class:`Status`, :class:`Heartbeat`.

Every message is the msgpack envelope of :mod:`runtime.transport.codec`,
validated on receipt; a malformed one is logged and skipped.  The bridge thread
turns requests into engine calls; the engine thread sends each request's
outputs from the stream listener, so tokens leave the coordinator the moment a
completion is applied.  A third thread sends a :class:`Heartbeat` every
``heartbeat_interval_s`` (``--heartbeat-interval``), whatever the other two
are doing, so the frontend can tell a stuck coordinator (stopped, hung) from
a busy one.  Sends from all threads share one lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import zmq

from runtime.coordinator.engine import Engine, EngineError, RequestStream
from runtime.coordinator.engine.stream import ABORTED, ERROR, TokenEvent
from runtime.transport.api import (
    MAX_ERROR_CHARS,
    Cancel,
    Heartbeat,
    Output,
    Publish,
    Status,
    StatusQuery,
    Submit,
)
from runtime.transport.channels import make_socket
from runtime.transport.codec import decode_or_log, encode

log = logging.getLogger("runtime.coordinator.bridge")

POLL_MS = 100
ERROR_GRACE_S = 0.5
REFUSED = "refused"


@dataclass(frozen=True)
class ApiEndpoints:
    """Where the frontend listens: ``requests`` (it pushes), ``outputs`` (it pulls)."""

    requests: str
    outputs: str

    def __post_init__(self) -> None:
        for name in ("requests", "outputs"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.startswith(("ipc://", "tcp://")):
                raise ValueError(f"{name} endpoint must be ipc:// or tcp://, got {value!r}")


@dataclass(frozen=True)
class ServingInfo:
    """What a :class:`Status` says about the deployment besides the metric values."""

    model_name: str
    vocab_size: int
    max_context: int
    tensor_parallel_size: int
    max_concurrency: int
    kv_tokens: int


class FrontendBridge:
    """Serves one frontend for one started engine; :meth:`serve` runs until ``stop``."""

    def __init__(
        self,
        engine: Engine,
        endpoints: ApiEndpoints,
        info: ServingInfo,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        if not 0 < heartbeat_interval_s < float("inf"):
            raise ValueError(
                f"heartbeat_interval_s must be a finite number of seconds > 0, "
                f"got {heartbeat_interval_s!r}"
            )
        self.engine = engine
        self.info = info
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeats = 0  # sent so far
        self.rejected = 0
        self._context = zmq.Context()
        self._inbox = make_socket(self._context, zmq.PULL)
        self._outbox = make_socket(self._context, zmq.PUSH)
        self._inbox.connect(endpoints.requests)
        self._outbox.connect(endpoints.outputs)
        self._send_lock = threading.Lock()
        self._streams: dict[int, RequestStream] = {}  # by the frontend's request id
        self._streams_lock = threading.Lock()
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        """Announce readiness (an unsolicited Status), start the heartbeat thread and
        answer until :meth:`stop`."""
        self._send(self._status(0))
        self._beater = threading.Thread(target=self._beat, name="flare-api-heartbeat", daemon=True)
        self._beater.start()
        while not self._stop.is_set():
            if self.engine.error is not None:
                # Every open request got its error output from the engine's shutdown;
                # exiting lets the frontend (and whatever supervises it) see the failure.
                log.error("the engine failed (%s): the coordinator stops", self.engine.error)
                self._stop.wait(ERROR_GRACE_S)  # let the engine's error outputs leave
                break
            if not self._inbox.poll(POLL_MS):
                continue
            message = decode_or_log(self._inbox.recv(), "the frontend")
            if message is None:
                self.rejected += 1
                continue
            try:
                self._handle(message)
            except EngineError as exc:
                log.error("frontend bridge: the engine refused %s: %s", type(message).__name__, exc)

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        """Send a Heartbeat every interval until :meth:`stop` (its own thread)."""
        while not self._stop.wait(self.heartbeat_interval_s):
            self.heartbeats += 1
            try:
                self._send(Heartbeat(self.heartbeats, self.engine.serving), block=False)
            except zmq.ZMQError as exc:  # a full queue (the frontend is not reading): skip
                log.debug("heartbeat %d not sent: %s", self.heartbeats, exc)

    def close(self) -> None:
        self._stop.set()
        if self._beater is not None:
            self._beater.join()
        self._inbox.close(linger=0)
        with self._send_lock:
            self._outbox.close(linger=1000)
        self._context.term()

    # ------------------------------------------------------------------ messages
    def _handle(self, message: object) -> None:
        if isinstance(message, Submit):
            self._submit(message)
        elif isinstance(message, Cancel):
            stream = self._stream(message.request_id)
            if stream is not None:
                self.engine.cancel(stream)
        elif isinstance(message, Publish):
            stream = self._stream(message.request_id)
            if stream is not None:
                self.engine.publish(stream, message.fence, message.at_ns)
        elif isinstance(message, StatusQuery):
            self._send(self._status(message.nonce))
        else:
            self.rejected += 1
            log.warning("frontend bridge: unexpected %s", type(message).__name__)

    def _submit(self, message: Submit) -> None:
        rid = message.request_id
        with self._streams_lock:
            duplicate = rid in self._streams
        if duplicate:
            self._send(Output(rid, 0, finish_reason=REFUSED, error=f"request id {rid} is in use"))
            return

        def listener(stream: RequestStream, event: TokenEvent) -> None:
            error = None
            if event.finish_reason == ERROR:
                error = str(stream.error or "the engine failed")[:MAX_ERROR_CHARS]
            self._send(
                Output(
                    rid,
                    event.fence,
                    event.token_ids,
                    event.finish_reason,
                    error,
                    event.logprobs,
                    stream.cached_tokens,
                )
            )
            if event.finished:
                with self._streams_lock:
                    if self._streams.get(rid) is stream:
                        del self._streams[rid]

        try:
            stream = self.engine.submit(
                message.prompt_token_ids,
                message.max_tokens,
                message.sampling,
                message.ignore_eos,
                listener=listener,
                group=message.group,
                cache_salt=message.cache_salt,
                message_endpoints=message.message_endpoints,
            )
        except ValueError as exc:  # the request does not fit (the frontend checked the rest)
            self._send(Output(rid, 0, finish_reason=REFUSED, error=str(exc)[:MAX_ERROR_CHARS]))
            return
        except EngineError:  # stopping or failed: the frontend answers 503
            self._send(Output(rid, 0, finish_reason=ABORTED))
            return
        with self._streams_lock:
            if not stream.finished:
                self._streams[rid] = stream

    def _stream(self, request_id: int) -> RequestStream | None:
        with self._streams_lock:
            return self._streams.get(request_id)

    def _status(self, nonce: int) -> Status:
        engine = self.engine
        info = self.info
        return Status(
            nonce,
            engine.serving,
            info.model_name,
            info.vocab_size,
            info.max_context,
            info.tensor_parallel_size,
            info.max_concurrency,
            info.kv_tokens,
            {key: float(value) for key, value in engine.metrics().items()},
            engine.graph_estimates(),
            None if engine.error is None else str(engine.error)[:MAX_ERROR_CHARS],
        )

    def _send(self, message: Output | Status | Heartbeat, block: bool = True) -> None:
        data = encode(message)
        with self._send_lock:
            if not self._outbox.closed:
                self._outbox.send(data, 0 if block else zmq.NOBLOCK)
