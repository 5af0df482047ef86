"""Prefix allocation: the target rows each lane of a device-allocated (prefix-limit)
speculative program verifies, from the joint prefix probabilities.

joint (R, D) float32 holds lane i's joint probability of its first d proposals at
column d - 1; ceilings (R,) and slots (R,) are the lanes' row ceilings and request
slots; ``rows`` is the program's target capacity P.  Every lane gets its pending
row; then, one row at a time, the lane whose next prefix (of q proposals when it
holds q rows: ``joint[i, q - 1]``) is most probable grows by one; ties go to the
shorter prefix, then the lower slot, then the earlier lane; a lane never exceeds
min(ceiling, D + 1), and a zero-probability prefix (a certain rejection) is never
admitted.  It stops when P rows are used or no lane can grow.  The
output (R,) int64 holds the query lengths.  The reference is
``prefix_allocation_reference`` in kernels/reference/prefix_allocation.py, and this must equal
``runtime.coordinator.rounds.device_allocation``, which the coordinator uses to
recompute the allocation from the confidence sidecar.

One program does the whole problem (R <= 64, D <= 16): the (R, D) tile stays in
registers and each admission is a few reductions over the R frontiers.  The grid
(1,) depends on nothing, so the launch can be captured in a graph: a program
with fewer lanes than its capacity passes ceiling 0 for the padding lanes,
which take no row and do not count against P, so ``rows`` stays P.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton.checks import INTS, check_device

MAX_LANES = 64
MAX_DEPTH = 16


@triton.jit
def _prefix_allocation_kernel(
    joint_ptr,
    ceil_ptr,
    slot_ptr,
    out_ptr,
    rows,
    stride_jr,
    stride_jd,
    LANES: tl.constexpr,
    DEPTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    lane = tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    col = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    live = lane < LANES  # (BLOCK_R,)
    ok = live[:, None] & (col < DEPTH)[None, :]  # (BLOCK_R, BLOCK_D)
    tile = tl.load(
        joint_ptr + lane[:, None] * stride_jr + col[None, :] * stride_jd, mask=ok, other=0.0
    )  # (BLOCK_R, BLOCK_D) float32
    # A ceiling of 0 (and the pad lanes') is no lane: no row, not counted.
    cap = tl.load(ceil_ptr + lane, mask=live, other=0).to(tl.int64)  # (BLOCK_R,)
    cap = tl.minimum(cap, DEPTH + 1).to(tl.int32)  # never past the last prefix
    slot = tl.load(slot_ptr + lane, mask=live, other=0).to(tl.int64)  # (BLOCK_R,)
    present = cap > 0
    queries = present.to(tl.int32)  # (BLOCK_R,) the pending rows
    count = tl.sum(queries, axis=0)
    # Each lane grows by at most DEPTH rows.
    extra = tl.minimum(tl.maximum(rows - count, 0), count * DEPTH)
    for _ in range(0, extra):
        at = col[None, :] == (queries - 1)[:, None]  # (BLOCK_R, BLOCK_D)
        p = tl.sum(tl.where(at, tile, 0.0), axis=1)  # (BLOCK_R,) frontier probabilities
        grow = (queries < cap) & (p > 0.0)  # (BLOCK_R,) an admissible, possible frontier
        p = tl.where(grow, p, -float("inf"))
        best = grow & (p == tl.max(p, axis=0))  # the highest probability ...
        shortest = tl.min(tl.where(best, queries, DEPTH + 2), axis=0)
        best = best & (queries == shortest)  # ... the shortest prefix
        lowest = tl.min(tl.where(best, slot, 9223372036854775807), axis=0)
        best = best & (slot == lowest)  # ... the lowest slot
        winner = tl.min(tl.where(best, lane, BLOCK_R), axis=0)  # ... the earliest lane
        # No lane can grow: winner is BLOCK_R and nothing changes from here on.
        queries += (lane == winner).to(tl.int32)
    tl.store(out_ptr + lane, queries.to(tl.int64), mask=live)


def _check(joint: Tensor, ceilings: Tensor, slots: Tensor, rows: int) -> None:
    """Raise ValueError naming the first bad argument."""
    if joint.dim() != 2:
        raise ValueError(f"joint: expected (R, D), got shape {tuple(joint.shape)}")
    lanes, depth = joint.shape
    if joint.dtype != torch.float32:
        raise ValueError(f"joint: dtype {joint.dtype} is not float32")
    if lanes > MAX_LANES:
        raise ValueError(f"joint: {lanes} lanes, at most {MAX_LANES}")
    if depth > MAX_DEPTH:
        raise ValueError(f"joint: depth {depth}, at most {MAX_DEPTH}")
    for name, t in (("ceilings", ceilings), ("slots", slots)):
        if t.shape != (lanes,):
            raise ValueError(f"{name}: expected ({lanes},), got shape {tuple(t.shape)}")
        if t.dtype not in INTS:
            raise ValueError(f"{name}: dtype {t.dtype} is not int32/int64")
        if t.device != joint.device:
            raise ValueError(f"{name}: on {t.device}, joint on {joint.device}")
    if isinstance(rows, bool) or not isinstance(rows, int):
        raise ValueError(f"rows: expected an int, got {type(rows).__name__}")
    if not 0 <= rows < 2**31:
        raise ValueError(f"rows: {rows} is out of range")
    check_device("joint", joint, _prefix_allocation_kernel)


def prefix_allocation(joint: Tensor, ceilings: Tensor, slots: Tensor, rows: int) -> Tensor:
    """Query lengths (R,) int64 for joint (R, D) float32 prefix probabilities,
    ceilings (R,) and request slots (R,) int32/int64 within ``rows`` target rows
    (a pending row for every lane with a ceiling, even when rows < R; a lane
    whose ceiling is 0 is absent: 0 rows).  Same contract as
    ``kernels.reference.prefix_allocation.prefix_allocation_reference``.
    """
    _check(joint, ceilings, slots, rows)
    lanes, depth = joint.shape
    out = torch.ones(lanes, dtype=torch.int64, device=joint.device)
    if lanes == 0 or depth == 0:
        return (ceilings > 0).to(torch.int64)
    _prefix_allocation_kernel[(1,)](
        joint,
        ceilings,
        slots,
        out,
        rows,
        *joint.stride()[:2],
        LANES=lanes,
        DEPTH=depth,
        BLOCK_R=triton.next_power_of_2(lanes),
        BLOCK_D=triton.next_power_of_2(depth),
        num_warps=1 if lanes * depth <= 256 else 2,
    )
    return out
