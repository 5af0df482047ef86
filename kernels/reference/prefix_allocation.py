"""Torch reference of the device prefix allocation of prefix-limit speculative
programs, with no Triton import; the test oracle of
kernels/triton/prefix_allocation.py.

Every lane gets its pending row; then, while rows are left, one more row goes to
the lane whose immediate causal frontier (its next prefix, of q proposals when it
holds q rows, probability ``joint[i, q - 1]``) has the highest joint prefix
probability; ties go to the shorter prefix (smaller q), then the lower request
slot, then the earlier lane.  A lane never exceeds its ceiling, nor D + 1 rows
(the prefixes it has).  It stops when ``rows`` are used or no lane can grow.  The
cohort never changes.  This is the host's rule,
``runtime.coordinator.rounds.device_allocation``, which the coordinator uses to
recompute the allocation from the confidence sidecar, so the two must agree
exactly.  A zero-probability prefix is a certain rejection and is never
admitted: its rows stay unused.
"""

from __future__ import annotations

import torch
from torch import Tensor


def prefix_allocation_reference(
    joint: Tensor, ceilings: Tensor, slots: Tensor, rows: int
) -> Tensor:
    """Query lengths (R,) int64 for joint (R, D) prefix probabilities, ceilings
    (R,) and request slots (R,) within ``rows`` target rows (a pending row for
    every lane with a ceiling, even when rows < R; a lane whose ceiling is 0 is
    absent: 0 rows, not counted).  One host read of the inputs; runs on their
    device."""
    lanes, depth = joint.shape
    device = joint.device
    queries = (ceilings > 0).to(torch.int64)  # a ceiling of 0: no lane, no row
    present = int(queries.sum())
    if lanes == 0 or depth == 0:
        return queries
    cap = ceilings.to(torch.int64).clamp(max=depth + 1)  # (R,) never past the last prefix
    slot = slots.to(torch.int64)  # (R,)
    lane = torch.arange(lanes, device=device)  # (R,)
    # Each lane grows by at most D rows, so no more admissions than that.
    for _ in range(min(max(rows - present, 0), present * depth)):
        p = joint.gather(1, (queries - 1).clamp(0, depth - 1).unsqueeze(1)).squeeze(1)  # (R,)
        grow = (queries < cap) & (p > 0)  # (R,) an admissible, possible frontier
        if not bool(grow.any()):
            break
        p = p.double().masked_fill(~grow, -torch.inf)
        best = grow & (p == p.max())  # the highest probability ...
        best &= queries == queries.masked_fill(~best, depth + 2).min()  # ... shortest prefix
        big = torch.iinfo(torch.int64).max
        best &= slot == slot.masked_fill(~best, big).min()  # ... lowest slot
        winner = lane.masked_fill(~best, lanes).min()  # ... earliest lane
        queries[winner] += 1
    return queries
