"""What every baseline shares: request progress, slots, shape selection, the API.

A baseline subclass only decides *what one step runs*: :meth:`BaselineScheduler._step`
returns the step's rows (a prompt chunk or one decode token per request) from the
current progress counters.  This module turns the rows into a
:class:`~runtime.coordinator.ScheduledPlan` over the smallest covering shape
(:class:`ShapeLadder`), makes newly scheduled requests resident at commit, and
applies completions.  Frames run one at a time: ``plan()`` returns ``None`` while
one is in flight, so progress counters are exact whenever a step is decided.  A
subclass that speculates also chooses the width of a decode-only step
(:meth:`BaselineScheduler._decode_width`, 1 by default).

Prefix caching (:class:`PrefixCache`, on by default, ``prefix_caching=False``
turns it off) is modelled here, once, identically for every baseline: vLLM's
automatic prefix caching, SGLang's RadixAttention and Sarathi-Serve on vLLM all
reuse the KV of a prompt prefix another request computed.  The model:

* pages of :data:`PREFIX_PAGE_SIZE` (16) tokens, keyed by content: the chain of
  ``RequestSpec.prompt_tokens`` from the prompt's start, under
  ``RequestSpec.cache_salt`` (different salts never share);
* a request publishes the full pages of its prompt as its prefill chunks
  compute them (when each chunk's frame completes), so a request sharing the
  prefix can attach them while the first still runs; partial pages and output
  tokens are never published;
* a waiting request attaches the longest published full-page prefix of its
  prompt when it is first scheduled (matched again at every step until then,
  so its first prefill chunk starts after it), never the whole prompt: at most
  ``(prompt_len - 1) // 16`` pages, so at least the last prompt token is
  computed (as vLLM does); attached tokens are not prompt work (the request's
  ``prompt_done`` starts there) and are reported as the request's
  ``cached_tokens``;
* capacity is unbounded: nothing is evicted.  (The simulator's flare has
  65536 pages of 16 tokens, ``SchedulerConfig.num_pages``, far more than any
  suite workload's distinct prefixes, so it evicts nothing either.)

Requests with empty ``prompt_tokens`` neither attach nor publish anything and
are scheduled exactly as without the cache.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.catalog import MAX_BATCH_CAPACITY, PROMPT_ALIGNMENT, GraphDescriptor, GraphKind
from runtime.coordinator.errors import CommitError, CompletionError
from runtime.coordinator.plan import LanePhase, LaneWork, ScheduledPlan, SelectionReason
from runtime.coordinator.records import (
    CompletionRecord,
    ExecutionTiming,
    GeneratedToken,
    validate_records,
    validate_timing,
)
from runtime.coordinator.requests import AdmissionError, RequestHandle, RequestSpec

PREFIX_PAGE_SIZE = 16  # the baselines' prefix cache page, flare's SchedulerConfig.page_size


class PrefixCache:
    """Published full prompt pages per salt: a trie whose edges are the pages'
    token tuples (a node's key is the whole chain from the prompt's start, as
    vLLM's chained block hashes and SGLang's radix tree key theirs).  Unbounded."""

    def __init__(self, page_size: int = PREFIX_PAGE_SIZE) -> None:
        self.page_size = check_positive_int("page_size", page_size)
        self._roots: dict[str, dict] = {}
        self.pages = 0  # distinct published pages
        self.version = 0  # changes whenever a page is published

    def root(self, salt: str) -> dict:
        return self._roots.setdefault(salt, {})

    def extend(self, node: dict, tokens: Sequence[int], at: int, limit: int) -> tuple[dict, int]:
        """Follow published pages of ``tokens`` from ``node`` (the page chain of
        ``tokens[:at]``) while a whole page fits within ``limit`` tokens; the
        node reached and its token count."""
        size = self.page_size
        while at + size <= limit:
            child = node.get(tuple(tokens[at : at + size]))
            if child is None:
                break
            node, at = child, at + size
        return node, at

    def publish(self, node: dict, tokens: Sequence[int], at: int, upto: int) -> tuple[dict, int]:
        """Publish the full pages of ``tokens[at:upto]`` below ``node`` (the page
        chain of ``tokens[:at]``); the node of the last full page and its count."""
        size = self.page_size
        while at + size <= upto:
            key = tuple(tokens[at : at + size])
            child = node.get(key)
            if child is None:
                child = node[key] = {}
                self.pages += 1
                self.version += 1
            node, at = child, at + size
        return node, at


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ShapeLadder:
    """Picks the physical shape for a step from the prepared catalog.

    * decode-only: the smallest ``DECODE`` batch >= rows; beyond the ladder a
      synthesized ``DECODE`` with B = the next power of two;
    * one prompt chunk alone: the smallest ``PREFILL`` capacity >= the chunk;
      beyond the ladder a synthesized ``PREFILL`` with C = the chunk rounded up to 64;
    * one prompt chunk with decoders: the smallest width-one ``MIXED`` shape with
      B >= rows and prompt capacity >= the chunk (ordered by prompt capacity, then B);
    * anything else (several prompt chunks, or no covering mixed shape): one
      synthesized ``MIXED`` with B = the next power of two >= max(2, rows) and C =
      the smallest catalog prompt bucket (``PREFILL`` or ``MIXED`` capacity) covering
      the step's prompt tokens, or their sum rounded up to 64 beyond the largest.

    Speculative decode rounds (:meth:`select_round`): at width W > 1 the
    smallest host-allocated rectangular ``SPECULATIVE`` shape (P = B x W) with
    token capacity W and B >= rows (then the smallest D >= W - 1); beyond the
    ladder a synthesized one with B = the next power of two and D = W - 1.
    :attr:`widths` are the widths the catalog offers, 1 (ordinary decode) included.
    """

    def __init__(self, catalog: Sequence[GraphDescriptor]) -> None:
        if isinstance(catalog, (str, bytes)) or not isinstance(catalog, Sequence):
            raise ValueError(f"catalog must be a list of GraphDescriptor, got {catalog!r}")
        for i, d in enumerate(catalog):
            if not isinstance(d, GraphDescriptor):
                raise ValueError(f"catalog[{i}] is not a GraphDescriptor: {d!r}")
        self.catalog = tuple(catalog)
        self.decode = sorted(
            (d for d in catalog if d.kind is GraphKind.DECODE), key=lambda d: d.batch_capacity
        )
        self.prefill = sorted(  # single-row prefills (a packed one is flare's shape)
            (d for d in catalog if d.kind is GraphKind.PREFILL and d.batch_capacity == 1),
            key=lambda d: d.prompt_capacity,
        )
        self.mixed = sorted(
            (
                d
                for d in catalog
                if d.kind is GraphKind.MIXED and d.token_capacity == 1 and d.proposal_depth == 0
            ),
            key=lambda d: (d.prompt_capacity, d.batch_capacity),
        )
        self.prompt_buckets = sorted(
            {d.prompt_capacity for d in self.prefill} | {d.prompt_capacity for d in self.mixed}
        )
        self.speculative: dict[int, list[GraphDescriptor]] = {}
        for d in catalog:
            if (
                d.kind is GraphKind.SPECULATIVE
                and d.token_capacity > 1
                and d.target_capacity == d.batch_capacity * d.token_capacity
                and d.proposal_depth >= d.token_capacity - 1
                and not getattr(d, "device_allocated", False)
            ):
                self.speculative.setdefault(d.token_capacity, []).append(d)
        for shapes in self.speculative.values():
            shapes.sort(key=lambda d: (d.batch_capacity, d.proposal_depth))
        self.widths: tuple[int, ...] = (1, *sorted(self.speculative))
        self._keys = {d.key for d in catalog}

    @property
    def largest_prefill(self) -> int | None:
        return self.prefill[-1].prompt_capacity if self.prefill else None

    @property
    def largest_decode(self) -> int | None:
        return self.decode[-1].batch_capacity if self.decode else None

    @property
    def max_width(self) -> int:
        return self.widths[-1]

    def width_at_most(self, width: int) -> int:
        """The widest catalog width <= ``width`` (1, ordinary decode, at least)."""
        return max(w for w in self.widths if w <= max(1, width))

    def select_round(self, rows: int, width: int) -> GraphDescriptor:
        """The shape for a decode-only step of ``rows`` requests at ``width``
        (1: ordinary decode, :meth:`select`)."""
        if width <= 1:
            return self.select((), rows)
        if rows < 1 or rows > MAX_BATCH_CAPACITY:
            raise ValueError(f"a step has 1..{MAX_BATCH_CAPACITY} rows, got {rows}")
        for d in self.speculative.get(width, ()):
            if d.batch_capacity >= rows:
                return d
        return GraphDescriptor(
            GraphKind.SPECULATIVE,
            _next_power_of_two(rows),
            token_capacity=width,
            proposal_depth=width - 1,
        )

    def in_catalog(self, desc: GraphDescriptor) -> bool:
        return desc.key in self._keys

    def prompt_capacity(self, tokens: int) -> int:
        """The smallest catalog prompt bucket >= ``tokens``; beyond: rounded up to 64."""
        i = bisect.bisect_left(self.prompt_buckets, tokens)
        if i < len(self.prompt_buckets):
            return self.prompt_buckets[i]
        return _round_up(tokens, PROMPT_ALIGNMENT)

    def select(self, chunks: Sequence[int], decoders: int) -> GraphDescriptor:
        """The shape for a step of prompt ``chunks`` and ``decoders`` decode rows."""
        rows = len(chunks) + decoders
        if rows < 1 or rows > MAX_BATCH_CAPACITY:
            raise ValueError(f"a step has 1..{MAX_BATCH_CAPACITY} rows, got {rows}")
        if not chunks:
            for d in self.decode:
                if d.batch_capacity >= rows:
                    return d
            return GraphDescriptor(GraphKind.DECODE, _next_power_of_two(rows))
        if len(chunks) == 1 and decoders == 0:
            (chunk,) = chunks
            for d in self.prefill:
                if d.prompt_capacity >= chunk:
                    return d
            return GraphDescriptor(
                GraphKind.PREFILL, 1, prompt_capacity=_round_up(chunk, PROMPT_ALIGNMENT)
            )
        if len(chunks) == 1:
            (chunk,) = chunks
            for d in self.mixed:
                if d.batch_capacity >= rows and d.prompt_capacity >= chunk:
                    return d
        return GraphDescriptor(
            GraphKind.MIXED,
            _next_power_of_two(max(2, rows)),
            prompt_capacity=self.prompt_capacity(sum(chunks)),
        )


class Request:
    """One request's progress counters; its phase follows from them."""

    __slots__ = (
        "cache_node",
        "cache_seen",
        "cached",
        "finish_reason",
        "generation",
        "handle",
        "output",
        "prompt_done",
        "published",
        "slot",
        "spec",
        "tenant",
    )

    def __init__(self, handle: RequestHandle, spec: RequestSpec, tenant: int) -> None:
        self.handle = handle
        self.spec = spec
        self.tenant = tenant
        self.prompt_done = 0  # committed prompt tokens (attached cached ones included)
        self.cached = 0  # prompt tokens attached from the prefix cache
        # The prefix cache node of the prompt's first ``published`` tokens (pages
        # attached or published), None without prompt_tokens or caching; the cache
        # version a waiting request was last matched against.
        self.cache_node: dict | None = None
        self.published = 0
        self.cache_seen = -1
        self.output = 0  # committed output tokens
        self.slot: int | None = None  # set while resident
        self.generation = 0
        self.finish_reason: str | None = None

    @property
    def remaining_prompt(self) -> int:
        return self.spec.prompt_len - self.prompt_done

    @property
    def prefilling(self) -> bool:
        return self.prompt_done < self.spec.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"Request({self.handle.id}, tenant={self.tenant}, prompt={self.prompt_done}/"
            f"{self.spec.prompt_len}, output={self.output}/{self.spec.max_output_tokens})"
        )


@dataclass(frozen=True)
class StepRow:
    """One row of a step: ``prompt_tokens`` of a prompt chunk, or 0 for a decode token."""

    request: Request
    prompt_tokens: int = 0

    @property
    def decode(self) -> bool:
        return self.prompt_tokens == 0


@dataclass
class _InFlight:
    fence: int
    plan: ScheduledPlan
    rows: tuple[StepRow, ...]


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class BaselineScheduler:
    """The production scheduler's API over a fixed per-step policy (``_step``).

    At most ``max_slots`` requests are resident (scheduled at least once and not
    finished); the rest wait in arrival order.  A request becomes resident when a
    committed step first schedules it, takes the lowest free slot, and releases it
    when it finishes.  Requests finish at ``spec.max_output_tokens`` output tokens
    (the final prompt chunk commits the first) or at a record's ``"stop"``.
    Hard boundaries, message endpoints and host stops are not modelled.
    Prefix caching (``prefix_caching``, on by default): see the module docstring.
    """

    name = "baseline"
    tenant_aware = False

    def __init__(
        self,
        catalog: Sequence[GraphDescriptor],
        *,
        max_slots: int = 64,
        prefix_caching: bool = True,
    ) -> None:
        check_positive_int("max_slots", max_slots)
        if max_slots > MAX_BATCH_CAPACITY:
            raise ValueError(f"max_slots must be <= {MAX_BATCH_CAPACITY}, got {max_slots}")
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be a bool, got {prefix_caching!r}")
        self.shapes = ShapeLadder(catalog)
        self.max_slots = max_slots
        self.prefix_cache = PrefixCache() if prefix_caching else None
        self.now_ns = 0
        self.requests: dict[int, Request] = {}  # every admitted request, by handle id
        self.waiting: dict[int, Request] = {}  # not yet resident, arrival order
        self.running: list[Request] = []  # resident, in the order they became resident
        self._free_slots = list(range(max_slots))  # sorted
        self._generations = [0] * max_slots
        self._inflight: _InFlight | None = None
        self._planned: tuple[ScheduledPlan, tuple[StepRow, ...], int] | None = None
        self._epoch = 0  # changes with every commit and completion
        self._plan_ids = 0
        self._last_fence: int | None = None
        self.frames = 0  # committed frames
        self.synthesized_frames = 0  # committed frames whose shape is not in the catalog

    # ------------------------------------------------------------------ policy
    def _step(self) -> list[StepRow]:
        """The rows of the next step, from the current counters (pure)."""
        raise NotImplementedError

    def _decode_width(self, rows: int) -> int:
        """The width W of a decode-only step of ``rows`` requests: 1 is ordinary
        decode; W > 1 a speculative round on the smallest ``SPECULATIVE`` shape of
        width W covering the rows (:meth:`ShapeLadder.select_round`), each lane
        offered min(W, output left) target rows (host allocated, complete
        prefixes shortened only by the output limit).  Called once per planned
        decode-only step; baselines that do not speculate keep 1."""
        return 1

    def _on_commit(self, rows: tuple[StepRow, ...]) -> None:
        """Hook: a step was committed (new requests are resident already)."""

    def _on_complete(self, rows: tuple[StepRow, ...], records: Sequence[CompletionRecord]) -> None:
        """Hook: a step's results were applied."""

    # ------------------------------------------------------------------ admission
    def _admit(self, spec: RequestSpec, tenant: int) -> RequestHandle:
        if not isinstance(spec, RequestSpec):
            raise AdmissionError(f"spec must be a RequestSpec, got {type(spec).__name__}")
        handle = RequestHandle(len(self.requests))
        r = Request(handle, spec, tenant)
        if self.prefix_cache is not None and spec.prompt_tokens:
            r.cache_node = self.prefix_cache.root(spec.cache_salt)
        self.requests[handle.id] = r
        self.waiting[handle.id] = r
        return handle

    def admit(self, spec: RequestSpec) -> RequestHandle:
        return self._admit(spec, 0)

    def advance_to(self, now_ns: int) -> None:
        if isinstance(now_ns, bool) or not isinstance(now_ns, int):
            raise ValueError(f"now_ns must be an integer, got {now_ns!r}")
        self.now_ns = max(self.now_ns, now_ns)

    # ------------------------------------------------------------------ planning
    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def _attach_cached(self) -> None:
        """Every waiting request with prompt tokens attaches the longest published
        full-page prefix of its prompt, short of its last token (the module
        docstring); the step then schedules it from there."""
        cache = self.prefix_cache
        if cache is None:
            return
        version = cache.version
        for r in self.waiting.values():
            if r.cache_node is None or r.cache_seen == version:
                continue
            r.cache_seen = version
            tokens = r.spec.prompt_tokens
            node, at = cache.extend(r.cache_node, tokens, r.published, r.spec.prompt_len - 1)
            r.cache_node, r.published = node, at
            r.prompt_done = r.cached = at

    def _publish(self, r: Request) -> None:
        """Publish the full pages of ``r``'s prompt computed so far."""
        cache = self.prefix_cache
        if cache is None or r.cache_node is None or r.prompt_done < r.published + cache.page_size:
            return
        r.cache_node, r.published = cache.publish(
            r.cache_node, r.spec.prompt_tokens, r.published, r.prompt_done
        )

    def plan(self) -> ScheduledPlan | None:
        if self._inflight is not None:
            return None
        self._attach_cached()
        rows = tuple(self._step())
        if not rows:
            return None
        width = 1
        if all(row.decode for row in rows):
            width = self.shapes.width_at_most(self._decode_width(len(rows)))
        new = [row.request for row in rows if row.request.slot is None]
        if len(self.running) + len(new) > self.max_slots:  # a policy bug, not a user error
            raise AssertionError(f"{self.name}: step exceeds max_slots={self.max_slots}")
        slots = dict(zip((r.handle.id for r in new), self._free_slots))
        lanes = []
        for row in rows:
            r = row.request
            slot = r.slot if r.slot is not None else slots[r.handle.id]
            generation = r.generation if r.slot is not None else self._generations[slot] + 1
            if row.decode:
                if r.prefilling:
                    raise AssertionError(f"{self.name}: decode row for a prefilling {r}")
                left = r.spec.max_output_tokens - r.output
                max_tokens = max(1, min(width, left))
                phase, start, tokens = LanePhase.DECODE, r.prompt_done, 0
            else:
                if not 0 < row.prompt_tokens <= r.remaining_prompt:
                    raise AssertionError(f"{self.name}: bad chunk {row.prompt_tokens} for {r}")
                ends = row.prompt_tokens == r.remaining_prompt
                phase, start, tokens = LanePhase.PREFILL, r.prompt_done, row.prompt_tokens
                max_tokens = 1 if ends else 0
            lanes.append(
                LaneWork(
                    handle=r.handle,
                    slot=slot,
                    generation=generation,
                    phase=phase,
                    prompt_start=start,
                    prompt_tokens=tokens,
                    output_start=r.output,
                    max_tokens=max_tokens,
                    expected_tokens=float(max_tokens),
                    expected_deliveries=float(max_tokens),
                    value=0.0,
                )
            )
        chunks = [row.prompt_tokens for row in rows if not row.decode]
        if width > 1:
            graph = self.shapes.select_round(len(rows), width)
        else:
            graph = self.shapes.select(chunks, len(rows) - len(chunks))
        self._plan_ids += 1
        plan = ScheduledPlan(
            plan_id=self._plan_ids,
            graph=graph,
            lanes=tuple(lanes),
            estimated_duration_ns=0,
            reason=SelectionReason.ORDINARY,
            requires_empty_window=True,
            planned_at_ns=self.now_ns,
            expected_start_ns=self.now_ns,
            value_rate_scaled=0.0,
            log_scale=0.0,
            useful_value=0.0,
            catalog_version=0,
        )
        self._planned = (plan, rows, self._epoch)
        return plan

    def commit(self, plan: ScheduledPlan, fence: int) -> None:
        if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
            raise CommitError(f"fence must be a non-negative integer, got {fence!r}")
        if self._last_fence is not None and fence <= self._last_fence:
            raise CommitError(f"fence {fence} is not newer than fence {self._last_fence}")
        if self._inflight is not None:
            raise CommitError(f"fence {self._inflight.fence} is still in flight")
        if self._planned is None or self._planned[0] is not plan:
            raise CommitError("plan is not this scheduler's latest plan")
        _, rows, epoch = self._planned
        if epoch != self._epoch:
            raise CommitError("plan is stale: a commit or completion happened since")
        # -- nothing below may fail ----------------------------------------------
        for lane, row in zip(plan.lanes, rows):
            r = row.request
            if r.slot is None:
                del self.waiting[r.handle.id]
                self._free_slots.remove(lane.slot)
                self._generations[lane.slot] = lane.generation
                r.slot, r.generation = lane.slot, lane.generation
                self.running.append(r)
        self._planned = None
        self._inflight = _InFlight(fence, plan, rows)
        self._last_fence = fence
        self._epoch += 1
        self.frames += 1
        if not self.shapes.in_catalog(plan.graph):
            self.synthesized_frames += 1
        self._on_commit(rows)

    # ------------------------------------------------------------------ completion
    def complete(
        self, fence: int, records: Sequence[CompletionRecord], timing: ExecutionTiming
    ) -> list[GeneratedToken]:
        head = self._inflight
        if head is None or head.fence != fence:
            expected = None if head is None else head.fence
            raise CompletionError(f"completion for fence {fence}, expected fence {expected}")
        validate_timing(timing)
        speculative = head.plan.graph.kind is GraphKind.SPECULATIVE
        validate_records(fence, head.plan.lanes, records, speculative)
        # -- validated: apply ------------------------------------------------------
        out: list[GeneratedToken] = []
        done = False
        for lane, row, record in zip(head.plan.lanes, head.rows, records):
            r = row.request
            r.prompt_done += lane.prompt_tokens
            if lane.prompt_tokens:
                self._publish(r)
            tokens = tuple(record.tokens)
            if not tokens:
                continue
            first = r.output == 0
            r.output += len(tokens)
            if record.finish_reason is not None:
                r.finish_reason = record.finish_reason
            elif r.output >= r.spec.max_output_tokens:
                r.finish_reason = "length"
            if r.finished:
                done = True
                self._release(r)
            out.append(
                GeneratedToken(
                    r.handle, fence, tokens, first, r.finished, r.finish_reason, r.cached
                )
            )
        if done:
            self.running = [r for r in self.running if not r.finished]
        self._inflight = None
        self._epoch += 1
        self._on_complete(head.rows, records)
        return out

    def _release(self, r: Request) -> None:
        assert r.slot is not None
        bisect.insort(self._free_slots, r.slot)
        r.slot = None

    def published_output(self, handle: RequestHandle, fence: int, at_ns: int | None = None) -> bool:
        """Baselines hold nothing back: publication only says whether the request is known."""
        return handle.id in self.requests

    def drain_trace(self) -> list:
        return []

    # ------------------------------------------------------------------ helpers
    def decoders(self) -> list[Request]:
        return [r for r in self.running if not r.prefilling]

    def partial_prefills(self) -> list[Request]:
        return [r for r in self.running if r.prefilling]

    @property
    def free_slots(self) -> int:
        return self.max_slots - len(self.running)
