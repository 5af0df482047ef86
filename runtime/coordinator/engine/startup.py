"""Start-up: collect one catalog report per rank and check that they agree."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.engine.config import EngineStartError
from runtime.transport.channels import CoordinatorChannel
from runtime.transport.schema import CatalogReport

log = logging.getLogger("runtime.coordinator.engine")

# Fields every rank must report identically, in the order they are checked.
AGREED_FIELDS = ("vocab_size", "max_context", "page_size", "num_pages", "model_name")


@dataclass(frozen=True)
class ModelFacts:
    """What the ranks agreed on: the catalog and the model's limits."""

    descriptors: tuple[GraphDescriptor, ...]
    vocab_size: int
    max_context: int
    page_size: int
    num_pages: int
    model_name: str

    @property
    def max_decode_batch(self) -> int:
        return max(d.batch_capacity for d in self.descriptors if d.kind is GraphKind.DECODE)


def collect_reports(
    channel: CoordinatorChannel, world_size: int, timeout_s: float
) -> dict[int, CatalogReport]:
    """One CatalogReport from every rank 0..world_size-1, or EngineStartError."""
    reports: dict[int, CatalogReport] = {}
    deadline = time.monotonic() + timeout_s
    while len(reports) < world_size:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        message = channel.recv(timeout_ms=max(0, remaining_ms)) if remaining_ms > 0 else None
        if message is None:
            missing = sorted(set(range(world_size)) - set(reports))
            raise EngineStartError(
                f"no catalog report from rank(s) {missing} of {world_size} "
                f"within {timeout_s:g} s (catalog_timeout_s)"
            )
        if not isinstance(message, CatalogReport):
            log.warning("start-up: ignoring %s before the catalog", type(message).__name__)
            continue
        if message.rank in reports:
            log.warning(
                "start-up: rank %d reported its catalog twice; keeping the first", message.rank
            )
            continue
        reports[message.rank] = message
    return reports


def _names(descriptors: set[tuple], by_key: Mapping[tuple, GraphDescriptor]) -> str:
    return ", ".join(sorted(by_key[k].describe() for k in descriptors)) or "none"


def agree(reports: Mapping[int, CatalogReport]) -> ModelFacts:
    """The ranks' common facts; EngineStartError naming the first rank and field that differ."""
    if 0 not in reports:
        raise EngineStartError("no catalog report from rank 0")
    ref = reports[0]
    ref_keys = {d.key: d for d in ref.descriptors}
    for rank in sorted(reports):
        report = reports[rank]
        if rank == 0:
            continue
        keys = {d.key: d for d in report.descriptors}
        if keys.keys() != ref_keys.keys():
            only_ref = set(ref_keys) - set(keys)
            only_here = set(keys) - set(ref_keys)
            raise EngineStartError(
                f"rank {rank} disagrees with rank 0 on descriptors: "
                f"only on rank 0: {_names(only_ref, ref_keys)}; "
                f"only on rank {rank}: {_names(only_here, keys)}"
            )
        for name in AGREED_FIELDS:
            mine, theirs = getattr(report, name), getattr(ref, name)
            if mine != theirs:
                raise EngineStartError(
                    f"rank {rank} disagrees with rank 0 on {name}: {mine!r} != {theirs!r}"
                )
    kinds = {d.kind for d in ref.descriptors}
    for needed in (GraphKind.PREFILL, GraphKind.DECODE):
        if needed not in kinds:
            raise EngineStartError(
                f"descriptors: the catalog has no {needed.value} program; the engine needs "
                "prefill and decode programs"
            )
    return ModelFacts(
        descriptors=tuple(ref.descriptors),
        vocab_size=ref.vocab_size,
        max_context=ref.max_context,
        page_size=ref.page_size,
        num_pages=ref.num_pages,
        model_name=ref.model_name,
    )
