"""Shared test rig: a Scheduler with a simulated clock and monotonically increasing fences."""

from __future__ import annotations

from runtime.coordinator.config import PolicyConfig, SchedulerConfig
from runtime.coordinator.scheduler import Scheduler


class BaseRig:
    def __init__(
        self,
        catalog,
        policy: PolicyConfig | None = None,
        max_slots: int = 8,
        num_pages: int = 4096,
    ) -> None:
        config = SchedulerConfig(max_slots=max_slots, page_size=16, num_pages=num_pages)
        self.s = Scheduler(list(catalog), config, policy)
        self.fence = 0
        self.now = 0

    def tick(self, ns: int) -> None:
        self.now += ns
        self.s.advance_to(self.now)

    def plan(self):
        plan = self.s.plan()
        assert plan is not None
        return plan

    def commit(self, plan) -> int:
        self.fence += 1
        self.s.commit(plan, self.fence)
        return self.fence

    def step_until(self, predicate, limit: int = 60):
        """Execute plans until ``predicate(plan)``; return that plan uncommitted.

        Subclasses define ``complete(fence, plan)``.
        """
        for _ in range(limit):
            plan = self.plan()
            if predicate(plan):
                return plan
            self.complete(self.commit(plan), plan)
        raise AssertionError("setup did not reach the wanted plan")
