"""``sglang``: the SGLang default scheduler (``python/sglang/srt/managers/scheduler.py``,
``get_new_batch_prefill``; ``schedule_policy.py``, ``PrefillAdder``).

Prefill first: whenever a chunked request is unfinished, or a request waits and
a slot (``max_running_requests`` = ``max_slots``) is free, the step is a new
prefill batch:

* budget: ``chunked_prefill_size`` tokens (8192); with ``enable_mixed_chunk``
  it shrinks by the number of running decoders, which then ride along, one
  decode token each (``PrefillAdder(mixed_with_decode_tokens=running_bs)``,
  ``ScheduleBatch.mix_with_running``);
* the chunked request's continuation comes first (``add_chunked_req``);
* then waiting requests, first come first served, each whole while its prompt
  fits the budget left; the first that does not fit is truncated to the budget
  left and becomes the (single) chunked request, which ends the batch; an
  exhausted budget ends it too (``AddReqResult.OTHER``).

Otherwise (no prefill batch) the step decodes every running request.  Without
mixed chunk, decoders stall while a chunked prompt is continued.  Admission is
FCFS: the prefix cache is the shared model of :mod:`._base` (RadixAttention's
reuse at page granularity), but the ``lpm`` policy's reordering of the waiting
queue by cached prefix length is not modelled (SGLang also falls back to FCFS
beyond 128 waiting requests), so the baselines differ in their steps only; KV
memory, retraction, ``max_prefill_tokens`` (16384, above the 8192 chunk) and the
``batch_is_full`` latch are not modelled (free slots are counted each step).
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.catalog import GraphDescriptor
from scripts.scheduling_sim.baselines._base import (
    BaselineScheduler,
    StepRow,
    check_positive_int,
)

DEFAULT_CHUNKED_PREFILL_SIZE = 8192


class SglangScheduler(BaselineScheduler):
    name = "sglang"

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        max_slots: int = 64,
        prefix_caching: bool = True,
        chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE,
        enable_mixed_chunk: bool = False,
    ) -> None:
        super().__init__(catalog, max_slots=max_slots, prefix_caching=prefix_caching)
        self.chunked_prefill_size = check_positive_int(
            "max_num_batched_tokens", chunked_prefill_size
        )
        if not isinstance(enable_mixed_chunk, bool):
            raise ValueError(f"enable_mixed_chunk must be a bool, got {enable_mixed_chunk!r}")
        self.enable_mixed_chunk = enable_mixed_chunk

    def _prefill_batch(self, decoders: int) -> list[StepRow]:
        left = self.chunked_prefill_size - (decoders if self.enable_mixed_chunk else 0)
        rows: list[StepRow] = []
        for r in self.partial_prefills():  # the chunked request (at most one)
            if left <= 0:
                break
            n = min(r.remaining_prompt, left)
            rows.append(StepRow(r, n))
            left -= n
        free = self.free_slots
        for r in self.waiting.values():
            if free <= 0 or left <= 0:
                break
            n = min(r.remaining_prompt, left)  # less any cached prefix
            rows.append(StepRow(r, n))
            left -= n
            free -= 1
            if n < r.remaining_prompt:
                break  # the new chunked request ends the batch
        return rows

    def _step(self) -> list[StepRow]:
        decoders = self.decoders()
        if self.partial_prefills() or (self.waiting and self.free_slots > 0):
            rows = self._prefill_batch(len(decoders))
            if rows:
                if self.enable_mixed_chunk:
                    rows += [StepRow(r) for r in decoders]
                return rows
        return [StepRow(r) for r in decoders]
