"""The engine's life: start-up, failure and shutdown.

:class:`EngineLifecycle` is the base of :class:`~runtime.coordinator.engine.core.Engine`:
it holds the state every part of the engine reads, binds the coordinator
channel, starts (heartbeats, handshake, catalogs, the scheduler:
:func:`make_scheduler`), turns a lost rank or an outside failure into the
engine's failure, and shuts down (every open stream ends, the ranks are told
to stop, the channel closes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TypeVar

from runtime.catalog import describe_counts
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.engine.commands import (
    Command,
    FailEngine,
    Probe,
    RankLost,
    SubmitRequest,
)
from runtime.coordinator.engine.config import EngineConfig, EngineError, EngineStartError
from runtime.coordinator.engine.frames import Dispatch, Live
from runtime.coordinator.engine.ranks import RankMetrics, RankQueries
from runtime.coordinator.engine.startup import ModelFacts, agree, collect_reports
from runtime.coordinator.engine.stats import EngineStats
from runtime.coordinator.engine.stream import ABORTED, ERROR
from runtime.coordinator.engine.trace import FrameTrace
from runtime.coordinator.interface import EngineScheduler
from runtime.coordinator.scheduler import Scheduler
from runtime.direct.scheduler import DirectScheduler
from runtime.image_spans import VisionStorage
from runtime.trace.writer import TraceOptions
from runtime.transport.channels import ChannelEndpoints, HandshakeTimeout, TransportError
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.frame_lane import MAX_SLOTS
from runtime.transport.liveness import CoordinatorLiveness, LivenessConfig
from runtime.transport.security import ClientKeys, DeploymentKeys, per_run_keys

log = logging.getLogger("runtime.coordinator.engine")

_Self = TypeVar("_Self", bound="EngineLifecycle")


def vision_storage(facts: ModelFacts) -> VisionStorage | None:
    """The scheduler's view of the ranks' image-feature store (None: text-only).
    Snapshot rows: one per request slot (0); a window snapshot keeps the request's
    KV pages and drops its slot rows, which the window restore rebuilds from the
    consumed prompt (docs/vision.md, "Window transitions on the ranks")."""
    if not facts.vision_windows or not facts.window_rows:
        return None
    return VisionStorage(facts.vision_windows, facts.window_rows)


def make_scheduler(cfg: EngineConfig, facts: ModelFacts, max_slots: int) -> EngineScheduler:
    """The scheduler for the model the ranks reported: the coordinator's, or with
    ``cfg.direct`` (``flare run --direct``) the diagnostic one of runtime/direct."""
    scheduler_config = SchedulerConfig(
        max_slots,
        facts.page_size,
        facts.num_pages,
        fixed_speculative_width=cfg.fixed_speculative_width,
        proposer=cfg.proposer,
        speculative_token_capacity=cfg.speculative_token_capacity,
        enable_prefix_caching=cfg.enable_prefix_caching,
        debug_page_accounting=cfg.debug_page_accounting,
        vision=vision_storage(facts),
    )
    if cfg.direct:
        return DirectScheduler(facts.descriptors, scheduler_config)
    scheduler = Scheduler(facts.descriptors, scheduler_config, cfg.policy)
    model = scheduler.speculation
    if cfg.acceptance_prior and model is not None:  # an offline measurement
        model.preseed(cfg.proposer, cfg.acceptance_prior[: model.depth_cap])
    return scheduler


class EngineLifecycle:
    """The engine's state, start-up, failure and shutdown (see the module docstring)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config if config is not None else EngineConfig()
        if not isinstance(self.config, EngineConfig):
            raise TypeError("Engine takes an EngineConfig")
        self.stats = EngineStats(self.config.frame_stats)
        self.scheduler: EngineScheduler | None = None
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
        self._commands: deque[Command] = deque()
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
        self._probes: deque[Probe] = deque()
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
            scheduler = make_scheduler(cfg, facts, max_slots)
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
            self._commands.append(RankLost(rank, reason))
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
            self._commands.append(FailEngine(exc))
        self._wake.set()

    def _check_open(self) -> None:
        if self.error is not None:
            raise EngineError(f"the engine failed: {self.error}")
        if self._closed or self._stopping.is_set():
            raise EngineError("the engine is stopped")

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
            pending = [c.stream for c in self._commands if isinstance(c, SubmitRequest)]
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

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
