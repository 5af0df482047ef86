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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.catalog import GraphKind, describe_counts
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.engine.config import (
    EngineConfig,
    EngineError,
    EngineStartError,
    frame_watchdog_ns,
)
from runtime.coordinator.engine.frames import (
    Dispatch,
    Live,
    build_frame,
    check_token_ids,
    completion_records,
    execution_timing,
    lane_logprobs,
    mark_pages_sent,
    sidecar_rows,
    token_logprobs,
)
from runtime.coordinator.engine.ranks import RankAsk, RankMetrics, RankQueries
from runtime.coordinator.engine.startup import ModelFacts, agree, collect_reports
from runtime.coordinator.engine.stats import EngineStats, FrameStat
from runtime.coordinator.engine.stream import (
    ABORTED,
    CANCELLED,
    ERROR,
    RequestStream,
    TokenEvent,
)
from runtime.coordinator.engine.submission import check_submission
from runtime.coordinator.engine.trace import FrameTrace
from runtime.coordinator.errors import CompletionError, SchedulerError
from runtime.coordinator.plan import ScheduledPlan
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from runtime.trace.writer import TraceOptions
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.channels import ChannelEndpoints, HandshakeTimeout, TransportError
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import MAX_SLOTS
from runtime.transport.inspection import RankStatus
from runtime.transport.liveness import CoordinatorLiveness, LivenessConfig
from runtime.transport.sampling import SamplingParams
from runtime.transport.security import ClientKeys, DeploymentKeys, per_run_keys

log = logging.getLogger("runtime.coordinator.engine")

# Longest single wait inside step(): bounds how late stop() and the completion
# timeout are noticed while frames are in flight.
MAX_WAIT_MS = 20
RUN_STEP_MS = 50
UNREAD_TRACE_RECORDS = 2048  # scheduler trace records kept when no trace file reads them


@dataclass
class _Probe:
    """A round-trip measurement: ``count`` empty frames, one at a time."""

    count: int
    round_trips_ns: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


class Engine:
    """The coordinator's runtime around one :class:`Scheduler` and one channel.

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
        self.config = config if config is not None else EngineConfig()
        if not isinstance(self.config, EngineConfig):
            raise TypeError("Engine takes an EngineConfig")
        self.stats = EngineStats(self.config.frame_stats)
        self.scheduler: Scheduler | None = None
        self.facts: ModelFacts | None = None
        self.error: BaseException | None = None
        # Why the engine is about to fail (mark_failing, any thread): it stops serving
        # at once; the failure itself (error) follows at the engine thread's next round.
        self.failing: str | None = None
        self.failed_at: float | None = None  # monotonic time of the first sign of failure
        self._channel: CoordinatorChannel | None = None
        self._run_keys: DeploymentKeys | None = None  # per-run CURVE keys (tcp, none given)
        self._world = self.config.world_size
        # Commands from any thread; the engine thread drains them.
        self._commands: deque[tuple[str, Any]] = deque()
        self._command_lock = threading.Lock()
        self._wake = threading.Event()
        self._state_lock = threading.RLock()  # held by the engine thread while it mutates
        self._stopping = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._next_request = 0
        # Engine-thread state.
        self._by_handle: dict[int, Live] = {}
        self._by_request: dict[int, Live] = {}
        self._inflight: deque[Dispatch] = deque()
        self._by_fence: dict[int, Dispatch] = {}
        self._release: set[int] = set()  # retired slots not yet released on the ranks
        self._probes: deque[_Probe] = deque()
        self._queries = RankQueries(self._world)  # inspect / profile questions to every rank
        self.rank_metrics = RankMetrics(self._world)
        self._next_fence = 1
        self._start_aborted: str | None = None  # abort_start's reason
        self._start_thread: threading.Thread | None = None  # running start()
        self._head_since_ns = 0  # when the head of _inflight became the head
        self.liveness: CoordinatorLiveness | None = None  # heartbeats (started by start())
        self.trace: FrameTrace | None = None  # the live plan trace (enable_trace)
        self._trace_options: TraceOptions | None = None

    # ------------------------------------------------------------------ start-up
    @property
    def endpoints(self) -> ChannelEndpoints:
        """Where ranks connect; binds the channel on first use."""
        return self.bind()

    @property
    def started(self) -> bool:
        return self.scheduler is not None

    @property
    def serving(self) -> bool:
        """Started, not failed (nor failing) and not stopping: submissions are accepted."""
        return (
            self.started
            and self.error is None
            and self.failing is None
            and not self._closed
            and (not self._stopping.is_set())
        )

    def health(self) -> str | None:
        """Why this engine can serve no more, for good, known at once (any thread):
        its failure, or a failure on its way (:meth:`mark_failing`: a rank process
        exited, a rank's heartbeats stopped).  None while it serves, and after a
        stop that was asked for."""
        if self.error is not None:
            return f"the engine failed: {self.error}"
        return self.failing

    def unheard(self) -> str | None:
        """A rank whose last heartbeat is older than the heartbeat timeout and that the
        liveness thread has not reported yet (any thread; None: none): right after this
        process was itself paused (SIGSTOP) for longer than the timeout, its ranks may
        have left.  Not a failure by itself: heartbeats of theirs still queued here
        may show them alive a moment later, so it only says "not serving now"."""
        liveness = self.liveness
        if liveness is None or not self.serving:
            return None
        silent = liveness.silent()
        if not silent:
            return None
        rank, seconds = silent[0]
        return (
            f"rank {rank}: no heartbeat for {seconds:.1f} s "
            f"(heartbeat timeout {liveness.config.timeout_s:g} s)"
        )

    def mark_failing(self, reason: str) -> None:
        """The engine is about to fail (any thread): it stops serving at once
        (``serving`` False, :meth:`health` says ``reason``, submissions are refused)
        while the failure itself follows (:meth:`rank_gone`, :meth:`fail`)."""
        if self.failing is None and self.error is None and not self._closed:
            self.failing = str(reason)
            self.failed_at = time.monotonic()

    def bind(self) -> ChannelEndpoints:
        """Bind the coordinator channel (idempotent) and return its endpoints."""
        if self._channel is None:
            if self._closed:
                raise EngineError("the engine is stopped")
            kwargs = self.config.channel_kwargs()
            if kwargs["transport"] == "tcp" and kwargs["keys"] is None:
                if self.config.insecure_transport:
                    log.warning(
                        "INSECURE TRANSPORT: the coordinator binds TCP without CURVE keys; any "
                        "process that reaches %s can read every prompt and forge completions",
                        self.config.endpoints,
                    )
                else:  # a local TCP deployment: keys for this run, handed to its ranks
                    self._run_keys = per_run_keys()
                    kwargs["keys"] = self._run_keys.server
            try:
                self._channel = CoordinatorChannel(self._world, **kwargs)  # type: ignore[arg-type]
            except (TransportError, ValueError) as exc:
                raise EngineStartError(f"cannot bind the coordinator channel: {exc}") from exc
        return self._channel.endpoints

    def rank_keys(self) -> ClientKeys | None:
        """The CURVE keys this engine created for its ranks (a TCP channel bound
        without ``transport_keys``), or None; binds the channel on first use.
        Hand them to a rank through the environment (``keys.environment()``),
        never its command line."""
        self.bind()
        return None if self._run_keys is None else self._run_keys.clients[0]

    def start(self) -> None:
        """Handshake with every rank, collect and check their catalogs, build the scheduler.

        :meth:`stop` (or :meth:`abort_start`) from another thread ends it within
        a fraction of a second with EngineStartError."""
        if self.started:
            raise EngineError("the engine is already started")
        self._start_thread = threading.current_thread()
        try:
            self._start()
        finally:
            self._start_thread = None

    def _start(self) -> None:
        self.bind()
        channel = self._channel
        assert channel is not None
        cfg = self.config
        try:
            liveness = self._start_liveness(channel)

            def gone() -> str | None:  # a rank the heartbeats lost ends start-up at once
                if self._start_aborted is not None:
                    return self._start_aborted
                lost = None if liveness is None else liveness.gone
                return next(iter(lost.values())) if lost else None

            try:
                channel.handshake(timeout_s=cfg.handshake_timeout_s, abort=gone)
            except HandshakeTimeout as exc:
                raise EngineStartError(f"{exc} (handshake_timeout_s)") from exc
            except TransportError as exc:
                raise EngineStartError(str(exc)) from exc
            if cfg.require_heartbeats and cfg.heartbeat_timeout_s is not None:
                liveness.watch_all()
            reports = collect_reports(channel, self._world, cfg.catalog_timeout_s, abort=gone)
            facts = agree(reports, cfg.expected_identity)
            max_slots = cfg.max_slots or min(MAX_SLOTS, facts.max_decode_batch)
            scheduler_config = SchedulerConfig(
                max_slots,
                facts.page_size,
                facts.num_pages,
                fixed_speculative_width=cfg.fixed_speculative_width,
                proposer=cfg.proposer,
                speculative_token_capacity=cfg.speculative_token_capacity,
                enable_prefix_caching=cfg.enable_prefix_caching,
                debug_page_accounting=cfg.debug_page_accounting,
            )
            if cfg.direct:  # flare run --direct: the diagnostic scheduler of runtime/direct
                from runtime.direct import DirectScheduler

                scheduler = DirectScheduler(facts.descriptors, scheduler_config)
            else:
                scheduler = Scheduler(facts.descriptors, scheduler_config, cfg.policy)
                model = scheduler.speculation
                if cfg.acceptance_prior and model is not None:  # an offline measurement
                    model.preseed(cfg.proposer, cfg.acceptance_prior[: model.depth_cap])
            if self._trace_options is not None:  # an unwritable trace file fails the start
                self.trace = self._new_trace(facts)
        except BaseException as exc:
            self._shutdown(ERROR, exc)
            raise
        self.facts = facts
        self.scheduler = scheduler
        log.info(
            "engine started: %s, %d ranks, catalog of %s, %d slots, %d pages of %d tokens",
            facts.model_name,
            self._world,
            describe_counts(facts.descriptors),
            max_slots,
            facts.num_pages,
            facts.page_size,
        )

    def enable_trace(self, options: TraceOptions) -> None:
        """Trace every committed frame to ``options.path`` and a ring of recent lines.

        Call it before :meth:`start` (the file opens then, with the model's
        facts in its start line) or after; once per engine.  An unwritable path
        raises OSError.  See :mod:`runtime.coordinator.engine.trace`.
        """
        if not isinstance(options, TraceOptions):
            raise TypeError(f"enable_trace takes TraceOptions, got {options!r}")
        with self._state_lock:
            if self._trace_options is not None:
                raise EngineError("the engine is already tracing")
            if self.facts is not None and self.scheduler is not None:
                self.scheduler.drain_trace()  # records of frames already applied
                self.trace = self._new_trace(self.facts, options)
            self._trace_options = options

    def _new_trace(self, facts: ModelFacts, options: TraceOptions | None = None) -> FrameTrace:
        options = options or self._trace_options
        assert options is not None
        programs = tuple(d.describe() for d in facts.descriptors)
        return FrameTrace(options, self._world, facts.model_name, programs)

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
    ) -> RequestStream:
        """Queue a request; returns its stream at once (any thread).

        ``ignore_eos``: the ranks' eos stop is ignored and the request runs to
        ``max_tokens``.  ``listener``: called with each event as it is queued
        (see :class:`RequestStream`).  ``group``: the admission group, say the
        HTTP request whose choice this is; residency goes round-robin across
        groups, first come first served within one (None: a group of its own;
        see runtime.coordinator.residency).  ``cache_salt``: prefix-cache pages
        are shared only between requests with equal salts.  ``message_endpoints``:
        each chat message's end in the prompt (checkpoint anchors).  Raises
        ValueError naming the argument for invalid input.
        """
        facts = self.facts
        if facts is None:
            raise EngineError("the engine is not started: call start() first")
        prompt, sampling = check_submission(
            prompt_token_ids, max_tokens, sampling, ignore_eos, facts
        )
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
                self, request_id, prompt, max_tokens, sampling, ignore_eos, listener, group
            )
            stream.cache_salt, stream.message_endpoints = cache_salt, ends
            self._commands.append(("submit", stream))
        self.stats.add(requests_submitted=1)
        self._wake.set()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Stop ``stream``'s request (any thread); it ends with finish_reason "cancelled".

        A request that already finished is left as it is.  The slot and pages
        are freed once the request's last submitted frame completes.
        """
        if not isinstance(stream, RequestStream) or stream._engine is not self:
            raise ValueError("cancel takes a RequestStream of this engine")
        with self._command_lock:
            if self._closed:
                return
            self._commands.append(("cancel", stream))
        self._wake.set()

    def _start_liveness(self, channel: CoordinatorChannel) -> CoordinatorLiveness:
        """The heartbeat thread, before the handshake: a rank heartbeats from its
        own handshake on, while slower ranks may still be loading."""
        cfg = self.config
        timeout = cfg.heartbeat_timeout_s
        liveness = CoordinatorLiveness(
            channel.take_heartbeat_socket(),
            self._world,
            LivenessConfig(
                cfg.heartbeat_interval_s,
                timeout if timeout is not None else float(1 << 40),  # None: never gone
            ),
            self.rank_gone,
        )
        self.liveness = liveness
        liveness.start()
        return liveness

    def abort_start(self, reason: str) -> None:
        """End a :meth:`start` running in another thread within a fraction of a
        second (any thread), with EngineStartError(``reason``): say, a local rank
        process exited during start-up."""
        self._start_aborted = str(reason)

    def rank_gone(self, rank: int, reason: str) -> None:
        """Rank ``rank`` is gone (any thread): its process exited, or its heartbeats
        stopped.  The engine fails at its next round with an EngineError naming the
        rank and the fences in flight; a hung or lost rank cannot be recovered in
        place, so the deployment shuts down."""
        self.mark_failing(reason)
        with self._command_lock:
            if self._closed:
                return
            self._commands.append(("gone", (rank, reason)))
        self._wake.set()

    def _gone_error(self, rank: int, reason: str) -> EngineError:
        waiting = [d.fence for d in self._inflight if rank not in d.answers]
        if waiting:
            fences = ", ".join(str(f) for f in waiting)
            where = f"fence(s) {fences} in flight, unanswered by rank {rank}"
        else:
            where = "no frame in flight"
        return EngineError(f"{reason}; {where}; the deployment shuts down")

    def fail(self, exc: BaseException) -> None:
        """Fail the engine from any thread (say, a rank process died).

        The engine thread raises ``exc`` at its next round: every open stream
        ends with finish_reason "error", the ranks are told to shut down.
        """
        self.mark_failing(str(exc))
        with self._command_lock:
            if self._closed:
                return
            self._commands.append(("fail", exc))
        self._wake.set()

    def publish(self, stream: RequestStream, fence: int, at_ns: int) -> None:
        """``stream``'s output through ``fence`` became visible at ``at_ns`` (any thread).

        For ``external_publication``: the frontend calls this when the client
        can see the text (after detokenization and stop-string hold-back); the
        output-age cost and delivery accounting run on that time.  Applied
        before the engine handles the next completion; a request that is gone
        is ignored.
        """
        if not isinstance(stream, RequestStream) or stream._engine is not self:
            raise ValueError("publish takes a RequestStream of this engine")
        with self._command_lock:
            if self._closed:
                return
            self._commands.append(("publish", (stream, fence, at_ns)))
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
        probe = _Probe(count)
        with self._command_lock:
            self._check_open()
            self._commands.append(("probe", probe))
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
        (``runtime.ranks.profiling.profile_path``).  Raises EngineError naming the
        ranks that did not answer in time (say, no frames ran; their traces come
        once the frames have)."""
        ask = RankAsk("profile", count=frames, timeout_ns=int(timeout_s * 1e9))
        ask = self._ask_ranks(ask, timeout_s)
        counts = {rank: answer.count for rank, answer in sorted(ask.answers.items())}
        return counts, ask.nonce  # type: ignore[return-value]

    def _ask_ranks(self, ask: RankAsk, timeout_s: float) -> RankAsk:
        if not self.started:
            raise EngineError("the engine is not started: call start() first")
        with self._command_lock:
            self._check_open()
            self._commands.append(("ask", ask))
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

    def _check_open(self) -> None:
        if self.error is not None:
            raise EngineError(f"the engine failed: {self.error}")
        if self._closed or self._stopping.is_set():
            raise EngineError("the engine is stopped")

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

    def _await_message(self, wait_ms: int) -> object | None:
        """The next message from the ranks within ``wait_ms``, or None.

        With ``poll_spin_us``, sleeps in ``zmq_poll`` until shortly before the
        head frame's expected end, then busy-polls across it: the completion
        is then seen within microseconds instead of after a wake-up.
        """
        channel = self._channel
        assert channel is not None
        spin_us = self.config.poll_spin_us
        if not spin_us or wait_ms == 0 or not self._inflight:
            return channel.recv(timeout_ms=wait_ms)
        deadline_ns = time.monotonic_ns() + wait_ms * 1_000_000
        lead_ms = (self._inflight[0].expected_end_ns - spin_us * 1000 - time.monotonic_ns()) // (
            1_000_000
        )
        if lead_ms > 0:
            message = channel.recv(timeout_ms=min(lead_ms, wait_ms))
            if message is not None:
                return message
        remaining_ms = max(0, -(-(deadline_ns - time.monotonic_ns()) // 1_000_000))
        return channel.recv(timeout_ms=remaining_ms, spin_us=2 * spin_us)

    # ------------------------------------------------------------------ commands
    def _drain_commands(self) -> bool:
        done = False
        while True:
            with self._command_lock:
                if not self._commands:
                    return done
                kind, item = self._commands.popleft()
            done = True
            if kind == "fail":
                raise item
            if kind == "gone":
                raise self._gone_error(*item)
            if isinstance(item, _Probe):
                self._probes.append(item)
            elif isinstance(item, RankAsk):
                self._send_ask(item)
            elif kind == "publish":
                self._publish(*item)
            elif kind == "submit":
                self._admit(item)
            else:
                self._cancel(item)

    def _admit(self, stream: RequestStream) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        scheduler.advance_to(time.monotonic_ns())
        prompt = stream.prompt_token_ids
        spec = RequestSpec(
            len(prompt),
            stream.max_tokens,
            message_endpoints=tuple(e for e in stream.message_endpoints if 0 < e <= len(prompt)),
            group=stream.group,
            prompt_tokens=prompt,
            cache_salt=stream.cache_salt,
        )
        try:
            handle = scheduler.admit(spec)
        except (SchedulerError, ValueError) as exc:  # submit() checks first; defensive
            log.warning("request %d refused by the scheduler: %s", stream.request_id, exc)
            stream.error = exc
            stream._push((), ERROR)
            return
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

    def _retire_if_gone(self, live: Live) -> None:
        """Forget a request the scheduler retired; its slot is released on the ranks."""
        assert self.scheduler is not None
        if self.scheduler.request(live.handle) is not None:
            return
        self._by_handle.pop(live.handle.id, None)
        self._by_request.pop(live.stream.request_id, None)
        if live.slot >= 0:
            self._release.add(live.slot)

    # ------------------------------------------------------------------ rank questions
    def _send_ask(self, ask: RankAsk) -> None:
        channel = self._channel
        assert channel is not None
        channel.publish(self._queries.open(ask, time.monotonic_ns()))

    def _answered(self, message: object) -> None:
        ask = self._queries.take(message)
        if ask is not None and ask.internal:
            self.rank_metrics.refreshed(ask.answers, time.monotonic_ns())  # type: ignore[arg-type]

    def _expire_queries(self) -> None:
        now = time.monotonic_ns()
        for ask in self._queries.expire(now):
            if ask.internal:
                self.rank_metrics.refreshed(ask.answers, now)  # type: ignore[arg-type]
        if self.rank_metrics.refresh_due(now):  # someone reads the ranks' memory
            self.rank_metrics.refreshing = True
            self._send_ask(RankAsk("inspect", internal=True))

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self) -> bool:
        scheduler, channel = self.scheduler, self._channel
        assert scheduler is not None and channel is not None
        if self._probes:  # a measurement waits for an empty window and holds planning
            return self._send_probe()
        sent = False
        while True:
            plan_ns = time.monotonic_ns()
            scheduler.advance_to(plan_ns)
            plan = scheduler.plan()
            if plan is None:
                if self._release and not self._inflight:  # idle: free the ranks' slots now
                    return self._send_empty(probe=False) or sent
                return sent
            fence = self._next_fence
            frame, lives = self._frame(plan, fence)
            queued = scheduler.in_flight > 0
            scheduler.commit(plan, fence)
            self._next_fence += 1
            self._release.clear()  # carried by this frame (or replaced by a new tenant)
            sent_ns = time.monotonic_ns()
            start_ns = max(sent_ns, self._inflight[-1].expected_end_ns) if queued else sent_ns
            dispatch = Dispatch(
                fence,
                plan,
                tuple(live.stream.ignore_eos for live in lives),
                queued,
                plan_ns,
                sent_ns,
                start_ns + plan.estimated_duration_ns,
            )
            channel.publish(frame)
            mark_pages_sent(lives)
            self._inflight.append(dispatch)
            self._by_fence[fence] = dispatch
            self.stats.add(frames_sent=1)
            sent = True

    def _send_probe(self) -> bool:
        """Publish the next empty frame of the head probe once nothing is in flight."""
        return False if self._inflight else self._send_empty(probe=True)

    def _send_empty(self, probe: bool) -> bool:
        """An empty frame: a probe's, or one that carries slot releases only."""
        channel, facts = self._channel, self.facts
        assert channel is not None and facts is not None
        fence = self._next_fence
        self._next_fence += 1
        program = min(facts.descriptors, key=lambda d: (d.batch_capacity, d.prompt_capacity))
        frame = Frame(fence, program, release_slots=tuple(sorted(self._release)))
        self._release.clear()
        now = time.monotonic_ns()
        dispatch = Dispatch(fence, None, (), False, now, time.monotonic_ns(), now, probe=probe)
        channel.publish(frame)
        self._inflight.append(dispatch)
        self._by_fence[fence] = dispatch
        return True

    def _frame(self, plan: ScheduledPlan, fence: int) -> tuple[Frame, list[Live]]:
        """The wire frame of ``plan`` and its lanes' requests, in lane order."""
        scheduler = self.scheduler
        assert scheduler is not None
        lives = []
        for lane in plan.lanes:
            live = self._by_handle[lane.handle.id]
            if (live.slot, live.generation) != (lane.slot, lane.generation):
                starts = getattr(scheduler, "generation_start", None)  # direct mode: none
                live.reside(lane.slot, lane.generation, starts and starts(lane.handle))
                live.stream.slot, live.stream.generation = lane.slot, lane.generation
            live.pages = scheduler.page_table(lane.handle)  # pages on demand: it grows
            lives.append(live)
        return build_frame(plan, fence, lives, self._release), lives

    # ------------------------------------------------------------------ completions
    def _on_message(self, message: object) -> bool:
        if self._queries.is_answer(message):
            self._answered(message)
            return False
        if isinstance(message, Control) and message.command == "error":
            # The rank could not decode something the coordinator sent: a frame may
            # be lost, and waiting for its completion would stall; fail fast.
            fences = ", ".join(str(d.fence) for d in self._inflight) or "none"
            raise EngineError(
                f"rank {message.rank} could not decode a message from the coordinator "
                f"({message.reason}); frames in flight fail: fence(s) {fences}"
            )
        if not isinstance(message, Completion):
            kind = type(message).__name__
            if isinstance(message, (CatalogReport, Control)):
                log.warning("ignoring %s from rank %d after start-up", kind, message.rank)
            else:
                log.warning("ignoring unexpected %s", kind)
            self.stats.add(ignored_messages=1)
            return False
        dispatch = self._by_fence.get(message.fence)
        if dispatch is None:
            log.warning(
                "ignoring completion from rank %d for fence %d: not in flight%s",
                message.rank,
                message.fence,
                "" if message.error is None else f" (its error: {message.error})",
            )
            self.stats.add(ignored_messages=1)
            return False
        if message.rank in dispatch.answers:
            log.warning(
                "ignoring duplicate completion from rank %d for fence %d",
                message.rank,
                message.fence,
            )
            self.stats.add(ignored_messages=1)
            return False
        if message.error is not None:
            # The ranks may now disagree with the scheduler: stop rather than guess.
            raise EngineError(
                f"rank {message.rank} could not run frame {message.fence}: {message.error}"
            )
        dispatch.answers[message.rank] = message
        if self.trace is not None:
            self.trace.arrived(message.fence, message.rank, time.monotonic_ns())
        self.stats.add(completion_messages=1)
        applied = False
        while self._inflight and len(self._inflight[0].answers) == self._world:
            self._apply(self._inflight.popleft())
            self._head_since_ns = time.monotonic_ns()
            applied = True
        return applied

    def _apply(self, dispatch: Dispatch) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        now = time.monotonic_ns()
        if dispatch.plan is None:  # an empty frame
            self.rank_metrics.record(dispatch.answers, None)
            del self._by_fence[dispatch.fence]
            if not dispatch.probe:  # releases only
                return
            probe = self._probes[0]
            probe.round_trips_ns.append(now - dispatch.sent_ns)
            if self.trace is not None:
                self.trace.applied(dispatch, now, [])
            if len(probe.round_trips_ns) >= probe.count:
                self._probes.popleft().done.set()
            return
        scheduler.advance_to(now)
        del self._by_fence[dispatch.fence]
        answers = dispatch.answers
        timing = execution_timing(dispatch, now, self._world)
        rank_ns, readiness = timing.rank_device_ns, timing.readiness_delay_ns
        assert self.facts is not None
        vocab = self.facts.vocab_size
        check_token_ids(answers[0], vocab)  # a corrupt or forged answer fails fast
        records = completion_records(answers[0], dispatch.ignore_eos)
        try:
            generated = self._complete(dispatch, records, timing)
        except CompletionError as exc:
            raise EngineError(
                f"fence {dispatch.fence}: rank 0's results were refused: {exc}"
            ) from exc
        self.rank_metrics.record(answers, dispatch.plan.reason.value)
        if self.trace is not None:
            self.trace.applied(dispatch, now, scheduler.drain_trace())
        else:  # no trace file: keep a short recent tail for in-process readers, so an
            # undrained buffer does not grow for the server's life
            scheduler.trim_trace(UNREAD_TRACE_RECORDS)
        lanes = dispatch.plan.lanes
        asked = [self._by_handle[lane.handle.id].stream.sampling.logprobs for lane in lanes]
        graph = dispatch.plan.graph
        if graph.kind is GraphKind.SPECULATIVE or graph.token_capacity > 1:  # a row per token
            entries = token_logprobs(answers[0], asked, vocab)
        else:
            entries = [None if e is None else (e,) for e in lane_logprobs(answers[0], asked, vocab)]
        by_handle = {
            lane.handle.id: entry for lane, entry in zip(lanes, entries) if entry is not None
        }
        tokens = finished = 0
        for item in generated:
            live = self._by_handle.get(item.handle.id)
            if live is None:  # pragma: no cover - the scheduler only reports live requests
                continue
            reason = item.finish_reason if item.finished else None
            entry = by_handle.get(item.handle.id)
            logprobs = entry if entry is not None and len(item.tokens) == len(entry) else ()
            live.stream.cached_tokens = item.cached_tokens
            if live.stream._push(item.tokens, reason, item.fence, logprobs):
                tokens += len(item.tokens)
                finished += item.finished
            if item.tokens and not self.config.external_publication:
                # (A terminal snapshot's finish carries no tokens: nothing to publish.)
                scheduler.published_output(item.handle, item.fence, now)
        for lane in dispatch.plan.lanes:
            live = self._by_handle.get(lane.handle.id)
            if live is not None:
                self._retire_if_gone(live)
        self.stats.add(tokens_out=tokens, requests_finished=finished)
        self.stats.record_frame(
            FrameStat(
                fence=dispatch.fence,
                graph=dispatch.plan.graph.describe(),
                lanes=len(dispatch.plan.lanes),
                queued=dispatch.queued,
                plan_ns=dispatch.plan_ns,
                sent_ns=dispatch.sent_ns,
                completed_ns=now,
                rank_device_ns=rank_ns,
                readiness_delay_ns=readiness,
            ),
            dispatch.plan.graph.kind.value,
        )

    def _complete(self, dispatch: Dispatch, records: list, timing) -> list:
        """Hand the frame to the scheduler; a speculative round with its sidecars:
        rank 0's confidence [2, slots, depth] (device-allocated programs) and
        survival rows [lanes, depth] (when the program writes them); every
        rank's must be valid probabilities."""
        scheduler = self.scheduler
        assert scheduler is not None and dispatch.plan is not None
        graph = dispatch.plan.graph
        if graph.kind is not GraphKind.SPECULATIVE:
            return scheduler.complete(dispatch.fence, records, timing)
        confidence = survival = None
        for rank, answer in sorted(dispatch.answers.items()):
            c, s = sidecar_rows(answer, "confidence", 3), sidecar_rows(answer, "survival", 2)
            if rank == 0:
                confidence, survival = c, s
        if graph.device_allocated:
            if confidence is None:
                raise EngineError(
                    f"fence {dispatch.fence}: rank 0 sent no confidence sidecar for the "
                    f"device-allocated {graph.describe()}"
                )
            if survival is not None:
                return scheduler.complete_packed_round_with_survival(
                    dispatch.fence, records, timing, confidence, survival
                )
            return scheduler.complete_packed_round(dispatch.fence, records, timing, confidence)
        if survival is not None:
            return scheduler.complete_with_survival(dispatch.fence, records, timing, survival)
        return scheduler.complete(dispatch.fence, records, timing)

    def _check_overdue(self) -> None:
        """The per-frame watchdog (and the ``completion_timeout_s`` cap) on the head
        frame; tells the liveness watcher when the head frame should end."""
        liveness = self.liveness
        if not self._inflight:
            if liveness is not None:
                liveness.expect_until(0)
            return
        head = self._inflight[0]
        if liveness is not None:
            liveness.expect_until(head.expected_end_ns)
        cfg = self.config
        now = time.monotonic_ns()
        since = max(head.sent_ns, self._head_since_ns)  # queued: from the frame before's end
        expected = head.plan.estimated_duration_ns if head.plan is not None else 0
        limit = frame_watchdog_ns(
            expected,
            cfg.frame_watchdog_multiple,
            cfg.frame_watchdog_margin_s,
            cfg.frame_watchdog_floor_s,
            known=True if head.plan is None else None,
        )
        what = "frame watchdog"
        cap = cfg.completion_timeout_s
        if cap is not None and cap * 1e9 < limit:
            since, limit, what = head.sent_ns, round(cap * 1e9), "completion_timeout_s"
        if now - since <= limit:
            return
        missing = sorted(set(range(self._world)) - set(head.answers))
        cost = f"expected {expected / 1e6:.3f} ms" if expected else "cost still unknown"
        raise EngineError(
            f"fence {head.fence}: no completion from rank(s) {missing} within "
            f"{limit / 1e9:.6g} s ({what}; {cost}); a hung rank or collective cannot be "
            "recovered in place: the deployment shuts down"
        )

    # ------------------------------------------------------------------ inspection
    @property
    def in_flight_fences(self) -> list[int]:
        with self._state_lock:
            return [d.fence for d in self._inflight]

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
            memory = getattr(scheduler, "memory_stats", None)  # direct mode has none
            if memory is not None:
                out.update(memory())
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

    # ------------------------------------------------------------------ shutdown
    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop, tell the ranks to shut down, close the channel.

        Requests still running end with finish_reason "aborted".
        """
        self._stopping.set()
        self._wake.set()
        starting = self._start_thread
        if starting is not None and starting is not threading.current_thread():
            # start() owns the channel until it returns: end its wait, let it go.
            self.abort_start("the engine is stopping")
            starting.join(timeout_s)
        thread = self._thread
        try:
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout_s)
                if thread.is_alive():
                    raise EngineError(f"the engine thread did not stop within {timeout_s:g} s")
        finally:
            self._shutdown(ABORTED)

    close = stop

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.failed_at is None:
            self.failed_at = time.monotonic()
        log.error("engine failed: %s", exc, exc_info=exc)
        self._shutdown(ERROR, exc)

    def _shutdown(self, reason: str, exc: BaseException | None = None) -> None:
        """Abort every open stream, send shutdown to the ranks, close (idempotent)."""
        with self._command_lock:
            already = self._closed
            self._closed = True
            pending = [item for kind, item in self._commands if kind == "submit"]
            self._commands.clear()
        with self._state_lock:
            streams = pending + [live.stream for live in self._by_request.values()]
            self._by_request.clear()
            self._by_handle.clear()
            self._queries.close()
        for stream in streams:
            if exc is not None and stream.error is None:
                stream.error = exc
            stream._push((), reason)
        if already:
            return
        if self.liveness is not None:  # its socket goes before the channel's context
            # The ranks hear "shutdown" on their heartbeat sockets: one still busy in
            # a long frame does not take the silence that follows for a dead coordinator.
            self.liveness.close(farewell=True)
        channel = self._channel
        if channel is not None and not channel.closed:
            try:
                channel.shutdown_ranks()
                if self.config.shutdown_grace_s:
                    time.sleep(self.config.shutdown_grace_s)  # let the message leave
            except TransportError as err:
                log.warning("could not send shutdown to the ranks: %s", err)
            channel.close()
        if self.trace is not None:
            self.trace.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
