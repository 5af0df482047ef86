"""Baseline schedulers for the simulator, behind the production scheduler's API.

Each speaks ``admit``, ``advance_to``, ``plan``, ``commit``, ``complete``,
``published_output`` and ``drain_trace`` like ``runtime/coordinator/scheduler.py``
and decides as a published system does:

* ``fcfs`` (:mod:`.fcfs`): vLLM-V0-style prefill-first FCFS, one prompt per frame;
* ``vllm`` (:mod:`.vllm`): vLLM v1's default step: a token budget (8192), running
  requests first (partial prefills included), then FCFS admissions, chunked;
* ``sglang`` (:mod:`.sglang`): prefill batches first (chunked prefill 8192, one
  chunked request at a time), else decode everything; optional mixed chunk;
* ``sarathi`` (:mod:`.sarathi`): Sarathi-Serve stall-free batching, budget 512;
* ``vtc`` (:mod:`.vtc`): the Virtual Token Counter fair scheduler on the vllm step.

Speculative decoding (:mod:`.speculative`; :data:`SPECULATIVE_BASELINE_NAMES`),
prefill-first continuous batching whose decode rounds run at a width chosen per
step by a published rule:

* ``fixed-width``: every round at ``speculative_width``;
* ``table``: TensorRT-LLM ``draft_len_schedule`` style (W = 4 up to 4 running
  requests, 2 up to 16, 1 beyond);
* ``global-adaptive``: one width from a moving average of accepted length.

All share (:mod:`._base`): at most ``max_slots`` (default 64, like flare) requests
are resident; the rest wait FCFS.  One prefix cache model serves them all
(vLLM's automatic prefix caching, SGLang's RadixAttention): full 16-token pages
of ``RequestSpec.prompt_tokens`` published as prefill chunks compute them, the
longest published prefix (short of the prompt's last token) attached when a
request is first scheduled, unbounded capacity; requests without prompt token
ids are unaffected.  One frame runs at a time (``plan()`` returns
``None`` while one is in flight).  Requests finish at ``spec.max_output_tokens``
output tokens; the final prompt chunk commits the first.  Plans carry one
``LaneWork`` per row: ``PREFILL`` with ``prompt_start``/``prompt_tokens`` and
``max_tokens`` 1 iff the chunk ends the prompt (else 0), ``DECODE`` with
``max_tokens`` 1 (a speculative round of width W: min(W, output left), and the
record commits 1..that many); a plan may hold several ``PREFILL`` lanes.

Shapes.  Each step runs on the smallest prepared shape of the catalog that
covers it:

* decode only: the smallest ``DECODE`` batch B >= rows;
* one prompt chunk alone: the smallest ``PREFILL`` capacity >= the chunk;
* one prompt chunk with decoders: the smallest width-one ``MIXED`` shape with
  B >= rows and prompt capacity >= the chunk (by prompt capacity, then B).

When no catalog shape covers the step, the descriptor is synthesized (the cost
profile prices any valid descriptor):

* several prompt chunks, with or without decoders, or a chunk with decoders and
  no covering mixed shape: ONE ``GraphDescriptor(GraphKind.MIXED, B,
  prompt_capacity=C)`` with B = the smallest power of two >= max(2, rows) (at
  most 64) and C = the smallest catalog prompt bucket (a ``PREFILL`` or ``MIXED``
  capacity) covering the SUM of the step's prompt tokens, or beyond the largest
  bucket that sum rounded up to a multiple of 64;
* decode only, more rows than the largest decode batch: ``DECODE`` with B = the
  next power of two >= rows;
* a single chunk beyond the largest prefill bucket: ``PREFILL`` with C = the
  chunk rounded up to a multiple of 64;
* a speculative round of width W > 1: the smallest host-allocated rectangular
  ``SPECULATIVE`` shape of width W with B >= rows, else one with B = the next
  power of two and D = W - 1.

``scheduler.synthesized_frames`` counts committed frames on synthesized shapes.

``make_baseline(name, catalog, ...)`` builds one by name; the CLI and the
benchmark use it.
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime.catalog import GraphDescriptor
from scripts.scheduling_sim.baselines._base import (
    BaselineScheduler,
    PrefixCache,
    Request,
    ShapeLadder,
    StepRow,
)
from scripts.scheduling_sim.baselines.fcfs import FcfsScheduler
from scripts.scheduling_sim.baselines.sarathi import SarathiScheduler
from scripts.scheduling_sim.baselines.sglang import SglangScheduler
from scripts.scheduling_sim.baselines.speculative import (
    FixedWidthScheduler,
    GlobalAdaptiveScheduler,
    SpeculativeBaseline,
    TableScheduler,
)
from scripts.scheduling_sim.baselines.vllm import VllmScheduler
from scripts.scheduling_sim.baselines.vtc import VtcScheduler

BASELINE_NAMES = ("fcfs", "vllm", "sglang", "sarathi", "vtc")
SPECULATIVE_BASELINE_NAMES = ("fixed-width", "table", "global-adaptive")


def make_baseline(
    name: str,
    catalog: list[GraphDescriptor],
    *,
    max_slots: int = 64,
    max_num_batched_tokens: int | None = None,
    enable_mixed_chunk: bool = False,
    tenant_weights: Mapping[int, float] | None = None,
    speculative_width: int = 0,
    prefix_caching: bool = True,
) -> BaselineScheduler:
    """The baseline ``name`` over ``catalog``.

    ``max_num_batched_tokens``: the per-step token budget; ``None`` takes the
    baseline's default (vllm and vtc 8192, sarathi 512, sglang's chunked prefill
    size 8192); fcfs has none.  ``enable_mixed_chunk`` is sglang's
    ``--enable-mixed-chunk``; ``tenant_weights`` are vtc's per-tenant weights.
    ``speculative_width``: the width of ``fixed-width`` (required, >= 1); the
    other baselines choose their own (0).  The speculative baselines take
    ``max_num_batched_tokens`` as their chunked prefill size (default 8192).
    ``prefix_caching``: the shared prefix cache model (on by default; see
    :mod:`._base`).  Unknown names and bad or inapplicable values raise
    ``ValueError`` naming the argument.
    """
    if name not in BASELINE_NAMES + SPECULATIVE_BASELINE_NAMES:
        names = ", ".join(BASELINE_NAMES + SPECULATIVE_BASELINE_NAMES)
        raise ValueError(f"name must be one of {names}; got {name!r}")
    if isinstance(speculative_width, bool) or not isinstance(speculative_width, int):
        raise ValueError(f"speculative_width must be an integer, got {speculative_width!r}")
    if name == "fixed-width":
        if speculative_width < 1:
            raise ValueError(f"fixed-width needs speculative_width >= 1, got {speculative_width}")
    elif speculative_width:
        raise ValueError(f"speculative_width applies to fixed-width only, not {name}")
    if not isinstance(enable_mixed_chunk, bool):
        raise ValueError(f"enable_mixed_chunk must be a bool, got {enable_mixed_chunk!r}")
    if enable_mixed_chunk and name != "sglang":
        raise ValueError(f"enable_mixed_chunk applies to sglang only, not {name}")
    if tenant_weights and name != "vtc":
        raise ValueError(f"tenant_weights apply to vtc only, not {name}")
    if max_num_batched_tokens is not None and name == "fcfs":
        raise ValueError("max_num_batched_tokens does not apply to fcfs (one prompt per frame)")
    if not isinstance(prefix_caching, bool):
        raise ValueError(f"prefix_caching must be a bool, got {prefix_caching!r}")
    cache = {"prefix_caching": prefix_caching}
    budget = cache | (
        {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    )
    if name in SPECULATIVE_BASELINE_NAMES:
        chunk = cache | (
            {}
            if max_num_batched_tokens is None
            else {"chunked_prefill_size": max_num_batched_tokens}
        )
        if name == "fixed-width":
            return FixedWidthScheduler(
                catalog, width=speculative_width, max_slots=max_slots, **chunk
            )
        if name == "table":
            return TableScheduler(catalog, max_slots=max_slots, **chunk)
        return GlobalAdaptiveScheduler(catalog, max_slots=max_slots, **chunk)
    if name == "fcfs":
        return FcfsScheduler(catalog, max_slots=max_slots, **cache)
    if name == "vllm":
        return VllmScheduler(catalog, max_slots=max_slots, **budget)
    if name == "sarathi":
        return SarathiScheduler(catalog, max_slots=max_slots, **budget)
    if name == "sglang":
        chunk = cache | (
            {}
            if max_num_batched_tokens is None
            else {"chunked_prefill_size": max_num_batched_tokens}
        )
        return SglangScheduler(
            catalog, max_slots=max_slots, enable_mixed_chunk=enable_mixed_chunk, **chunk
        )
    return VtcScheduler(catalog, max_slots=max_slots, tenant_weights=tenant_weights, **budget)


__all__ = [
    "BASELINE_NAMES",
    "SPECULATIVE_BASELINE_NAMES",
    "BaselineScheduler",
    "FcfsScheduler",
    "FixedWidthScheduler",
    "GlobalAdaptiveScheduler",
    "PrefixCache",
    "Request",
    "SarathiScheduler",
    "SglangScheduler",
    "ShapeLadder",
    "SpeculativeBaseline",
    "StepRow",
    "TableScheduler",
    "VllmScheduler",
    "VtcScheduler",
    "make_baseline",
]
