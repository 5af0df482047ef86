"""The frontend's side of the coordinator link (see ``runtime.coordinator.bridge``).

The frontend binds both sockets, ``ipc://`` in a private run directory (mode
0700, removed on close; a ``pid`` file in it lets a later start remove the
directory of a frontend that was killed), and the coordinator process connects
to them:
requests leave on a PUSH socket, and outputs and status replies arrive on a
PULL socket read by one asyncio task, which routes each :class:`Output` to its
request's queue.  Everything runs on the event loop's thread.

Nothing the frontend sends is dropped or refused.  The PUSH socket's queue and
the coordinator's PULL queue hold 1,000 messages each (the transport's bound,
runtime.transport.channels), so a coordinator that pauses for a second or two
under a burst fills them; a message the socket cannot take yet waits in an
ordered local outbox, which a writer task sends, in order, as soon as the socket
takes messages again.  So all of a request's Submits are queued or, when the
coordinator is not connected, none is (the admission decision comes first), and
a Cancel or a Publish is never lost.  The outbox holds at most what the frontend
admitted meanwhile: its Gate (``--max-waiting-requests``) bounds the open
requests, and a coordinator silent past ``--heartbeat-timeout`` gets no new ones.

Every message from the coordinator (a :class:`Heartbeat` at least every
``--heartbeat-interval`` seconds) sets :attr:`CoordinatorClient.last_heard`;
the frontend's :class:`runtime.frontend.server.admission.Gate` judges from it whether the
coordinator still answers.  :attr:`CoordinatorClient.serving` is the latest
heartbeat's or status's word; a status carrying an error (the engine failed, or
is failing) sets :attr:`CoordinatorClient.failure` for good.  The frontend can
end open requests itself: a :class:`LocalEnd` in a request's queue (the server
stops: "abort"; the coordinator stopped answering: 503; the coordinator is
gone, :meth:`CoordinatorClient.lose`: the work is lost, an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.asyncio

from runtime.transport.api import (
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
from runtime.transport.images import SubmitImage
from runtime.transport.links import ApiEndpoints
from runtime.transport.run_dirs import make_run_dir
from runtime.transport.sampling import SamplingParams

log = logging.getLogger("runtime.frontend")

API_RUN_PREFIX = "flare-api-"
API_RUN_FILES = ("requests", "outputs", "debug")  # debug: --debug-endpoints only
FLUSH_POLL_MS = 100  # the outbox writer looks at a full socket again at least this often


class CoordinatorGone(RuntimeError):
    """The coordinator did not answer (not started yet, exited, or stopped answering)."""


class CoordinatorLost(RuntimeError):
    """The coordinator or its engine failed with a request open: its work is lost (a
    500 or an SSE error event, never a normal finish)."""


@dataclass(frozen=True)
class LocalEnd:
    """The frontend itself ended an open request (nothing more comes for it).

    ``error`` None: the server stops, the request ends with finish_reason
    "abort" whether it was running or still waiting for a slot; else
    ``error`` says why: with ``failed`` the coordinator is gone (it exited,
    its engine failed) and the work is lost (:class:`CoordinatorLost`), else it
    stopped answering (:class:`CoordinatorGone`, a 503).
    """

    error: str | None = None
    failed: bool = False


class CoordinatorClient:
    def __init__(self, run_dir: str | None = None) -> None:
        self.run_dir = make_run_dir(API_RUN_PREFIX, API_RUN_FILES, run_dir)
        self._sync = zmq.Context()
        self._async = zmq.asyncio.Context()
        self._push = make_socket(self._sync, zmq.PUSH)
        self._pull = make_socket(self._async, zmq.PULL)
        requests, outputs = (os.path.join(self.run_dir, name) for name in API_RUN_FILES[:2])
        self._push.bind(f"ipc://{requests}")
        self._pull.bind(f"ipc://{outputs}")
        self.endpoints = ApiEndpoints(
            self._push.getsockopt_string(zmq.LAST_ENDPOINT),
            self._pull.getsockopt_string(zmq.LAST_ENDPOINT),
        )
        self._queues: dict[int, asyncio.Queue[Output | LocalEnd]] = {}
        self._status_waiters: dict[int, asyncio.Future[Status]] = {}
        self._nonces = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._group_ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._connected = False
        self.status: Status | None = None  # the latest status seen
        self.heartbeat: Heartbeat | None = None  # the latest heartbeat seen
        self.last_heard = time.monotonic()  # when the last valid message arrived
        self.serving = True  # the latest heartbeat's or status's word
        self.serving_at = self.last_heard  # when that word arrived
        self.failure: str | None = None  # why the coordinator can serve no more (for good)
        self.rejected = 0
        self._outbox: deque[bytes] = deque()  # what the PUSH socket could not take yet
        self._writer: asyncio.Task | None = None  # sends the outbox as the socket frees
        self._lost = False  # lose(): nothing more is sent

    # ------------------------------------------------------------------ life cycle
    async def wait_ready(self, timeout_s: float) -> Status:
        """Wait for the coordinator's first Status (sent once its engine serves)."""
        while self.status is None:
            try:
                data = await asyncio.wait_for(self._pull.recv(), timeout_s)
            except asyncio.TimeoutError:
                raise CoordinatorGone(f"no word from the coordinator in {timeout_s:g} s") from None
            self._route(data)
        self._connected = True
        self._reader = asyncio.create_task(self._read(), name="flare-coordinator-reader")
        return self.status

    async def _read(self) -> None:
        while True:
            data = await self._pull.recv()
            self._route(data)

    def _route(self, data: bytes) -> None:
        message = decode_or_log(data, "the coordinator")
        if message is None:
            self.rejected += 1
            return
        self.last_heard = time.monotonic()
        if isinstance(message, (Heartbeat, Status)):
            self.serving, self.serving_at = message.serving, self.last_heard
        if isinstance(message, Heartbeat):
            self.heartbeat = message
        elif isinstance(message, Output):
            queue = self._queues.get(message.request_id)
            if queue is None:
                return  # a request the frontend already gave up on
            queue.put_nowait(message)
            if message.finished:
                del self._queues[message.request_id]
        elif isinstance(message, Status):
            self.status = message
            if not message.serving and message.error is not None:
                if self.failure != message.error:
                    log.error("the coordinator cannot serve: %s", message.error)
                self.failure = message.error  # the engine failed (or is failing)
            waiter = self._status_waiters.pop(message.nonce, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        else:
            self.rejected += 1
            log.warning("unexpected %s from the coordinator", type(message).__name__)

    @property
    def open_requests(self) -> int:
        """Requests sent whose last output has not arrived (nor was given up)."""
        return len(self._queues)

    def abort_all(self) -> None:
        """End every open request as aborted (running or waiting alike) and refuse
        new ones (the coordinator exited, or the server is stopping)."""
        self._connected = False
        for queue in self._queues.values():
            queue.put_nowait(LocalEnd())
        self._queues.clear()

    def fail_all(self, reason: str) -> int:
        """End every open request with the error ``reason`` and cancel it at the
        coordinator (delivered if it ever reads again); new requests stay
        possible.  The number of requests ended."""
        ended = list(self._queues.items())
        self._queues.clear()
        for request_id, queue in ended:
            queue.put_nowait(LocalEnd(reason))
            with contextlib.suppress(CoordinatorGone):
                self._send(Cancel(request_id))
        return len(ended)

    def lose(self, reason: str) -> int:
        """The coordinator is gone for good (its process exited): every open request
        ends with the error ``reason`` (its work is lost: not an operator's stop),
        new ones are refused, nothing more is sent.  The number of requests ended."""
        self._connected, self._lost = False, True
        self.failure = reason
        self._outbox.clear()
        ended = list(self._queues.values())
        self._queues.clear()
        for queue in ended:
            queue.put_nowait(LocalEnd(reason, failed=True))
        return len(ended)

    async def close(self) -> None:
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.abort_all()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._sync.term()
        self._async.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> int:
        return next(self._request_ids)

    def new_group_id(self) -> int:
        """An admission group for the choices of one HTTP request."""
        return next(self._group_ids)

    def submit(
        self,
        request_id: int,
        prompt_token_ids: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingParams,
        ignore_eos: bool = False,
        group: int | None = None,
        *,
        cache_salt: str = "",
        message_endpoints: tuple[int, ...] = (),
        prompt_logprobs: int = -1,
        images: tuple[SubmitImage, ...] = (),
    ) -> asyncio.Queue[Output | LocalEnd]:
        """Send a request; its outputs arrive on the returned queue, the last one
        finished (or a :class:`LocalEnd`).
        ``group``: the admission group (:meth:`new_group_id`), shared by one HTTP
        request's choices.  ``cache_salt``: prefix-cache pages are shared only with
        requests of an equal salt ("" none); ``message_endpoints``: each chat
        message's end offset in the prompt (:class:`Submit`); ``prompt_logprobs``:
        -1, or score the prompt with that many alternatives (:class:`Submit`);
        ``images``: the prompt's images, each its span and pixels (:class:`Submit`)."""
        if self.failure is not None:
            raise CoordinatorGone(self.failure)
        if not self._connected:
            raise CoordinatorGone("the coordinator is not connected")
        message = Submit(
            request_id,
            prompt_token_ids,
            max_tokens,
            sampling,
            ignore_eos,
            group,
            cache_salt=cache_salt,
            message_endpoints=message_endpoints,
            prompt_logprobs=prompt_logprobs,
            images=images,
        )
        self._send(message)  # at once, or from the outbox: never dropped nor refused
        queue: asyncio.Queue[Output | LocalEnd] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def cancel(self, request_id: int) -> None:
        """Stop a request; its queue is dropped (nothing more is delivered)."""
        self._queues.pop(request_id, None)
        self._send(Cancel(request_id))

    def publish(self, request_id: int, fence: int, at_ns: int) -> None:
        self._send(Publish(request_id, fence, at_ns))

    async def query_status(self, timeout_s: float = 2.0) -> Status:
        if not self._connected:
            raise CoordinatorGone("the coordinator is not connected")
        nonce = next(self._nonces)
        waiter: asyncio.Future[Status] = asyncio.get_running_loop().create_future()
        self._status_waiters[nonce] = waiter
        self._send(StatusQuery(nonce))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            raise CoordinatorGone(f"no status from the coordinator in {timeout_s:g} s") from None
        finally:
            self._status_waiters.pop(nonce, None)

    def _send(self, message: Submit | Cancel | Publish | StatusQuery) -> None:
        """Send ``message`` now or, if the socket's queue is full (or the coordinator
        not connected yet), as soon as it takes messages, after those already waiting:
        never dropped, never refused (CoordinatorGone only for a closed socket)."""
        if self._lost:
            raise CoordinatorGone(f"the coordinator is gone: {self.failure}")
        data = encode(message)
        if not self._outbox:
            try:
                self._push.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:  # the queues are full: the outbox keeps it
                pass
            except zmq.ZMQError:  # the socket is closed
                raise CoordinatorGone("the coordinator is not connected") from None
        self._outbox.append(data)
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(
                self._flush(), name="flare-coordinator-writer"
            )

    @property
    def queued(self) -> int:
        """Messages waiting in the outbox for the socket to take them."""
        return len(self._outbox)

    async def _flush(self) -> None:
        """Send the outbox, in order, as the socket takes messages again."""
        poller = zmq.asyncio.Poller()
        poller.register(self._push, zmq.POLLOUT)
        try:
            while self._outbox:
                try:
                    self._push.send(self._outbox[0], zmq.NOBLOCK)
                except zmq.Again:
                    await poller.poll(FLUSH_POLL_MS)
                    continue
                self._outbox.popleft()
        except zmq.ZMQError as exc:  # the socket closed under it: nothing will leave
            log.debug("outbox: %d messages not sent: %s", len(self._outbox), exc)
            self._outbox.clear()
        finally:
            self._writer = None
