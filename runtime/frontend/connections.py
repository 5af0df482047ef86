"""HTTP connections under hostile clients: a request-head timeout and a connection
limit, as a uvicorn protocol class (``uvicorn.Config(http=guard.protocol_class())``).

uvicorn has neither: a client that opens a connection and sends ``GET /hea``
holds a file descriptor forever, and 20,000 of them exhaust the process's
descriptors (then asyncio's accept loop logs each failed accept).
:class:`ConnectionGuard` keeps every connection that waits for a request head
(a new one, or a keep-alive one between requests) in arrival order:

- ``--header-timeout S``: a connection whose request head is not complete S
  seconds after it became ready for one (opened, or its previous response
  ended) is closed: with a 408 when part of a head arrived or nothing was ever
  answered on it, silently when it is an idle keep-alive connection (uvicorn's
  own keep-alive timeout usually closes those first).  One sweep a few times a
  second closes the overdue ones, a few hundred per event-loop turn.
- ``--max-connections N``: a connection beyond N makes room by closing the one
  that has waited longest for a request head (503 with Retry-After, or
  silently for an idle keep-alive one); when every connection has a request in
  progress, the new one gets the 503 and is closed.  Either way the process
  never holds more than N client connections (plus those it is closing), so a
  flood cannot run it out of descriptors, and a client that sends its request
  at once (a health check) gets served even while idle connections flood in.

:func:`raise_fd_limit` lifts the descriptor limit's soft value to the hard one.
asyncio accepts as many connections in one event-loop turn as the backlog it
was given, and sets each up (uvicorn's protocol, about 0.2 ms) in the next:
uvicorn's default of 2048 stalls the loop for a quarter second or more under a
flood.  So the server is started with ``ACCEPT_BATCH`` (128) as its backlog,
and :func:`widen_listen_backlog` then lets the kernel queue up to
``LISTEN_BACKLOG`` (4096, or the system's somaxconn) waiting connections on the
same socket: a flood is accepted 128 at a time, between other work, and a burst
still finds room.
:func:`default_max_connections` leaves two batches plus ``FD_RESERVE``
descriptors for accepting and for the rest of the process (its coordinator
link, workers, logs).  Should descriptors run out anyway,
:func:`quiet_accept_errors` makes asyncio's report of each failed accept one
line (and the rate limit of runtime.logs bounds their number).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import socket
import time
from collections import OrderedDict

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("runtime.frontend")

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "FD_RESERVE",
    "MAX_DEFAULT_CONNECTIONS",
    "ConnectionGuard",
    "default_max_connections",
    "fd_headroom",
    "quiet_accept_errors",
    "raise_fd_limit",
    "widen_listen_backlog",
]

DEFAULT_HEADER_TIMEOUT_S = 10.0
FD_RESERVE = 256  # descriptors kept for everything but client connections and accepts
ACCEPT_BATCH = 128  # connections asyncio accepts per event-loop turn (its "backlog")
LISTEN_BACKLOG = 4096  # connections the kernel queues for accept (capped by somaxconn)
MAX_DEFAULT_CONNECTIONS = 10000  # the default limit's ceiling, whatever the fd limit
MIN_DEFAULT_CONNECTIONS = 64
SWEEP_BATCH = 64  # overdue connections closed per event-loop turn


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or (soft != resource.RLIM_INFINITY and soft >= target):
        return soft
    for value in (target, 1 << 20, 1 << 16):
        if value <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (value, hard))
            return value
        except (ValueError, OSError):
            continue
    return soft


def _fd_limit(fd_limit: int | None) -> int:
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if fd_limit == resource.RLIM_INFINITY else fd_limit


def fd_headroom() -> int:
    """Descriptors the process needs beside its held client connections."""
    return 2 * ACCEPT_BATCH + FD_RESERVE


async def widen_listen_backlog(server, backlog: int = LISTEN_BACKLOG) -> None:
    """Once ``server`` (a uvicorn.Server started with ACCEPT_BATCH as its backlog)
    listens, let the kernel queue ``backlog`` connections on its sockets."""
    while not server.started:
        await asyncio.sleep(0.02)
    for listener in server.servers:
        for transport_socket in listener.sockets:
            # listen() again on the same socket (a duplicate descriptor of it).
            with (
                contextlib.suppress(OSError),
                socket.socket(fileno=os.dup(transport_socket.fileno())) as sock,
            ):
                sock.listen(backlog)


def default_max_connections(fd_limit: int | None = None) -> int:
    """``--max-connections``' default: the descriptor limit less :func:`fd_headroom`,
    at most MAX_DEFAULT_CONNECTIONS and at least MIN_DEFAULT_CONNECTIONS."""
    room = _fd_limit(fd_limit) - fd_headroom()
    return max(MIN_DEFAULT_CONNECTIONS, min(MAX_DEFAULT_CONNECTIONS, room))


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio's report of a failed accept (out of descriptors) as one line, not a
    traceback; every other report as before."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if context.get("message", "").startswith("socket.accept()") and isinstance(exc, OSError):
            log.error("%s: %s", context["message"], exc)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _response(status: int, reason: str, message: str, kind: str, retry_after: bool) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": None}},
        separators=(",", ":"),
    ).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after:
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ConnectionGuard:
    """The header timeout and the connection limit of one server (see the module
    docstring); counts what it did (``timed_out``, ``evicted``, ``refused``)."""

    def __init__(
        self, max_connections: int, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not 0 < header_timeout_s < float("inf"):
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.live: set[H11Protocol] = set()  # open, not being closed by the guard
        # Connections waiting for a request head -> their deadline, oldest first.
        self.waiting: OrderedDict[H11Protocol, float] = OrderedDict()
        self.timed_out = 0
        self.evicted = 0
        self.refused = 0
        self._sweeper: asyncio.Task | None = None
        self.limit_response = _response(
            503,
            "Service Unavailable",
            f"the server is at its connection limit (--max-connections {max_connections}); "
            "retry later",
            "service_unavailable",
            retry_after=True,
        )
        self.timeout_response = _response(
            408,
            "Request Timeout",
            f"the request head did not arrive within {header_timeout_s:g} s (--header-timeout)",
            "invalid_request_error",
            retry_after=False,
        )

    def protocol_class(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol, under this guard."""
        return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"guard": self})

    # -------------------------------------------------------------- bookkeeping

    def wait_for_head(self, conn: _GuardedH11Protocol) -> None:
        self.waiting[conn] = time.monotonic() + self.header_timeout_s
        self.waiting.move_to_end(conn)

    def forget(self, conn: _GuardedH11Protocol) -> None:
        self.live.discard(conn)
        self.waiting.pop(conn, None)

    def admit(self, conn: _GuardedH11Protocol) -> bool:
        """Count a new connection in; False when it must be refused (over the limit
        with nothing to evict)."""
        self._ensure_sweeper()
        self.live.add(conn)
        while len(self.live) > self.max_connections:
            if not self.waiting:
                self.refused += 1
                log.warning(
                    "refused a connection (503): %d are open, each with a request in "
                    "progress (--max-connections %d)",
                    len(self.live) - 1,
                    self.max_connections,
                )
                return False
            victim, _ = self.waiting.popitem(last=False)
            self.evicted += 1
            log.warning(
                "the connection limit is reached (--max-connections %d): closed the "
                "connection that waited longest for a request head",
                self.max_connections,
            )
            victim.close_waiting(self.limit_response)
        return True

    # -------------------------------------------------------------- the sweep

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep(), name="flare-header-timeout"
            )

    async def _sweep(self) -> None:
        tick = min(0.25, self.header_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            closed = 0
            while self.waiting:
                conn, deadline = next(iter(self.waiting.items()))
                if deadline > time.monotonic():
                    break
                del self.waiting[conn]
                self.timed_out += 1
                conn.close_waiting(self.timeout_response)
                closed += 1
                if closed % SWEEP_BATCH == 0:
                    await asyncio.sleep(0)  # let requests and streams run between batches
            if closed:
                log.info(
                    "closed %d connections whose request head did not arrive within %g s "
                    "(--header-timeout)",
                    closed,
                    self.header_timeout_s,
                )


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guard's bookkeeping (subclassed per guard)."""

    guard: ConnectionGuard
    answered = False  # a response went out on this connection
    head_bytes = False  # bytes of the next request head arrived

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            self.guard.forget(self)
            self._close_with(self.guard.limit_response)
            return
        self.guard.wait_for_head(self)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        guard = self.guard
        if self not in guard.live:
            return
        if self.conn.their_state is h11.IDLE:
            self.head_bytes = True  # (still waiting: the deadline stands)
        else:
            guard.waiting.pop(self, None)  # a request head arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.answered = True
        self.head_bytes = False
        if (
            self in self.guard.live
            and not self.transport.is_closing()
            and self.conn.their_state is h11.IDLE
            and self.conn.our_state is h11.IDLE
        ):
            self.guard.wait_for_head(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        super().connection_lost(exc)

    def close_waiting(self, response: bytes) -> None:
        """Close this connection, which waits for a request head: ``response``
        first unless it is an idle keep-alive one (nothing of a next request yet)."""
        self.guard.live.discard(self)
        if self.answered and not self.head_bytes:
            self._close_with(b"")
        else:
            self._close_with(response)

    def _close_with(self, response: bytes) -> None:
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        with contextlib.suppress(Exception):
            if response:
                self.transport.write(response)
        self.transport.close()
