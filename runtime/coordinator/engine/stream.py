"""The per-request token stream handed to callers of ``Engine.submit``."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.transport.sampling import SamplingParams

if TYPE_CHECKING:
    from runtime.coordinator.engine.submission import RequestImages

log = logging.getLogger("runtime.coordinator.engine")

# Finish reasons beyond the scheduler's "stop" and "length".
CANCELLED = "cancelled"  # Engine.cancel (or RequestStream.cancel)
ABORTED = "aborted"  # the engine stopped first
ERROR = "error"  # the engine failed; RequestStream.error holds why


@dataclass(frozen=True)
class TokenEvent:
    """Tokens one completed frame committed for a request, in order.

    ``finished`` marks the stream's last event; ``finish_reason`` is then one of
    "stop" (an eos token), "length" (max_tokens), "cancelled", "aborted" or
    "error" (the last three may carry no tokens).  ``at_ns``: monotonic clock
    when the engine published the event.
    """

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    at_ns: int = 0
    fence: int = 0  # the frame that committed the tokens (0: none, e.g. a cancellation)
    logprobs: tuple = ()  # TokenLogprobs per token, when the request asked for them
    # The prompt's TokenLogprobs (every prompt token after the first), on the first
    # event of a request that asked (RequestStream.prompt_logprobs >= 0).
    prompt_logprobs: tuple = ()


@dataclass(frozen=True)
class StreamResult:
    token_ids: list[int]
    finish_reason: str | None


class RequestStream:
    """Token events of one request; safe to read from any thread.

    Iterate it (``for event in stream``) until the finished event, or call
    :meth:`get` (``TimeoutError`` when nothing arrives in time, ``EOFError``
    after the finished event was taken), or wait for everything with
    :meth:`result`.  The engine thread is the only producer.
    """

    def __init__(
        self,
        cancel: Callable[[RequestStream], None],
        request_id: int,
        prompt_token_ids: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingParams,
        ignore_eos: bool,
        listener: Callable[[RequestStream, TokenEvent], None] | None = None,
        group: int | None = None,
    ) -> None:
        self._cancel = cancel  # the engine's cancel (Engine.cancel)
        # Called with every event right after it is queued, on the producing
        # thread (the engine thread, or the thread that stops the engine): it
        # must be quick and must not call back into the engine.
        self.listener = listener
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.ignore_eos = ignore_eos
        self.group = group  # the admission group (RequestSpec.group)
        self.cache_salt = ""  # prefix-cache tenant (RequestSpec.cache_salt)
        self.message_endpoints: tuple[int, ...] = ()  # checkpoint anchors
        # Scored prefill (docs/scored-prefill.md): -1, or the top alternatives per
        # prompt token; the scores collected so far by prompt position (the entry
        # of token p), and whether they went out (with the first event).
        self.prompt_logprobs = -1
        self.prompt_scores: dict[int, object] = {}
        self.prompt_scores_sent = False
        # Its images (None: none): the spans and the pixels the vision frames send.
        self.images: RequestImages | None = None
        # Prompt tokens its first residency found in the prefix cache (set with
        # its first output).
        self.cached_tokens = 0
        self.submitted_ns = time.monotonic_ns()
        # Set by the engine thread when the request first runs (informational).
        self.slot: int | None = None
        self.generation: int | None = None
        self.error: BaseException | None = None
        self._events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._tokens: list[int] = []
        self._finish_reason: str | None = None
        self._done = threading.Event()
        self._taken_last = False

    # ------------------------------------------------------------ producer side
    def _push(
        self,
        tokens: tuple[int, ...],
        finish_reason: str | None = None,
        fence: int = 0,
        logprobs: tuple = (),
        prompt_logprobs: tuple = (),
    ) -> bool:
        """Publish an event; False (and nothing published) once finished."""
        with self._lock:
            if self._done.is_set():
                return False
            self._tokens.extend(tokens)
            finished = finish_reason is not None
            if finished:
                self._finish_reason = finish_reason
            event = TokenEvent(
                tokens, finished, finish_reason, time.monotonic_ns(), fence, logprobs,
                prompt_logprobs,
            )  # fmt: skip
            self._events.put(event)
            if finished:
                self._done.set()
        if self.listener is not None:
            try:
                self.listener(self, event)
            except Exception:  # a listener's bug must not take the engine down
                log.exception("request %d: the stream listener failed", self.request_id)
        return True

    # ------------------------------------------------------------ consumer side
    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def finish_reason(self) -> str | None:
        with self._lock:
            return self._finish_reason

    @property
    def token_ids(self) -> list[int]:
        """Every token published so far (whether or not its event was taken)."""
        with self._lock:
            return list(self._tokens)

    def get(self, timeout: float | None = None) -> TokenEvent:
        """The next event; TimeoutError after ``timeout`` s, EOFError after the last."""
        if self._taken_last:
            raise EOFError(f"request {self.request_id}: stream already finished")
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"request {self.request_id}: no token event within {timeout} s"
            ) from None
        if event.finished:
            self._taken_last = True
        return event

    def __iter__(self) -> Iterator[TokenEvent]:
        while not self._taken_last:
            yield self.get()

    def result(self, timeout: float | None = None) -> StreamResult:
        """Wait until the request finishes; every token and the finish reason."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        with self._lock:
            return StreamResult(list(self._tokens), self._finish_reason)

    def cancel(self) -> None:
        self._cancel(self)

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return (
            f"RequestStream(id={self.request_id}, prompt={len(self.prompt_token_ids)}, "
            f"max_tokens={self.max_tokens}, tokens={len(self._tokens)}, {state})"
        )
