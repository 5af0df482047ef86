"""Speculative-decoding baselines: published width rules on prefill-first continuous batching.

All three run the prefill-first loop of :mod:`.sglang` without mixed chunk (the
continuous batching of vLLM's V0 loop and SGLang's default): whenever a chunked
prompt is unfinished, or a request waits and a slot is free, the step is a
prefill batch (budget ``chunked_prefill_size``, 8192 tokens); otherwise it is
ONE decode round of every running request.  They differ only in the round's
width W (the pending token included, so W - 1 draft tokens per request), one
width for the whole round:

* ``fixed-width`` (:class:`FixedWidthScheduler`): always ``width``;
* ``table`` (:class:`TableScheduler`): TensorRT-LLM's ``draft_len_schedule``
  style, a table from running-batch size to width (default: W = 4 up to 4
  running requests, 2 up to 16, 1 beyond);
* ``global-adaptive`` (:class:`GlobalAdaptiveScheduler`): one width for every
  request from a moving average of the accepted length.

The round runs on the smallest host-allocated rectangular ``SPECULATIVE`` shape
of width W with B >= rows (W = 1: ordinary ``DECODE``), see
:meth:`ShapeLadder.select_round`; each lane gets min(W, output left) target
rows.  A width the catalog does not offer falls back to the widest catalog
width below it (:meth:`ShapeLadder.width_at_most`).  ``rounds_by_width``
counts committed decode rounds per width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.records import CompletionRecord
from scripts.scheduling_sim.baselines._base import StepRow, check_positive_int
from scripts.scheduling_sim.baselines.sglang import DEFAULT_CHUNKED_PREFILL_SIZE, SglangScheduler


class SpeculativeBaseline(SglangScheduler):
    """Prefill first, else one decode round of all running requests at
    :meth:`width_for` (the number of rows)."""

    name = "speculative"

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        max_slots: int = 64,
        prefix_caching: bool = True,
        chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE,
    ) -> None:
        super().__init__(
            catalog,
            max_slots=max_slots,
            chunked_prefill_size=chunked_prefill_size,
            prefix_caching=prefix_caching,
        )
        self.rounds_by_width: dict[int, int] = {}
        # The committed round in flight: its width and each lane's query length.
        self._round: tuple[int, tuple[int, ...]] | None = None

    def width_for(self, rows: int) -> int:
        """The rule's width for a decode round of ``rows`` requests (pure)."""
        raise NotImplementedError

    def _decode_width(self, rows: int) -> int:
        return self.width_for(rows)

    def _on_commit(self, rows: tuple[StepRow, ...]) -> None:
        super()._on_commit(rows)
        assert self._inflight is not None
        plan = self._inflight.plan
        if not all(row.decode for row in rows):
            self._round = None
            return
        width = plan.graph.token_capacity if plan.graph.kind is GraphKind.SPECULATIVE else 1
        self.rounds_by_width[width] = self.rounds_by_width.get(width, 0) + 1
        self._round = (width, tuple(lane.max_tokens for lane in plan.lanes))
        self._on_round(width)

    def _on_round(self, width: int) -> None:
        """Hook: a decode round of ``width`` was committed."""

    def _on_complete(self, rows: tuple[StepRow, ...], records: Sequence[CompletionRecord]) -> None:
        super()._on_complete(rows, records)
        if self._round is not None:
            width, queries = self._round
            self._round = None
            if width > 1:
                self._observe(width, queries, records)

    def _observe(
        self, width: int, queries: tuple[int, ...], records: Sequence[CompletionRecord]
    ) -> None:
        """Hook: a speculative round of ``width`` completed; ``queries`` are its
        lanes' query lengths, ``records`` their results (accepted + 1 tokens)."""


class FixedWidthScheduler(SpeculativeBaseline):
    """Every decode round at ``width`` (1: ordinary decode)."""

    name = "fixed-width"

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        width: int,
        max_slots: int = 64,
        prefix_caching: bool = True,
        chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE,
    ) -> None:
        super().__init__(
            catalog,
            max_slots=max_slots,
            chunked_prefill_size=chunked_prefill_size,
            prefix_caching=prefix_caching,
        )
        self.width = check_positive_int("speculative_width", width)

    def width_for(self, rows: int) -> int:
        return self.width


# TensorRT-LLM's draft_len_schedule maps batch-size thresholds to draft lengths
# (the first threshold >= the batch applies; beyond the last, no drafts).  Here
# in widths (draft length + 1): (most running requests, width).
DEFAULT_TABLE: tuple[tuple[int, int], ...] = ((4, 4), (16, 2))


class TableScheduler(SpeculativeBaseline):
    """TensorRT-LLM ``draft_len_schedule`` style: the width is a step function
    of the running batch.  ``schedule`` lists (most running requests, width)
    by increasing bound; a round of n rows takes the width of the first bound
    >= n, and 1 (ordinary decode) beyond the last.  Default: W = 4 up to 4
    running requests, 2 up to 16, 1 beyond."""

    name = "table"

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        schedule: Sequence[tuple[int, int]] = DEFAULT_TABLE,
        max_slots: int = 64,
        prefix_caching: bool = True,
        chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE,
    ) -> None:
        super().__init__(
            catalog,
            max_slots=max_slots,
            chunked_prefill_size=chunked_prefill_size,
            prefix_caching=prefix_caching,
        )
        table = []
        for bound, width in schedule:
            check_positive_int("schedule bound", bound)
            check_positive_int("schedule width", width)
            table.append((bound, width))
        if [b for b, _ in table] != sorted({b for b, _ in table}):
            raise ValueError(f"schedule bounds must increase strictly, got {schedule!r}")
        self.schedule = tuple(table)

    def width_for(self, rows: int) -> int:
        for bound, width in self.schedule:
            if rows <= bound:
                return width
        return 1


class GlobalAdaptiveScheduler(SpeculativeBaseline):
    """One width for every request, from a moving average of accepted length.

    The rule: ``ema`` is an exponential moving average of accepted length per
    request-round, weight ``1/8`` per completed speculative round:
    ``ema += (a - ema) / 8`` where ``a`` is the round's mean observation over
    its lanes offered the full width (lanes shortened by their output limit are
    left out; a round with none leaves ``ema`` alone).  A lane's observation is
    its accepted drafts (tokens committed - 1), plus one when it accepted every
    draft offered: at width W no more than W - 1 can be accepted, so without
    that the average could never call for a wider round than the current one and
    the width could only shrink (the "grow on full acceptance" step of
    Hugging Face's heuristic draft schedule, folded into the average).  The
    width is ``clamp(floor(ema + 0.5) + 1, 1, max width of the catalog)``, then
    the widest catalog width not above it.  ``ema`` starts at ``max width - 1``:
    the first rounds use the widest program.  At p = 0.9 per draft this settles
    at W = 4 or 5, at p = 0.1 at W = 1.

    Width-one rounds offer no drafts and so observe nothing: left alone the
    width could never leave 1.  So every ``probe_every``-th (8th) consecutive
    round the rule would run at width 1 runs at the narrowest speculative width
    of the catalog instead, an observation that lets the width recover when
    acceptance does.
    """

    name = "global-adaptive"

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        max_slots: int = 64,
        prefix_caching: bool = True,
        chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE,
        weight: float = 1 / 8,
        probe_every: int = 8,
    ) -> None:
        super().__init__(
            catalog,
            max_slots=max_slots,
            chunked_prefill_size=chunked_prefill_size,
            prefix_caching=prefix_caching,
        )
        if not 0 < weight <= 1:
            raise ValueError(f"weight must lie in (0, 1], got {weight!r}")
        self.weight = weight
        self.probe_every = check_positive_int("probe_every", probe_every)
        self.ema = float(self.shapes.max_width - 1)
        self._narrow_rounds = 0  # consecutive committed rounds the rule put at width 1

    def rule_width(self) -> int:
        """clamp(floor(ema + 0.5) + 1, 1, max width)."""
        return max(1, min(math.floor(self.ema + 0.5) + 1, self.shapes.max_width))

    def width_for(self, rows: int) -> int:
        width = self.rule_width()
        probe = (self._narrow_rounds + 1) % self.probe_every == 0
        if width == 1 and len(self.shapes.widths) > 1 and probe:
            return self.shapes.widths[1]
        return width

    def _on_round(self, width: int) -> None:
        if self.shapes.width_at_most(self.rule_width()) == 1:
            self._narrow_rounds += 1
        else:
            self._narrow_rounds = 0

    def _observe(
        self, width: int, queries: tuple[int, ...], records: Sequence[CompletionRecord]
    ) -> None:
        full = [
            len(rec.tokens) - 1 + (len(rec.tokens) == width)
            for q, rec in zip(queries, records)
            if q == width
        ]
        if full:
            self.ema += self.weight * (sum(full) / len(full) - self.ema)
