"""The width-one mixed shapes of a catalog by batch (runtime.coordinator.policy's
mixed candidates read it)."""

from __future__ import annotations

from runtime.catalog import GraphKind
from runtime.coordinator.cost import CostCatalog, CostEntry


class MixedLayout:
    """The width-one mixed shapes by batch, each batch's prompt ladder ascending
    (fixed with the catalog), and each ladder's signature: its capacities and
    which are measured (per estimate change)."""

    def __init__(self, catalog: CostCatalog) -> None:
        entries = [e for e in catalog.entries(GraphKind.MIXED) if e.descriptor.token_capacity == 1]
        self.by_batch: dict[int, list[tuple[int, CostEntry]]] = {}
        for index, entry in enumerate(entries):
            self.by_batch.setdefault(entry.descriptor.batch_capacity, []).append((index, entry))
        for ladder in self.by_batch.values():
            ladder.sort(key=lambda item: item[1].descriptor.prompt_capacity)
        self.batches = sorted(self.by_batch)
        self.capacities = {
            b: tuple(e.descriptor.prompt_capacity for _, e in ladder)
            for b, ladder in self.by_batch.items()
        }

    def signature(self) -> dict[int, tuple]:
        """Per batch: its capacities and which are measured (estimate > 0)."""
        return {
            b: (self.capacities[b], tuple(e.estimate_ns > 0 for _, e in ladder))
            for b, ladder in self.by_batch.items()
        }
