"""``vtc``: the Virtual Token Counter fair scheduler (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024), on the :mod:`.vllm` step.

Only the admission order differs from ``vllm``: running requests go first and
the budget (8192) and slot bound are the same, but each new request comes from
the tenant with the smallest counter among tenants with waiting requests (its
earliest waiting request; ties go to the tenant whose candidate arrived first).

Counters (``counters[tenant]``) grow with the service a tenant receives,
divided by its weight (``tenant_weights``, default 1; the paper's weighted VTC):

* ``w_p = 1`` per prompt token, charged when a chunk is scheduled (the paper
  charges the input at admission; chunks are charged as they run), and within a
  step, for the next pick, including the chunks already placed in that step;
* ``w_q = 2`` per output token, charged when the completion delivers it.

Counter lift (Algorithm 2): when a request arrives from a tenant with no waiting
request, its counter is raised to the smallest counter among the tenants with
waiting requests; if no tenant is waiting, to the counter the last tenant to
leave the waiting queue had when it left.  A returning tenant thus cannot cash in
service it did not ask for while idle.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

from runtime.catalog import GraphDescriptor
from runtime.coordinator.records import CompletionRecord
from runtime.coordinator.requests import RequestHandle, RequestSpec
from scripts.scheduling_sim.baselines._base import Request, StepRow
from scripts.scheduling_sim.baselines.vllm import DEFAULT_MAX_NUM_BATCHED_TOKENS, VllmScheduler

PROMPT_WEIGHT = 1.0  # w_p
OUTPUT_WEIGHT = 2.0  # w_q


def _check_weights(weights: Mapping[int, float] | None) -> dict[int, float]:
    if weights is None:
        return {}
    if not isinstance(weights, Mapping):
        raise ValueError(f"tenant_weights must be a dict of tenant -> weight, got {weights!r}")
    out = {}
    for tenant, w in weights.items():
        if isinstance(tenant, bool) or not isinstance(tenant, int):
            raise ValueError(f"tenant_weights keys must be integer tenants, got {tenant!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"tenant_weights[{tenant}] must be a positive number, got {w!r}")
        out[tenant] = float(w)
    return out


class VtcScheduler(VllmScheduler):
    name = "vtc"
    tenant_aware = True

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        max_slots: int = 64,
        prefix_caching: bool = True,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        tenant_weights: Mapping[int, float] | None = None,
    ) -> None:
        super().__init__(
            catalog,
            max_slots=max_slots,
            max_num_batched_tokens=max_num_batched_tokens,
            prefix_caching=prefix_caching,
        )
        self.tenant_weights = _check_weights(tenant_weights)
        self.counters: dict[int, float] = {}
        self.tenant_waiting: dict[int, deque[Request]] = {}  # tenants with waiting requests
        self.last_left_counter: float | None = None

    def weight(self, tenant: int) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    def admit(self, spec: RequestSpec, tenant: int = 0) -> RequestHandle:
        if isinstance(tenant, bool) or not isinstance(tenant, int):
            raise ValueError(f"tenant must be an integer, got {tenant!r}")
        handle = self._admit(spec, tenant)
        counter = self.counters.get(tenant, 0.0)
        if tenant not in self.tenant_waiting:  # returns from idle (or is new)
            if self.tenant_waiting:
                counter = max(counter, min(self.counters[t] for t in self.tenant_waiting))
            elif self.last_left_counter is not None:
                counter = max(counter, self.last_left_counter)
            self.tenant_waiting[tenant] = deque()
        self.counters[tenant] = counter
        self.tenant_waiting[tenant].append(self.requests[handle.id])
        return handle

    def _pick(self, rows: list[StepRow]) -> Request | None:
        projected = dict(self.counters)
        taken = set()
        for row in rows:
            t = row.request.tenant
            projected[t] += PROMPT_WEIGHT * row.prompt_tokens / self.weight(t)
            taken.add(row.request.handle.id)
        best: tuple[tuple[float, int], Request] | None = None
        for tenant, queue in self.tenant_waiting.items():
            candidate = next((r for r in queue if r.handle.id not in taken), None)
            if candidate is None:
                continue
            key = (projected[tenant], candidate.handle.id)
            if best is None or key < best[0]:
                best = (key, candidate)
        return None if best is None else best[1]

    def _on_commit(self, rows: tuple[StepRow, ...]) -> None:
        for row in rows:
            r = row.request
            t = r.tenant
            self.counters[t] += PROMPT_WEIGHT * row.prompt_tokens / self.weight(t)
        for row in rows:  # after charging: a leaver's counter includes its last chunk
            r = row.request
            queue = self.tenant_waiting.get(r.tenant)
            if queue and queue[0] is r:  # admitted now (always its tenant's earliest)
                queue.popleft()
                if not queue:
                    del self.tenant_waiting[r.tenant]
                    self.last_left_counter = self.counters[r.tenant]

    def _on_complete(self, rows: tuple[StepRow, ...], records: Sequence[CompletionRecord]) -> None:
        for row, record in zip(rows, records):
            t = row.request.tenant
            self.counters[t] += OUTPUT_WEIGHT * len(record.tokens) / self.weight(t)
