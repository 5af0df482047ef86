"""A plain first-come-first-served scheduler, for comparison in the simulator.

It speaks the production scheduler's API (admit, plan, commit, complete,
published_output, advance_to, drain_trace) over the same catalog, but decides
as a vLLM-V0-style FCFS loop does: prefill waiting requests whole, in arrival
order, before any decode; then decode the oldest decoders in the largest batch
the catalog offers.  One frame at a time.
"""

from __future__ import annotations

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator import (
    GeneratedToken,
    LanePhase,
    LaneWork,
    RequestHandle,
    RequestSpec,
    ScheduledPlan,
    SelectionReason,
)


class _Req:
    def __init__(self, handle: RequestHandle, spec: RequestSpec) -> None:
        self.handle = handle
        self.spec = spec
        self.consumed = 0
        self.output = 0

    @property
    def done(self) -> bool:
        return self.output >= self.spec.max_output_tokens


class FcfsScheduler:
    def __init__(self, catalog: list[GraphDescriptor]) -> None:
        self.prefill = sorted(
            (d for d in catalog if d.kind is GraphKind.PREFILL), key=lambda d: d.prompt_capacity
        )
        self.decode = sorted(
            (d for d in catalog if d.kind is GraphKind.DECODE), key=lambda d: d.batch_capacity
        )
        self.requests: list[_Req] = []
        self.inflight: tuple[int, ScheduledPlan] | None = None
        self.now_ns = 0
        self._plans = 0

    def advance_to(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def admit(self, spec: RequestSpec) -> RequestHandle:
        handle = RequestHandle(len(self.requests))
        self.requests.append(_Req(handle, spec))
        return handle

    def _lane(self, r: _Req, phase: LanePhase, tokens: int, finishes: bool) -> LaneWork:
        return LaneWork(
            r.handle,
            r.handle.id,
            1,
            phase,
            r.consumed,
            tokens,
            r.output,
            1 if (finishes or phase is LanePhase.DECODE) else 0,
            1.0,
            1.0,
            0.0,
        )

    def _plan(self, graph: GraphDescriptor, lanes: list[LaneWork]) -> ScheduledPlan:
        self._plans += 1
        return ScheduledPlan(
            self._plans,
            graph,
            tuple(lanes),
            0,
            SelectionReason.ORDINARY,
            True,
            self.now_ns,
            self.now_ns,
            0.0,
            0.0,
            0.0,
            0,
        )

    def plan(self) -> ScheduledPlan | None:
        if self.inflight is not None:
            return None
        live = [r for r in self.requests if not r.done]
        for r in live:
            remaining = r.spec.prompt_len - r.consumed
            if remaining > 0:
                fitting = [d for d in self.prefill if d.prompt_capacity >= remaining]
                graph = fitting[0] if fitting else self.prefill[-1]
                tokens = min(remaining, graph.prompt_capacity)
                finishes = tokens == remaining
                return self._plan(graph, [self._lane(r, LanePhase.PREFILL, tokens, finishes)])
        decoders = live[: self.decode[-1].batch_capacity]
        if not decoders:
            return None
        graph = next(d for d in self.decode if d.batch_capacity >= len(decoders))
        return self._plan(graph, [self._lane(r, LanePhase.DECODE, 0, False) for r in decoders])

    def commit(self, plan: ScheduledPlan, fence: int) -> None:
        self.inflight = (fence, plan)

    def complete(self, fence, records, timing) -> list[GeneratedToken]:
        assert self.inflight is not None and self.inflight[0] == fence
        plan = self.inflight[1]
        self.inflight = None
        out = []
        for lane, record in zip(plan.lanes, records):
            r = self.requests[lane.handle.id]
            r.consumed += lane.prompt_tokens
            if record.tokens:
                first = r.output == 0
                r.output += len(record.tokens)
                out.append(
                    GeneratedToken(
                        r.handle,
                        fence,
                        tuple(record.tokens),
                        first,
                        r.done,
                        "length" if r.done else None,
                    )
                )
        return out

    def published_output(self, handle, fence, at_ns=None) -> bool:
        return True

    def drain_trace(self) -> list:
        return []
