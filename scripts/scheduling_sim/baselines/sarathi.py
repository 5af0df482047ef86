"""``sarathi``: Sarathi-Serve stall-free batching (``sarathi/core/scheduler/sarathi_scheduler.py``).

Every step, with a token budget of 512 (``chunk_size``):

1. every running decoder, one token each, never left out (the budget is at
   least ``max_slots``, so they always fit);
2. then the running partial prefills, oldest first, each taking
   ``min(rest of prompt, budget left)``;
3. then new requests, first come first served, while fewer than ``max_slots``
   are running and budget is left, chunked to fill the budget.

Running requests keep arrival order (Sarathi's FCFS policy sorts them by
arrival).  The prefix cache is the shared model of :mod:`._base`; KV memory
(hence preemption) is not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.catalog import GraphDescriptor
from scripts.scheduling_sim.baselines._base import (
    BaselineScheduler,
    StepRow,
    check_positive_int,
)

DEFAULT_TOKEN_BUDGET = 512


class SarathiScheduler(BaselineScheduler):
    name = "sarathi"

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        max_slots: int = 64,
        prefix_caching: bool = True,
        max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET,
    ) -> None:
        super().__init__(catalog, max_slots=max_slots, prefix_caching=prefix_caching)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_num_batched_tokens < max_slots:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_slots={max_slots} for sarathi "
                f"(every running decoder rides each step), got {max_num_batched_tokens}"
            )
        self.token_budget = max_num_batched_tokens

    def _step(self) -> list[StepRow]:
        rows = [StepRow(r) for r in self.decoders()]
        left = self.token_budget - len(rows)
        for r in self.partial_prefills():
            n = min(r.remaining_prompt, left)
            if n <= 0:
                continue
            rows.append(StepRow(r, n))
            left -= n
        resident = len(self.running)
        for r in self.waiting.values():
            if resident >= self.max_slots or left <= 0:
                break
            n = min(r.remaining_prompt, left)  # less any cached prefix
            rows.append(StepRow(r, n))
            left -= n
            resident += 1
        return rows
