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

A failure is said at once, not left to a silence: the heartbeat's ``serving``
is the engine's real state (``health``: the engine failed or is failing, a rank
process exited; and no rank silent past the heartbeat timeout, as right after
this process was itself paused, :meth:`Engine.unheard`), and the moment
``health`` names a problem, which is for good, the bridge sends a
``Heartbeat(serving=False)`` and an unsolicited :class:`Status` whose ``error``
says why (the frontend's /health turns 503 and it takes no new requests).
Once the engine has failed (every request it held got its error output) the
bridge answers what is still queued for a moment (Submits are refused) and
stops; the coordinator process then exits non-zero.

The frontend queues what this side's PULL socket cannot take yet (its
high-water mark of 1,000 messages is back-pressure, not a loss: the frontend's
outbox, runtime.frontend.client), so a pause here delays requests, never drops
one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from runtime.coordinator.engine.config import EngineError
from runtime.coordinator.engine.core import Engine
from runtime.coordinator.engine.stream import ABORTED, ERROR, RequestStream, TokenEvent
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
from runtime.transport.links import ApiEndpoints

log = logging.getLogger("runtime.coordinator.bridge")

POLL_MS = 100  # the loop looks at the engine's health at least this often
ERROR_GRACE_S = 0.5  # after a failure: the error outputs leave, queued messages are answered
REFUSED = "refused"


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
        health: Callable[[], str | None] | None = None,
    ) -> None:
        """``health``: why the deployment can serve no more (None: it can), e.g.
        :meth:`runtime.deploy.local.LocalDeployment.health`; by default the engine's."""
        if not 0 < heartbeat_interval_s < float("inf"):
            raise ValueError(
                f"heartbeat_interval_s must be a finite number of seconds > 0, "
                f"got {heartbeat_interval_s!r}"
            )
        self.engine = engine
        self.info = info
        self.heartbeat_interval_s = heartbeat_interval_s
        self.health = engine.health if health is None else health
        self.heartbeats = 0  # sent so far
        self.rejected = 0
        self.announced: str | None = None  # the problem last told to the frontend
        self._context = zmq.Context()
        self._inbox = make_socket(self._context, zmq.PULL)
        self._outbox = make_socket(self._context, zmq.PUSH)
        self._inbox.connect(endpoints.requests)
        self._outbox.connect(endpoints.outputs)
        self._send_lock = threading.Lock()
        self._beat_lock = threading.Lock()  # the heartbeat count
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
            problem = self.health()
            if problem is not None and problem != self.announced:
                self._announce(problem)
            if self.engine.error is not None:
                # Every open request got its error output from the engine's shutdown;
                # exiting lets the frontend (and whatever supervises it) see the failure.
                log.error("the engine failed (%s): the coordinator stops", self.engine.error)
                self._answer_queued(ERROR_GRACE_S)  # the error outputs leave meanwhile
                break
            if self._inbox.poll(POLL_MS):
                self._take()

    def _take(self) -> None:
        message = decode_or_log(self._inbox.recv(), "the frontend")
        if message is None:
            self.rejected += 1
            return
        try:
            self._handle(message)
        except EngineError as exc:
            log.error("frontend bridge: the engine refused %s: %s", type(message).__name__, exc)

    def _answer_queued(self, seconds: float) -> None:
        """Answer what the frontend sent before it heard of the failure, for up to
        ``seconds`` (a Submit is refused: it never ran)."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._inbox.poll(max(1, int(left * 1000))):
                self._take()

    def _announce(self, problem: str) -> None:
        """Tell the frontend at once that the deployment cannot serve, and why."""
        self.announced = problem
        log.error("not serving: %s", problem)
        try:
            self._heartbeat(block=False)
            self._send(self._status(0), within_s=ERROR_GRACE_S)
        except zmq.ZMQError as exc:  # the frontend is not reading: its watch still sees the exit
            log.warning("could not tell the frontend (%s): %s", problem, exc)

    def stop(self) -> None:
        self._stop.set()

    def serving(self) -> bool:
        """The engine accepts requests, nothing says the deployment cannot serve and
        every rank was heard within the heartbeat timeout."""
        engine = self.engine
        return engine.serving and self.health() is None and engine.unheard() is None

    def _beat(self) -> None:
        """Send a Heartbeat every interval until :meth:`stop` (its own thread)."""
        while not self._stop.wait(self.heartbeat_interval_s):
            try:
                self._heartbeat(block=False)
            except zmq.ZMQError as exc:  # a full queue (the frontend is not reading): skip
                log.debug("heartbeat %d not sent: %s", self.heartbeats, exc)

    def _heartbeat(self, block: bool) -> None:
        with self._beat_lock:
            self.heartbeats += 1
            seq = self.heartbeats
        self._send(Heartbeat(seq, self.serving()), block=block)

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
                    event.prompt_logprobs,
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
                prompt_logprobs=message.prompt_logprobs,
                images=message.images,
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
        problem = self.health()
        return Status(
            nonce,
            problem is None and self.serving(),
            info.model_name,
            info.vocab_size,
            info.max_context,
            info.tensor_parallel_size,
            info.max_concurrency,
            info.kv_tokens,
            {key: float(value) for key, value in engine.metrics().items()},
            engine.graph_estimates(),
            None if problem is None else problem[:MAX_ERROR_CHARS],
        )

    def _send(
        self,
        message: Output | Status | Heartbeat,
        block: bool = True,
        within_s: float | None = None,
    ) -> None:
        """Send ``message``: waiting for room in the queue (``block``), or not at all
        (zmq.Again), or for at most ``within_s`` seconds (then zmq.Again)."""
        data = encode(message)
        with self._send_lock:
            if self._outbox.closed:
                return
            if within_s is None:
                self._outbox.send(data, 0 if block else zmq.NOBLOCK)
                return
            deadline = time.monotonic() + within_s
            while True:
                try:
                    self._outbox.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise
                    self._outbox.poll(max(1, int(min(left, 0.05) * 1000)), zmq.POLLOUT)
