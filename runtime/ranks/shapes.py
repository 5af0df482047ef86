"""A prepared program's fixed extents (:class:`ProgramShape`) and its sampling variants.

A program's shape (:class:`ProgramShape`): decode batch B has B tokens, B lanes,
one token per lane; prefill (B, C) has C tokens and B lanes, every one a
prompt row of up to C tokens, their query lengths summing to at most C (B = 1:
a single prefill, B > 1: a *packed* prefill); a mixed program (B, W, C) has B
lanes and C + (B - 1) * W tokens: at most one prompt row of up to C tokens
(``prefill_row``, an index into the dense lane list, -1 for none) and decode
rows of up to W tokens each (W = 1 today).  Lane ``i``'s tokens are packed at
the prefix sum of the query lengths before it.  Padded tokens and lanes write
no KV (slot -1) and commit into the scratch row.

Sampling comes in three captured *variants* of the same shape, chosen per
frame from its lanes' settings (:data:`VARIANTS`): ``argmax`` (every lane
greedy with no bias, penalty or ``min_tokens``: one argmax), ``sample`` (the
full sampler, logit adjustments and the per-slot penalty state) and
``logprobs`` (``sample`` plus the raw log probabilities).  Settings are fixed
per request, so a request that needs the full sampler runs every frame in
``sample`` or ``logprobs`` and its penalty state stays exact; the state of a
slot whose settings never need it is not maintained (nothing reads it).  The variants share
the shape's one cost entry (the spec keys costs by physical shape); their cost
spread is reported by ``scripts/bench_rank_host.py`` and ``scripts/gpu_check.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.catalog import PREFILL_KINDS, GraphDescriptor, GraphKind
from runtime.ranks.checked_frame import CheckedFrame

VARIANTS = ("argmax", "sample", "logprobs")
# A scored prefill turns its (N, V) logits into log probabilities this many
# token rows at a time, so its float32 temporaries stay (SCORE_ROWS, V).
SCORE_ROWS = 256


class ProgramError(ValueError):
    """A frame does not fit the program it names."""


@dataclass(frozen=True)
class ProgramShape:
    """A program's fixed extents.

    ``max_query_len`` bounds every lane's new tokens, except in mixed programs,
    where it bounds the prompt row's (C) and ``row_query_len`` every other
    row's (W).  Mixed token capacity is the spec's maximum packed extent
    ``C + (B - 1) * W``: whichever lane is the prompt row, every packing of
    one prompt row and B - 1 rows of at most W tokens fits, and a decode-only
    population (C >= W) too.  A packed prefill's B prompt rows share its C
    tokens: each row may take up to C, their sum at most C.
    """

    tokens: int  # N: packed token rows
    lanes: int  # L: request rows
    max_query_len: int  # Q: new tokens per lane at most (mixed: the prompt row's, C)
    row_query_len: int = 0  # W: mixed only: new tokens of every other row at most; 0 = not mixed
    scored: bool = False  # a scored prefill: logits at every packed token, not only the last

    @property
    def mixed(self) -> bool:
        return self.row_query_len > 0

    @classmethod
    def of(cls, desc: GraphDescriptor) -> ProgramShape:
        if desc.kind is GraphKind.DECODE:
            return cls(desc.batch_capacity, desc.batch_capacity, 1)
        if desc.kind in PREFILL_KINDS:  # B prompt rows sharing C tokens
            scored = desc.kind is GraphKind.SCORED_PREFILL
            c = desc.prompt_capacity
            return cls(c, desc.batch_capacity, c, scored=scored)
        if desc.kind is GraphKind.MIXED:
            b, w, c = desc.batch_capacity, desc.token_capacity, desc.prompt_capacity
            return cls(c + (b - 1) * w, b, c, w)
        if desc.kind is GraphKind.SPECULATIVE:  # P target rows, B lanes of at most D + 1
            width = min(desc.token_capacity, desc.proposal_depth + 1)
            return cls(desc.target_capacity, desc.batch_capacity, width)
        raise ProgramError(f"no prepared program for {desc.kind.value} graphs yet")


def variant_of(checked: CheckedFrame) -> str:
    """The sampling variant a checked frame needs."""
    if checked.logprobs >= 0:
        return "logprobs"
    return "sample" if checked.full else "argmax"
