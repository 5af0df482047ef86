"""Admission: what lets a new generation request in (:class:`Gate`), and the choices
an admitted one holds until its response ends (:class:`Ticket`)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from fastapi.responses import Response

from runtime.frontend.client import CoordinatorClient
from runtime.frontend.server.errors import error_response

log = logging.getLogger("runtime.frontend")

CONFIRM_S = 0.05  # Gate.watch: a second look before calling the coordinator stuck


class Ticket:
    """``choices`` admitted by a :class:`Gate`; :meth:`release` (idempotent) when the
    response has ended."""

    def __init__(self, gate: Gate | None, choices: int) -> None:
        self.gate, self.choices = gate, choices
        if gate is not None:
            gate.open += choices

    def release(self) -> None:
        if self.gate is not None:
            self.gate.open -= self.choices
            self.gate = None


@dataclass
class Gate:
    """What lets a new generation request in, and what /health says.

    ``client.last_heard`` is when the coordinator last said anything (a
    heartbeat every ``--heartbeat-interval`` at least); silent for more than
    ``heartbeat_timeout_s`` (as :meth:`watch` checks, a few times a second), it
    is stuck: new requests get 503 at once, open
    ones are ended with an error by :meth:`watch`, /health is 503 naming the
    silence.  Heard again, new requests are served again (the ended ones stay
    ended).  Open choices (admitted, response not ended) beyond ``resident``
    (the coordinator's max concurrency) plus ``max_waiting``
    (``--max-waiting-requests``; None: no limit) get 429; a request is
    admitted whatever its choices when nothing is open.
    ``drain_until``: the monotonic deadline of a drain in progress
    (``--drain-timeout``); ``stopping``: the server is stopping.

    A coordinator that cannot serve any more (``client.failure``: its engine
    failed or is failing, or its process exited) makes new requests and /health
    503 with that reason at once, ahead of any silence that follows; so does a
    heartbeat saying the engine does not serve.  Heard again after a silence,
    the coordinator counts as serving only once a heartbeat (or status) sent
    since says so: an output it had queued says nothing of its ranks.
    """

    client: CoordinatorClient
    heartbeat_timeout_s: float = 10.0
    resident: int = 1
    max_waiting: int | None = None
    open: int = 0
    drain_until: float | None = None
    stopping: bool = False
    stuck_since: float | None = None  # when watch() found the coordinator silent

    def silence_s(self) -> float:
        return time.monotonic() - self.client.last_heard

    def stuck(self) -> str | None:
        """Why the coordinator counts as stuck (None: it answers)."""
        silent = self.silence_s()
        if silent <= self.heartbeat_timeout_s:
            return None
        return (
            f"the coordinator stopped answering: nothing heard from it for {silent:.1f} s "
            f"(--heartbeat-timeout {self.heartbeat_timeout_s:g} s)"
        )

    def unavailable(self) -> tuple[str, int] | None:
        """Why new requests get 503 now, and the Retry-After seconds (None: they don't)."""
        if self.stopping:
            return "the server is shutting down", 1
        if self.drain_until is not None:
            left = max(0.0, self.drain_until - time.monotonic())
            return (
                f"the server is draining before it shuts down ({left:.1f} s left): "
                "it takes no new requests",
                max(1, math.ceil(left)),
            )
        failure = getattr(self.client, "failure", None)
        if failure is not None:
            return failure, 1
        reason = self.stuck() if self.stuck_since is not None else None  # as watch() found
        if reason is None and self.stuck_since is not None and not self._fresh():
            reason = "the coordinator answers again after a silence: waiting for its heartbeat"
        if reason is None and not getattr(self.client, "serving", True):
            reason = "the engine is not serving"
        return None if reason is None else (reason, 1)

    def _fresh(self) -> bool:
        """Whether the coordinator's serving flag arrived after the silence watch() found."""
        since = self.stuck_since
        return since is None or getattr(self.client, "serving_at", math.inf) > since

    def overloaded(self, choices: int) -> str | None:
        """Why ``choices`` more would overload the server (None: they fit)."""
        if self.max_waiting is None or self.open == 0:
            return None
        limit = self.resident + self.max_waiting
        if self.open + choices <= limit:
            return None
        return (
            f"the server is at its queue limit: {self.open} open requests (choices) and "
            f"{choices} more exceed {limit}, the {self.resident} the coordinator runs at "
            f"once plus --max-waiting-requests {self.max_waiting}; retry later"
        )

    def refusal(self, choices: int) -> Response | None:
        """The 503 or 429 answer for a request of ``choices`` (None: admitted)."""
        down = self.unavailable()
        if down is not None:
            reason, retry = down
            return error_response(503, reason, None, "service_unavailable", retry_after=retry)
        reason = self.overloaded(choices)
        if reason is not None:
            return error_response(
                429, reason, None, "rate_limit_error", code="rate_limit_exceeded", retry_after=1
            )
        return None

    async def watch(self) -> None:
        """Fail open requests while the coordinator is stuck; log its silence and return."""
        tick = min(0.25, self.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            if getattr(self.client, "failure", None) is not None:
                continue  # it said it failed and goes silent as it exits: serve.py's watch
            reason = self.stuck()
            if reason is not None and self.stuck_since is None:
                # Messages this process has not read yet (its own loop stalled) go first.
                await asyncio.sleep(CONFIRM_S)
                reason = self.stuck()
            if reason is not None:
                if self.stuck_since is None:
                    self.stuck_since = self.client.last_heard
                    log.error("%s: open requests fail, new ones get 503", reason)
                ended = self.client.fail_all(reason)
                if ended:
                    log.error("ended %d open requests: the coordinator is silent", ended)
            elif self.stuck_since is not None and self._fresh():
                silent = self.client.last_heard - self.stuck_since
                log.warning(
                    "the coordinator answers again after %.1f s of silence: %s (the "
                    "requests ended meanwhile stay ended)",
                    silent,
                    "new requests are served" if self.unavailable() is None else "not serving",
                )
                self.stuck_since = None
