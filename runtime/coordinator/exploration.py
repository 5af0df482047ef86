"""The exploration rule for a prerequisite's following shape (spec, "Cost
model and discovery" and "Prerequisites and completion"; docs/prerequisites.md,
"Unmeasured following shapes").

A pair whose following shape is unmeasured compares optimistically by its
useful value, and an indeterminate candidate wins over every determinate one.
Only the prerequisite executes, so the pair measures nothing: the following
shape is measured only when a later decision runs it.  Single-graph selection
never runs an unmeasured shape whose work a smaller prepared shape of its
family does ("Prefill exploration excludes a larger unmeasured graph when a
smaller prepared capacity consumes the same tokens"; a one-row cohort on a
packed prefill program is left to a single prefill; a decode cohort to the
smallest batch that holds it).  A lookahead that counted such a shape would
stay indeterminate for ever: every vision frame or restore of its kind would
outrank all measured work, and drain the window before it ran.

:func:`dominated_unmeasured` is that rule for lookahead: an unmeasured
following shape is left out when a smaller shape of its family (no larger
batch, no larger prompt capacity, the same width, depth and rows per target)
holds the same cohort (its rows and prompt tokens).  Measured shapes always
compete by their observed costs.

Pure Python: no torch, sockets or clocks.
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime.coordinator.cost import CostEntry


def dominated_unmeasured(
    family: Iterable[CostEntry], follow: CostEntry, rows: int, tokens: int
) -> bool:
    """Whether ``follow`` is unmeasured and another shape of ``family`` (its
    kind's entries) no larger in batch or prompt capacity, of the same width,
    depth and targets per row, holds ``rows`` rows and ``tokens`` prompt
    tokens (the prompt capacity a packed program's rows share)."""
    if follow.known:
        return False
    d = follow.descriptor
    for entry in family:
        x = entry.descriptor
        if entry is follow or x.kind is not d.kind:
            continue
        if x.batch_capacity > d.batch_capacity or x.prompt_capacity > d.prompt_capacity:
            continue
        if x.token_capacity != d.token_capacity or x.proposal_depth != d.proposal_depth:
            continue
        if x.target_capacity * d.batch_capacity != d.target_capacity * x.batch_capacity:
            continue  # (a ragged program against a rectangular one: not the same work)
        if x.device_allocated != d.device_allocated:
            continue
        if x.batch_capacity >= rows and x.prompt_capacity >= tokens:
            return True
    return False
