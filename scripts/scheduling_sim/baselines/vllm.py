"""``vllm``: the vLLM v1 default scheduler (``vllm/v1/core/sched/scheduler.py``).

One step spends a token budget, ``max_num_batched_tokens`` (8192, the default
for large GPUs):

1. RUNNING requests, in the order they were admitted, including partly
   prefilled ones: each takes ``min(tokens it still needs, budget)``, i.e. the
   rest of its prompt or one decode token, until the budget is spent.  Running
   requests the budget no longer reaches skip this step.
2. WAITING requests, first come first served, while budget is left and fewer
   than ``max_slots`` requests (vLLM's ``max_num_seqs``) are running: each takes
   ``min(prompt, budget)``, so the last one admitted is chunked and continues
   first among the running prefills of the next step.

Chunked prefill is always on (vLLM v1); ``long_prefill_token_threshold`` is 0;
automatic prefix caching is the shared model of :mod:`._base`; KV memory (hence
preemption) is not modelled: the slot bound is the only admission limit besides
the budget.  :meth:`_pick` is the
admission order; :mod:`.vtc` replaces only that.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.catalog import GraphDescriptor
from scripts.scheduling_sim.baselines._base import (
    BaselineScheduler,
    Request,
    StepRow,
    check_positive_int,
)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


class VllmScheduler(BaselineScheduler):
    name = "vllm"

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        max_slots: int = 64,
        prefix_caching: bool = True,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> None:
        super().__init__(catalog, max_slots=max_slots, prefix_caching=prefix_caching)
        self.max_num_batched_tokens = check_positive_int(
            "max_num_batched_tokens", max_num_batched_tokens
        )

    def _pick(self, rows: list[StepRow]) -> Request | None:
        """The next waiting request to admit into this step (FCFS)."""
        taken = {row.request.handle.id for row in rows}
        for r in self.waiting.values():
            if r.handle.id not in taken:
                return r
        return None

    def _step(self) -> list[StepRow]:
        budget = self.max_num_batched_tokens
        rows: list[StepRow] = []
        for r in self.running:
            if budget <= 0:
                break
            if r.prefilling:
                n = min(r.remaining_prompt, budget)
                rows.append(StepRow(r, n))
            else:
                n = 1
                rows.append(StepRow(r))
            budget -= n
        resident = len(self.running)
        while budget > 0 and resident < self.max_slots:
            r = self._pick(rows)
            if r is None:
                break
            n = min(r.remaining_prompt, budget)  # less any cached prefix
            rows.append(StepRow(r, n))
            budget -= n
            resident += 1
        return rows
