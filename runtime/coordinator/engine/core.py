"""The coordinator engine: requests in, frames out, completions back, tokens to streams.

One thread owns the channel and the scheduler (the engine thread of
:meth:`Engine.run_in_thread`, or whoever calls :meth:`Engine.step`).  Other
threads talk to it only through :meth:`Engine.submit`, :meth:`Engine.cancel`,
:meth:`Engine.publish`, :meth:`Engine.fail` and
:meth:`Engine.measure_round_trip`, which queue commands, and through the
thread-safe :class:`RequestStream` and :class:`EngineStats`.

One round of the loop: admit queued submissions and cancellations; advance the
scheduler's clock; while ``plan()`` offers a program, commit it under the next
fence, publish it as a :class:`Frame` and remember when and whether it was
dispatched behind another; then take completions.  A fence is applied when every
rank has answered it, strictly in fence order: timing (each rank's interval, the
largest readiness delay, host wall from dispatch, queued) and rank 0's lanes go
to ``Scheduler.complete``; the committed tokens go to their streams.  They
count as published at once, unless ``external_publication``: then a frontend
reports when the client saw them (:meth:`Engine.publish`).

:class:`Engine` is built in layers, one concept each:
:mod:`~runtime.coordinator.engine.lifecycle` (state, start-up, failure,
shutdown), :mod:`~runtime.coordinator.engine.inflight` (frames planned, sent
and watched), :mod:`~runtime.coordinator.engine.completions` (completions
applied in fence order); this module adds the public API, the loop and the
commands (:mod:`~runtime.coordinator.engine.commands`) it takes from other
threads.  The scheduler is anything that satisfies
:class:`runtime.coordinator.interface.EngineScheduler`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from runtime.coordinator.engine.commands import (
    AskRanks,
    CancelRequest,
    Command,
    FailEngine,
    Probe,
    PublishOutput,
    RankLost,
    StartProbe,
    SubmitRequest,
)
from runtime.coordinator.engine.completions import CompletionHandling
from runtime.coordinator.engine.config import EngineConfig, EngineError
from runtime.coordinator.engine.frames import Live
from runtime.coordinator.engine.ranks import RankAsk
from runtime.coordinator.engine.stream import CANCELLED, ERROR, RequestStream, TokenEvent
from runtime.coordinator.engine.submission import check_images, check_submission, spec_images
from runtime.coordinator.errors import SchedulerError
from runtime.coordinator.requests import RequestSpec
from runtime.transport.control import Control
from runtime.transport.images import SubmitImage
from runtime.transport.inspection import RankStatus
from runtime.transport.sampling import SamplingParams

log = logging.getLogger("runtime.coordinator.engine")

# Longest single wait inside step(): bounds how late stop() and the completion
# timeout are noticed while frames are in flight.
MAX_WAIT_MS = 20
RUN_STEP_MS = 50


class Engine(CompletionHandling):
    """The coordinator's runtime around one scheduler and one channel.

    Usage::

        engine = Engine(EngineConfig(world_size=2))
        endpoints = engine.bind()  # start the ranks against these
        engine.start()  # handshake, catalogs, scheduler
        engine.run_in_thread()
        stream = engine.submit([1, 2, 3], max_tokens=16)
        for event in stream: ...
        engine.stop()  # shutdown to the ranks, channel closed
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        super().__init__(config)
        # What each stream of this engine cancels through (and how cancel() and
        # publish() know a stream of theirs): one bound method, made once.
        self._cancel_stream: Callable[[RequestStream], None] = self.cancel

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        ignore_eos: bool = False,
        listener: Callable[[RequestStream, TokenEvent], None] | None = None,
        group: int | None = None,
        cache_salt: str = "",
        message_endpoints: Sequence[int] = (),
        prompt_logprobs: int = -1,
        images: Sequence[SubmitImage] = (),
    ) -> RequestStream:
        """Queue a request; returns its stream at once (any thread).

        ``ignore_eos``: the ranks' eos stop is ignored and the request runs to
        ``max_tokens``.  ``listener``: called with each event as it is queued
        (see :class:`RequestStream`).  ``group``: the admission group, say the
        HTTP request whose choice this is; residency goes round-robin across
        groups, first come first served within one (None: a group of its own;
        see runtime.coordinator.residency).  ``cache_salt``: prefix-cache pages
        are shared only between requests with equal salts.  ``message_endpoints``:
        each chat message's end in the prompt (checkpoint anchors).
        ``prompt_logprobs`` >= 0: score the prompt (scored prefill programs):
        the first event carries each prompt token's log probability and this
        many alternatives (``TokenEvent.prompt_logprobs``); ``max_tokens`` may
        then be 0.  Raises
        ValueError naming the argument for invalid input.
        """
        facts = self.facts
        if facts is None:
            raise EngineError("the engine is not started: call start() first")
        prompt, sampling = check_submission(
            prompt_token_ids, max_tokens, sampling, ignore_eos, facts, prompt_logprobs
        )
        request_images = check_images(images, prompt, facts)
        if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
            raise ValueError(f"group must be an integer or None, got {group!r}")
        if not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        ends = tuple(message_endpoints)
        if any(isinstance(e, bool) or not isinstance(e, int) for e in ends):
            raise ValueError(f"message_endpoints must hold integers, got {ends!r}")
        with self._command_lock:
            self._check_open()
            if self.failing is not None:
                raise EngineError(f"the engine is failing: {self.failing}")
            request_id = self._next_request
            self._next_request += 1
            stream = RequestStream(
                self._cancel_stream,
                request_id,
                prompt,
                max_tokens,
                sampling,
                ignore_eos,
                listener,
                group,
            )
            stream.cache_salt, stream.message_endpoints = cache_salt, ends
            stream.prompt_logprobs = prompt_logprobs
            stream.images = request_images
            self._commands.append(SubmitRequest(stream))
        self.stats.add(requests_submitted=1)
        self._wake.set()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Stop ``stream``'s request (any thread); it ends with finish_reason "cancelled".

        A request that already finished is left as it is.  The slot and pages
        are freed once the request's last submitted frame completes.
        """
        if not isinstance(stream, RequestStream) or stream._cancel is not self._cancel_stream:
            raise ValueError("cancel takes a RequestStream of this engine")
        with self._command_lock:
            if self._closed:
                return
            self._commands.append(CancelRequest(stream))
        self._wake.set()

    def publish(self, stream: RequestStream, fence: int, at_ns: int) -> None:
        """``stream``'s output through ``fence`` became visible at ``at_ns`` (any thread).

        For ``external_publication``: the frontend calls this when the client
        can see the text (after detokenization and stop-string hold-back); the
        output-age cost and delivery accounting run on that time.  Applied
        before the engine handles the next completion; a request that is gone
        is ignored.
        """
        if not isinstance(stream, RequestStream) or stream._cancel is not self._cancel_stream:
            raise ValueError("publish takes a RequestStream of this engine")
        with self._command_lock:
            if self._closed:
                return
            self._commands.append(PublishOutput(stream, fence, at_ns))
        self._wake.set()

    def measure_round_trip(self, count: int = 100, timeout_s: float = 60.0) -> list[int]:
        """Round trips of ``count`` empty frames, in ns (any thread).

        Each empty frame goes coordinator -> every rank -> coordinator through
        the same channel, validation and rank loop as a real frame, but runs no
        program: what the host and the transport add to every frame.  Frames
        are sent one at a time into an empty window; planning pauses meanwhile.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        if not self.started:
            raise EngineError("the engine is not started: call start() first")
        probe = Probe(count)
        with self._command_lock:
            self._check_open()
            self._commands.append(StartProbe(probe))
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while not probe.done.is_set():
            if time.monotonic() > deadline:
                raise EngineError(f"round-trip probe unfinished after {timeout_s:g} s")
            if self._thread is None:
                self.step(MAX_WAIT_MS)
            else:
                probe.done.wait(0.05)
                self._check_open()
        return list(probe.round_trips_ns)

    def inspect_ranks(self, timeout_s: float = 5.0) -> list[RankStatus]:
        """Every rank's :class:`RankStatus` (any thread): slots in use, programs,
        frames, memory.  Raises EngineError naming the ranks that did not answer."""
        ask = self._ask_ranks(RankAsk("inspect", timeout_ns=int(timeout_s * 1e9)), timeout_s)
        return [ask.answers[rank] for rank in range(self._world)]  # type: ignore[misc]

    def profile_ranks(self, frames: int, timeout_s: float = 60.0) -> tuple[dict[int, int], int]:
        """Have every rank run ``torch.profiler`` over its next ``frames`` frames
        (any thread).  Returns the frames profiled by rank (0: the rank could not
        write its trace) and the profile's number, which names its traces
        (``runtime.transport.control.profile_path``).  Raises EngineError naming the
        ranks that did not answer in time (say, no frames ran; their traces come
        once the frames have)."""
        ask = RankAsk("profile", count=frames, timeout_ns=int(timeout_s * 1e9))
        ask = self._ask_ranks(ask, timeout_s)
        counts = {rank: _profiled(answer) for rank, answer in sorted(ask.answers.items())}
        return counts, ask.nonce

    def _ask_ranks(self, ask: RankAsk, timeout_s: float) -> RankAsk:
        if not self.started:
            raise EngineError("the engine is not started: call start() first")
        with self._command_lock:
            self._check_open()
            self._commands.append(AskRanks(ask))
        self._wake.set()
        deadline = time.monotonic() + timeout_s + 1.0  # the engine thread expires it first
        while not ask.done.wait(0.05):
            if self._thread is None:
                self.step(MAX_WAIT_MS)
            elif time.monotonic() > deadline:
                break
        if len(ask.answers) < self._world:
            missing = sorted(set(range(self._world)) - set(ask.answers))
            self._check_open()
            raise EngineError(
                f"{ask.command}: no answer from rank(s) {missing} within {timeout_s:g} s"
            )
        return ask

    # ------------------------------------------------------------------ running
    def run_in_thread(self) -> Engine:
        """Run the loop in a daemon thread until :meth:`stop`."""
        if not self.started:
            raise EngineError("the engine is not started: call start() first")
        if self._thread is not None:
            raise EngineError("the engine thread is already running")
        self._check_open()
        self._thread = threading.Thread(target=self._run, name="flare-engine", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._step(RUN_STEP_MS)
        except BaseException as exc:
            self._fail(exc)

    def step(self, timeout_ms: int = 0) -> bool:
        """One round of the loop, for driving the engine without its thread.

        Does what can be done now; if nothing could, waits up to ``timeout_ms``
        for a completion or a submission and handles it.  Returns whether
        anything happened (a request admitted or cancelled, a frame sent or
        applied).  An engine failure is raised (after the engine shut down).
        """
        if not self.started:
            raise EngineError("the engine is not started: call start() first")
        if self._thread is not None:
            raise EngineError("the engine runs in its own thread; step() is for manual driving")
        self._check_open()
        try:
            return self._step(timeout_ms)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _step(self, timeout_ms: int) -> bool:
        channel = self._channel
        assert channel is not None
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        self._wake.clear()
        with self._state_lock:
            progressed = self._drain_commands()
            progressed |= self._dispatch()
            self._expire_queries()
        while not self._stopping.is_set():
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            wait_ms = 0 if progressed else min(MAX_WAIT_MS, remaining_ms)
            if self._inflight or self._queries:
                message = self._await_message(wait_ms)
                with self._state_lock:
                    if message is not None:  # publications first, then completions
                        progressed |= self._drain_commands()
                    while message is not None:
                        progressed |= self._on_message(message)
                        message = channel.recv(timeout_ms=0)
                    progressed |= self._drain_commands()
                    progressed |= self._dispatch()
                    self._check_overdue()
                    self._expire_queries()
            elif wait_ms > 0:
                self._wake.wait(wait_ms / 1000)
                self._wake.clear()
                with self._state_lock:
                    progressed |= self._drain_commands()
                    progressed |= self._dispatch()
            if progressed or remaining_ms == 0:
                break
        return progressed

    # ------------------------------------------------------------------ commands
    def _drain_commands(self) -> bool:
        done = False
        while True:
            with self._command_lock:
                if not self._commands:
                    return done
                command = self._commands.popleft()
            done = True
            self._run_command(command)

    def _run_command(self, command: Command) -> None:
        match command:
            case FailEngine(error):
                raise error
            case RankLost(rank, reason):
                raise self._gone_error(rank, reason)
            case StartProbe(probe):
                self._probes.append(probe)
            case AskRanks(ask):
                self._send_ask(ask)
            case PublishOutput(stream, fence, at_ns):
                self._publish(stream, fence, at_ns)
            case SubmitRequest(stream):
                self._admit(stream)
            case CancelRequest(stream):
                self._cancel(stream)

    def _admit(self, stream: RequestStream) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        now = time.monotonic_ns()
        scheduler.advance_to(now)
        prompt = stream.prompt_token_ids
        spec = RequestSpec(
            len(prompt),
            stream.max_tokens,
            message_endpoints=tuple(e for e in stream.message_endpoints if 0 < e <= len(prompt)),
            group=stream.group,
            prompt_tokens=prompt,
            cache_salt=stream.cache_salt,
            score_prompt=stream.prompt_logprobs >= 0,
            **spec_images(stream.images),
        )
        try:
            handle = scheduler.admit(spec)
        except (SchedulerError, ValueError) as exc:  # submit() checks first; defensive
            log.warning("request %d refused by the scheduler: %s", stream.request_id, exc)
            stream.error = exc
            stream._push((), ERROR)
            return
        if self.trace is not None:
            self.trace.admitted(handle.id, stream, spec, now, self._next_fence, scheduler)
        live = Live(stream, handle)
        self._by_handle[handle.id] = live
        self._by_request[stream.request_id] = live

    def _cancel(self, stream: RequestStream) -> None:
        live = self._by_request.get(stream.request_id)
        if live is None:
            return  # finished and retired (or refused) before the cancel arrived
        scheduler = self.scheduler
        assert scheduler is not None
        if scheduler.cancel(live.handle):
            self.stats.add(requests_cancelled=1)
        if self.trace is not None:
            self.trace.cancelled(live.handle.id, time.monotonic_ns(), self._next_fence)
        stream._push((), CANCELLED)
        self._retire_if_gone(live)

    def _publish(self, stream: RequestStream, fence: int, at_ns: int) -> None:
        live = self._by_request.get(stream.request_id)
        if live is None:
            return  # finished, retired or cancelled meanwhile
        scheduler = self.scheduler
        assert scheduler is not None
        try:
            scheduler.published_output(live.handle, fence, at_ns)
        except SchedulerError as exc:  # already covered by a later publication
            log.debug("request %d: publication ignored: %s", stream.request_id, exc)

    # ------------------------------------------------------------------ inspection
    @property
    def rejected_messages(self) -> int:
        """Messages the channel refused as malformed or misdirected."""
        return 0 if self._channel is None else self._channel.rejected

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for export, read consistently from any thread.

        Names follow the exported metric names without their prefix, e.g.
        ``executions_total{class=ordinary}`` is ``executions_total:ordinary``.
        """
        out: dict[str, float] = dict(self.stats.counters())
        channel = self._channel
        out["transport_auth_denied_total"] = 0 if channel is None else channel.auth_denied
        if self.trace is not None:
            out.update(self.trace.counters())
        out.update(self.rank_metrics.values())
        self.rank_metrics.wanted(time.monotonic_ns())
        for kind, (frames, device_ns) in self.stats.by_kind().items():
            out[f"frames_total:{kind}"] = frames
            out[f"device_nanoseconds_total:{kind}"] = device_ns
        with self._state_lock:
            scheduler = self.scheduler
            if scheduler is None:
                return out
            for reason, count in scheduler.executions.items():
                out[f"executions_total:{reason.value}"] = count
                out[f"execution_nanoseconds_total:{reason.value}"] = scheduler.execution_ns[reason]
            out["running"] = scheduler.running
            out["waiting"] = scheduler.waiting
            out["in_flight"] = scheduler.in_flight
            out["free_pages"] = scheduler.free_pages
            out["num_pages"] = scheduler.config.num_pages
            out.update(scheduler.memory_stats())  # direct mode: none
        return out

    def graph_estimates(self) -> dict[str, int]:
        """Each program's current duration estimate in ns (0: not measured yet)."""
        with self._state_lock:
            return {} if self.scheduler is None else self.scheduler.catalog.estimates()

    def snapshot(self) -> dict[str, int]:
        """Scheduler occupancy, read consistently from any thread."""
        with self._state_lock:
            scheduler = self.scheduler
            if scheduler is None:
                return {}
            return {
                "in_flight": scheduler.in_flight,
                "running": scheduler.running,
                "waiting": scheduler.waiting,
                "free_pages": scheduler.free_pages,
                "num_pages": scheduler.config.num_pages,
                "live_requests": len(self._by_request),
                "pending_commands": len(self._commands),
                "rejected_messages": self.rejected_messages,
            }


def _profiled(answer: RankStatus | Control) -> int:
    """The frames one rank profiled: the ranks answer ``profile`` with a ``profiled`` Control."""
    assert isinstance(answer, Control), answer
    return answer.count
