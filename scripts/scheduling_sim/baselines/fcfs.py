"""``fcfs``: a vLLM-V0-style prefill-first first-come-first-served loop.

Each step prefills the oldest request with prompt left (a resident one first,
else the oldest waiting one while a slot is free), alone, in the smallest
prefill bucket that holds the rest of its prompt (chunks of the largest bucket
beyond the ladder).  Only when no prompt is left anywhere does it decode: the
oldest resident decoders, as many as the largest catalog decode batch holds
(all of them if the catalog has no decode batch).  Newer decoders beyond that
batch wait until older ones finish.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.catalog import GraphDescriptor
from scripts.scheduling_sim.baselines._base import BaselineScheduler, Request, StepRow


class FcfsScheduler(BaselineScheduler):
    name = "fcfs"

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        max_slots: int = 64,
        prefix_caching: bool = True,
    ) -> None:
        super().__init__(catalog, max_slots=max_slots, prefix_caching=prefix_caching)

    def _chunk(self, r: Request) -> int:
        largest = self.shapes.largest_prefill
        return r.remaining_prompt if largest is None else min(r.remaining_prompt, largest)

    def _step(self) -> list[StepRow]:
        for r in self.running:
            if r.prefilling:
                return [StepRow(r, self._chunk(r))]
        if self.waiting and self.free_slots > 0:
            r = next(iter(self.waiting.values()))
            return [StepRow(r, self._chunk(r))]
        decoders = self.decoders()
        largest = self.shapes.largest_decode
        if largest is not None:
            decoders = decoders[:largest]
        return [StepRow(r) for r in decoders]
