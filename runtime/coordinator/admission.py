"""The scheduler's state, and requests in: admission, cancellation, memory.

:class:`SchedulerAdmission` is the base of :class:`~runtime.coordinator.scheduler.Scheduler`:
it builds the state every other part reads (the cost catalog, the execution
queue, residency, the ledgers, the trace), admits and cancels requests,
retires those that will run nothing more, settles memory (pages for every
runnable request's next frame, preemption, admission of waiting requests) and
builds the selection context both planning and the preemption victim read.
:mod:`runtime.coordinator.planning` plans and commits on top of it,
:mod:`runtime.coordinator.completion` applies completions and publications.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from runtime.catalog import GraphDescriptor, GraphKind, within_speculative_envelope
from runtime.coordinator.config import PolicyConfig, SchedulerConfig
from runtime.coordinator.cost import CostCatalog
from runtime.coordinator.errors import SchedulerError
from runtime.coordinator.learning import acceptance_ledger
from runtime.coordinator.plan import TRACE_LIMIT, SelectionReason, TraceBuffer
from runtime.coordinator.policy import SelectionContext, prompt_lane_value
from runtime.coordinator.projection import CatalogView, build_context
from runtime.coordinator.queue import ExecutionQueue
from runtime.coordinator.refresh import timing_ledger
from runtime.coordinator.requests import Request, RequestHandle, RequestSpec
from runtime.coordinator.residency import Residency
from runtime.coordinator.speculation import SpeculationModel
from runtime.coordinator.vision import VisionState, WindowStore
from runtime.image_spans import ImageSpanError, windows


class SchedulerAdmission:
    """The scheduler's state; admission, cancellation, retirement and memory."""

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        config: SchedulerConfig | None = None,
        policy: PolicyConfig | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.policy = policy or PolicyConfig()
        # Estimates start indeterminate whatever the descriptors carried.
        descriptors = [replace(d, estimated_duration_ns=0) for d in catalog]
        envelope = self.config.speculative_token_capacity
        if envelope:  # load-time selection within --speculative-token-capacity
            descriptors = [d for d in descriptors if within_speculative_envelope(d, envelope)]
        self.catalog = CostCatalog(descriptors, self.policy.estimate_ttl_ns)
        self.now_ns = 0
        self._queue = ExecutionQueue()
        config = self.config
        kinds = {d.kind for d in descriptors}
        # Terminal snapshots retire finished and preempted requests when the
        # catalog has snapshot programs (else they retire at once).
        self._snapshots = GraphKind.SNAPSHOT in kinds
        self._res = Residency(
            config.max_slots,
            config.num_pages,
            config.page_size,
            prefix_caching=config.enable_prefix_caching,
            max_chunk=max((d.prompt_capacity for d in descriptors), default=1),
            max_width=max((d.token_capacity for d in descriptors), default=1),
            restore_programs=GraphKind.RESTORE in kinds and self._snapshots,
        )
        self._requests: dict[int, Request] = {}  # admitted and not yet retired
        self._resident = self._res.resident
        self._next_handle = 0
        self._next_plan = 0
        self._selection_seq = 0
        self._last_fence: int | None = None
        self._pending_corrections: list[Request] = []
        self._admitted_any = False
        self.refresh_ledger = timing_ledger()
        self.learning_ledger = acceptance_ledger()
        self.prompt_tokens_computed = 0  # prompt (and restored) tokens prefill lanes ran
        self.executions = {reason: 0 for reason in SelectionReason}
        self.execution_ns = {reason: 0 for reason in SelectionReason}
        # Trace records since the last drain_trace() (plan.TraceBuffer).
        self._trace = TraceBuffer(TRACE_LIMIT)
        self._view = CatalogView(self.catalog)
        # Acceptance estimates exist when speculative programs do (rounds.py).
        depth = max(
            (d.token_capacity - 1 for d in descriptors if d.kind is GraphKind.SPECULATIVE),
            default=0,
        )
        self.speculation = SpeculationModel(depth) if depth > 0 else None
        self._fixed_width = self.config.fixed_speculative_width
        # Image windows (runtime.coordinator.vision): with vision programs and
        # the prepared feature storage.
        storage = self.config.vision
        self._windows: WindowStore | None = None
        if storage is not None and GraphKind.VISION in kinds:
            self._windows = WindowStore(storage, config.max_slots)

    # ------------------------------------------------------------------ setup
    def configure_policy(self, policy: PolicyConfig) -> None:
        """Replace the policy; allowed only before the first admission."""
        if not isinstance(policy, PolicyConfig):
            raise TypeError("configure_policy takes a PolicyConfig")
        if self._admitted_any:
            raise SchedulerError("configure_policy must be called before admission")
        self.policy = policy
        self.catalog.ttl_ns = policy.estimate_ttl_ns

    def advance_to(self, now_ns: int) -> None:
        if now_ns < self.now_ns:
            raise SchedulerError(f"time cannot go backwards: {now_ns} < {self.now_ns}")
        self.now_ns = now_ns
        self._check_idle()

    # ------------------------------------------------------------- admission
    def admit(self, spec: RequestSpec) -> RequestHandle:
        if not isinstance(spec, RequestSpec):
            raise TypeError("admit takes a RequestSpec")
        if spec.score_prompt and not self.catalog.entries(GraphKind.SCORED_PREFILL):
            raise SchedulerError(
                "score_prompt: the catalog has no scored prefill programs "
                "(the deployment runs with --no-scored-prefill)"
            )
        needed = -(-(spec.prompt_len + spec.max_output_tokens) // self.config.page_size)
        if needed > self.config.num_pages:
            raise SchedulerError(
                f"request needs {needed} KV pages (prompt_len + max_output_tokens), "
                f"the pool has {self.config.num_pages}"
            )
        vision = self._vision_state(spec) if spec.images else None
        handle = RequestHandle(self._next_handle)
        self._next_handle += 1
        request = Request(handle, spec, self.now_ns)
        request.vision = vision
        if self.speculation is not None:
            request.speculation = self.speculation.new_request()
        self._requests[handle.id] = request
        self._res.enqueue(request)
        self._admitted_any = True
        self._settle_memory()
        return handle

    def _vision_state(self, spec: RequestSpec) -> VisionState:
        """A request's windows, or SchedulerError when it cannot run: no vision
        programs or storage, an image larger than a window, several windows
        without snapshot and restore programs."""
        store = self._windows
        if store is None:
            raise SchedulerError(
                "images: the catalog has no vision programs or no image-feature storage"
            )
        rows = store.storage.window_rows
        try:
            count = len(windows(spec.images, rows))
        except ImageSpanError as exc:
            raise SchedulerError(str(exc)) from None
        pkind = GraphKind.SCORED_PREFILL if spec.score_prompt else GraphKind.PREFILL
        chunk = max((e.descriptor.prompt_capacity for e in self.catalog.entries(pkind)), default=0)
        longest = max(span.length for span in spec.images)
        if longest > chunk:
            raise SchedulerError(
                f"images: an image of {longest} feature rows exceeds the largest "
                f"{pkind.value} chunk ({chunk} tokens); image spans are atomic"
            )
        kinds = (GraphKind.SNAPSHOT, GraphKind.RESTORE)
        if count > 1 and not all(self.catalog.entries(k) for k in kinds):
            raise SchedulerError(
                f"images span {count} windows of {rows} feature rows: window transitions "
                "need snapshot and restore programs"
            )
        return VisionState(spec.images, rows)

    def cancel(self, handle: RequestHandle) -> bool:
        """Stop selecting ``handle`` now; resources stay owned through its last fence."""
        request = self._requests.get(handle.id)
        if request is None or request.cancelled or request.finished:
            return False
        request.cancelled = True
        if not request.resident:
            self._res.dequeue(request)
            del self._requests[handle.id]
        else:
            self._retire_if_done(request)
        self._settle_memory()
        self._check_idle()
        return True

    def _retire_if_done(self, request: Request, snapshot: bool = False) -> None:
        """Release a resident request that will run nothing more: finished,
        cancelled or preempted, with its last fence completed.  With snapshot
        programs a finished or preempted request first waits for its terminal
        snapshot (``snapshot``: it just completed); cancellation never waits."""
        if request.runnable or request.inflight_fences or not request.resident:
            return
        if request.window_waiting:
            return  # between two image windows: its snapshot and restore rows run first
        if not request.cancelled and not snapshot:
            if request.restore_pending:
                return  # resumed: its restore row is still to run
            if self._snapshots and not self._res.unstarted(request):
                return  # terminal: awaits its snapshot (state_ops); an unstarted
                # generation has nothing on the ranks to snapshot
        self._res.retire(request)
        if request.vision is not None and self._windows is not None:
            self._windows.release(request.vision)  # its window slot and snapshot row
            request.vision.reset(0)  # (a resumed request's windows start again)
        if not request.preempted or request.cancelled or request.finished:
            self._requests.pop(request.handle.id, None)

    def _settle_memory(self) -> None:
        """Pages for every runnable request's next frame; preemption when one
        lacks a page (module docstring of runtime.coordinator.residency); then
        admission, unless a request still waits for pages."""
        res = self._res
        res.refresh_unstarted()
        for _ in range(len(res.resident) + 1):
            lacking = res.provision()
            if not lacking:
                break
            if any(r.preempted or r.finished for r in res.resident.values()):
                return  # a victim's (or a terminal request's) pages are still to come back
            victim = self._victim()
            if victim is None:
                return
            if lacking == [victim] and victim.vision is not None:
                return  # alone short of its image span's pages: freeing them serves no one
            res.preempt(victim)
            victim.terminal_since_ns = self.now_ns  # its retirement's age starts now
            if victim.inflight_fences:
                return  # its pages come back when its last fence completes
            self._retire_if_done(victim)
        else:
            return
        resident = res.admit_waiting()
        for r in resident:
            if r.vision is not None and self._windows is not None:
                r.vision.reset(r.consumed_prompt)  # its windows from what it attached
                if r.vision.windows_left > 1:
                    self._windows.reserve_row(r.vision)  # (else at its first boundary)
        if resident:
            res.provision()

    def _victim(self) -> Request | None:
        """The resident request with the lowest lane value per held page (ties:
        the most recently admitted), among those that name their tokens (so they
        can resume).  A lane's value is what selection would give its next frame
        now; a request selection cannot serve now (waiting on feedback) ranks
        after every servable one."""
        candidates = [
            r for r in self._resident.values() if r.runnable and r.pages and r.spec.prompt_tokens
        ]
        if not candidates:
            return None
        values: dict[int, float] = {}
        ctx = self._context()
        if ctx is not None:
            for view in ctx.decode:
                values[view.request.handle.id] = view.decode_value
            for view in (*ctx.prefill, *ctx.scored):
                tokens = min(view.available, self._res.max_chunk)
                values[view.request.handle.id] = prompt_lane_value(view, tokens, 0.0)
        return min(
            candidates,
            key=lambda r: (
                r.handle.id not in values,
                values.get(r.handle.id, 0.0) / len(r.pages),
                -r.admitted_seq,
            ),
        )

    def _check_idle(self) -> None:
        if self._queue.empty and not any(
            r.runnable or self._awaits_state_program(r) for r in self._resident.values()
        ):
            self.refresh_ledger.idle()
            self.learning_ledger.idle()

    def _awaits_state_program(self, r: Request) -> bool:
        """A resident request whose next step is a state program's row: its
        restore, or its terminal snapshot."""
        if not r.resident or r.cancelled or r.inflight_fences:
            return False
        if r.restore_pending or r.window_waiting:
            return True
        return self._snapshots and (r.finished or r.preempted) and not self._res.unstarted(r)

    # ----------------------------------------------------------- selection
    def _context(self) -> SelectionContext | None:
        runnable: list[Request] = []
        terminal: list[Request] = []
        restoring: list[Request] = []
        windowing: list[Request] = []
        for r in self._resident.values():
            if r.vision is not None and not r.inflight_fences:
                r.vision.sync(r.consumed_prompt)  # (a prefix attached late, a text chunk)
            if r.runnable:
                runnable.append(r)
            elif r.window_waiting:
                if not r.inflight_fences:
                    windowing.append(r)
            elif self._awaits_state_program(r):
                (restoring if r.restore_pending else terminal).append(r)
        terminal.sort(key=lambda r: (r.terminal_since_ns or 0, r.handle.id))
        return build_context(
            self.now_ns,
            runnable,
            self._queue,
            self.policy,
            self.catalog,
            self._view,
            self.config.page_size,
            terminal,
            restoring,
            windowing,
            self._windows,
        )
