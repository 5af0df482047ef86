"""The selection tests' driver: real frames against a cost table (tests/coordinator).

:class:`Driver` runs frames (plan -> commit -> advance_to -> complete ->
published_output) against a cost function, so every estimate the scheduler
uses is a median of replay intervals it was told; :func:`spec_objective` is
the spec's objective written independently of ``runtime.coordinator.utility``;
the random costs, policies and arrivals feed the exhaustive cohort tests.
"""

from __future__ import annotations

import random

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PolicyConfig, SchedulerConfig
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from scripts.scheduling_sim.catalogs import PROFILES

MS = 1_000_000
S = 1_000 * MS
TTL_NS = 30 * S
PROFILE = PROFILES["llama1b-h100"]
TOKEN = 11


def prefill(capacity: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=capacity)


def decode(batch: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.DECODE, batch)


def table_cost(ms: dict[GraphDescriptor, float]):
    """A cost function from a {descriptor: milliseconds} table."""
    ns = {d.key: round(t * MS) for d, t in ms.items()}
    return lambda desc: ns[desc.key]


class Driver:
    """Runs real frames, one at a time, against a cost function.

    Each frame is planned, committed, executed for ``cost(graph)`` simulated
    nanoseconds, completed with that device interval, and every generated burst
    is published at completion time.
    """

    def __init__(self, descriptors, cost=PROFILE.duration_ns, policy=None, max_slots=16):
        config = SchedulerConfig(max_slots=max_slots, page_size=16, num_pages=1 << 16)
        self.sched = Scheduler(list(descriptors), config, policy)
        self.cost = cost
        self.now = 0
        self.fence = 0
        self.committed = []  # every committed plan, in order

    def advance(self, ns: int) -> None:
        self.now += ns
        self.sched.advance_to(self.now)

    def plan(self):
        plan = self.sched.plan()
        assert plan is not None, "the scheduler had nothing to submit"
        return plan

    def commit(self, plan) -> int:
        self.fence += 1
        self.sched.commit(plan, self.fence)
        self.committed.append(plan)
        return self.fence

    def complete(self, fence: int, plan, cost_ns: int | None = None):
        cost = self.cost(plan.graph) if cost_ns is None else cost_ns
        self.advance(cost)
        records = [
            CompletionRecord(lane.slot, lane.generation, (TOKEN,) * lane.max_tokens)
            for lane in plan.lanes
        ]
        out = self.sched.complete(fence, records, ExecutionTiming((cost,), host_wall_ns=cost))
        for g in out:
            self.sched.published_output(g.handle, g.fence)
        return out

    def run(self, plan, cost_ns: int | None = None):
        return self.complete(self.commit(plan), plan, cost_ns)

    def step(self):
        plan = self.plan()
        self.run(plan)
        return plan

    def admit(self, prompt_len: int, max_output: int = 10_000, **kw):
        return self.sched.admit(RequestSpec(prompt_len, max_output, **kw))

    def measure(self, limit: int = 400) -> None:
        """Observe every graph of the catalog through real frames, then retire the
        warm-up requests.

        A cold lone request tries its largest useful unmeasured prefill, so a
        request whose prompt equals a capacity discovers that capacity; enough
        long decoders to overflow the second-largest batch make every decode
        batch a candidate, and indeterminate candidates win until measured.
        """
        descs = self.sched.catalog.descriptors
        caps = sorted(d.prompt_capacity for d in descs if d.kind is GraphKind.PREFILL)
        batches = sorted(d.batch_capacity for d in descs if d.kind is GraphKind.DECODE)
        handles = [self.admit(c, 1) for c in caps]
        if batches:
            streams = batches[-2] + 1 if len(batches) > 1 else 1
            handles += [self.admit(caps[0], 10_000) for _ in range(streams)]
        for _ in range(limit):
            if all(ns > 0 for ns in self.sched.catalog.estimates().values()):
                break
            self.step()
        else:
            raise AssertionError(
                f"warm-up left graphs unmeasured: {self.sched.catalog.estimates()}"
            )
        for h in handles:
            self.sched.cancel(h)
        assert self.sched.running == 0 and self.sched.in_flight == 0
        self.committed.clear()


def runnable(sched: Scheduler):
    return [r for r in sched.active_requests() if r.runnable]


def next_hard_end(request) -> int:
    """Prompt tokens a chunk may consume from the committed position (spec: hard
    boundaries and the prompt end restrict logical work)."""
    pos = request.consumed_prompt
    ends = [b for b in request.spec.boundaries if b > pos] + [request.spec.prompt_len]
    return min(ends) - pos


def spec_objective(t_ms, priced, served_age, active_c):
    """(sum priced service + sum_served c*sigma*(A+T)) / T - T/2 * sum_active c."""
    return (priced + served_age) / t_ms - t_ms / 2 * active_c


ENUM_BUCKETS = (64, 128, 256)
ENUM_BATCHES = (1, 2, 4, 8)


def random_costs(rng: random.Random) -> dict[GraphDescriptor, float]:
    """Plausible but arbitrary costs (ms); decode costs need not be monotone."""
    costs = {}
    t = rng.uniform(1.0, 3.0)
    for c in ENUM_BUCKETS:
        costs[prefill(c)] = t
        t += rng.uniform(0.2, 4.0)
    t = rng.uniform(1.0, 5.0)
    for b in ENUM_BATCHES:
        costs[decode(b)] = t
        t = max(0.5, t + rng.uniform(-0.5, 3.0))
    return {d: round(ms * MS) / MS for d, ms in costs.items()}


def random_policy(rng: random.Random) -> PolicyConfig:
    return PolicyConfig(
        decode_age_price=rng.choice([0.0, 0.01, 0.1, 1.0]),
        delivery_fairness=rng.choice([0.0, 4.0, 40.0]),
        token_fairness=rng.choice([4.0, 16.0]),
    )


def admit_due(drv: Driver, rng: random.Random, arrivals: list[int], frame: int) -> None:
    """Admit the requests due by ``frame`` (random prompts, some with a hard
    boundary, random output limits); sometimes idle so output ages diverge."""
    while arrivals and arrivals[0] <= frame:
        arrivals.pop(0)
        prompt = rng.randint(20, 700)
        kw = {}
        if rng.random() < 0.3 and prompt > 1:
            kw["boundaries"] = (rng.randint(1, prompt - 1),)
        drv.admit(prompt, rng.randint(2, 40), **kw)
    if rng.random() < 0.3:
        drv.advance(rng.randint(1, 40 * MS))
