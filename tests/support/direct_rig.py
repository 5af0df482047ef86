"""A DirectScheduler on a simulated clock, with fences, completions and a cost table."""

from __future__ import annotations

from collections.abc import Callable

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.plan import ScheduledPlan
from runtime.coordinator.records import CompletionRecord, ExecutionTiming, GeneratedToken
from runtime.coordinator.requests import RequestHandle, RequestSpec
from runtime.direct import DirectConfig, DirectScheduler

MS = 1_000_000
S = 1_000 * MS
TOKEN = 7


def prefill(capacity: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=capacity)


def decode(batch: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.DECODE, batch)


def catalog(prompts=(64, 256), batches=(1, 2, 4, 8)) -> list[GraphDescriptor]:
    return [prefill(c) for c in prompts] + [decode(b) for b in batches]


def records_for(plan: ScheduledPlan, token: int = TOKEN, stop=()) -> list[CompletionRecord]:
    """One record per lane, each with its ``max_tokens`` tokens; handles in ``stop`` say "stop"."""
    return [
        CompletionRecord(
            lane.slot,
            lane.generation,
            (token,) * lane.max_tokens,
            "stop" if lane.handle in stop and lane.max_tokens else None,
        )
        for lane in plan.lanes
    ]


def timing(ns: int, waits: tuple[int, ...] = ()) -> ExecutionTiming:
    return ExecutionTiming((ns,), host_wall_ns=ns, rank_launch_wait_ns=waits)


class Rig:
    """Plans, commits and completes frames against ``cost(graph) -> ns``."""

    def __init__(
        self,
        descriptors=None,
        cost: Callable[[GraphDescriptor], int] | None = None,
        max_slots: int = 8,
        num_pages: int = 4096,
        direct: DirectConfig | None = None,
    ) -> None:
        config = SchedulerConfig(max_slots=max_slots, page_size=16, num_pages=num_pages)
        self.s = DirectScheduler(descriptors or catalog(), config, direct)
        self.cost = cost or (lambda g: (1 + g.batch_capacity + g.prompt_capacity // 64) * MS)
        self.now = 0
        self.fence = 0
        self.committed: list[ScheduledPlan] = []

    def tick(self, ns: int) -> None:
        self.now += ns
        self.s.advance_to(self.now)

    def admit(self, prompt_len: int, max_output_tokens: int, **kw) -> RequestHandle:
        return self.s.admit(RequestSpec(prompt_len, max_output_tokens, **kw))

    def commit(self, plan: ScheduledPlan) -> int:
        self.fence += 1
        self.s.commit(plan, self.fence)
        self.committed.append(plan)
        return self.fence

    def complete(self, fence: int, plan: ScheduledPlan, stop=()) -> list[GeneratedToken]:
        ns = self.cost(plan.graph)
        self.tick(ns)
        return self.s.complete(fence, records_for(plan, stop=stop), timing(ns))

    def step(self) -> ScheduledPlan | None:
        """Plan, commit and complete one frame; None when nothing is planned."""
        plan = self.s.plan()
        if plan is None:
            return None
        self.complete(self.commit(plan), plan)
        return plan

    def run(self, limit: int = 1000) -> list[ScheduledPlan]:
        done = []
        for _ in range(limit):
            plan = self.step()
            if plan is None:
                return done
            done.append(plan)
        raise AssertionError("the workload did not finish")

    def measure_all(self) -> None:
        """Give every program a first sample of its cost."""
        for d in self.s.catalog.descriptors:
            self.s.catalog.observe(d, self.cost(d), self.now)
