"""A rank-level scenario run at TP=1 in this process and at TP=2 in two spawned
gloo ranks, for tests that compare the two (tests/ranks)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.ranks.model.parallel import TPGroup

# scenario(checkpoint path, group, rank, world size) -> picklable results; a
# module-level function, so the spawned ranks can import it.
Scenario = Callable[[str, TPGroup, int, int], dict]


def _tp2_worker(rank: int, scenario: Scenario, store: str, path: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        result = scenario(path, TPGroup.from_process_group(), rank, 2)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def tp1_and_tp2(scenario: Scenario, path: str, work: Path) -> dict:
    """{1: TP=1 results, 2: rank 0's at TP=2, "rank1": rank 1's}; ``work`` an
    empty directory for the rendezvous file and the ranks' results."""
    tp1 = scenario(path, TPGroup.single(), 0, 1)
    torch.multiprocessing.spawn(
        _tp2_worker, args=(scenario, str(work / "store"), path, str(work)), nprocs=2, join=True
    )
    return {1: tp1, 2: torch.load(work / "rank0.pt"), "rank1": torch.load(work / "rank1.pt")}
