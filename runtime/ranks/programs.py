"""Prepared programs: fixed-shape forward + sampling over static input arenas.

Graph capture is one component (STYLE.md).  Each program owns a small input
arena (:class:`ProgramInputs`); a CUDA graph captured over its views replays
with whatever the host copied in.  Sampled tokens, and every lane's raw log
probabilities (the sampled token's and the top :data:`MAX_LOGPROBS`), land in
output buffers shared by every program (:class:`ProgramOutputs`), beside the
model's EOS ids, which ``min_tokens`` bars, and the per-slot penalty state
(:class:`~runtime.ranks.sampling.PenaltyState`), which every program updates:
a prompt lane resets its slot's row when it starts a generation and marks its
tokens in the prompt mask, and every lane that commits a token counts it.
Captured programs always compute the log probabilities and the logit
adjustments (static work); eager ones only when a lane asks.

* CUDA: each program is captured with ``torch.cuda.CUDAGraph`` (largest first,
  one memory pool) and timed with CUDA events around the replay.
* CPU: the same static-buffer program runs eagerly, timed with
  ``perf_counter_ns`` around the synchronous run.

A program's shape (:class:`ProgramShape`): decode batch B has B tokens, B lanes,
one token per lane; prefill capacity C has C tokens and one lane; a mixed
program (B, W, C) has B lanes and C + (B - 1) * W tokens: at most one prompt
row of up to C tokens (``prefill_row``, an index into the dense lane list, -1
for none) and decode rows of up to W tokens each (W = 1 today).  Every lane's
query length is uploaded once; the packed token offsets are its exclusive
prefix sum in lane order, derived inside the body, so they never depend on
slot ids.  Padded tokens and lanes write no KV (slot -1, query length 0) and
their sampled tokens are ignored, so inactive rows mutate nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.model.attention import AttentionMetadata, packed_query_start
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.sampling import (
    LogitAdjustments,
    PenaltyState,
    SamplingBatch,
    bias_table,
    eos_index,
    sample,
    token_logprobs,
)
from runtime.ranks.slots import LaneInput
from runtime.transport.schema import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SLOTS


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
    population (C >= W) too.
    """

    tokens: int  # N: packed token rows
    lanes: int  # L: request rows
    max_query_len: int  # Q: new tokens per lane at most (mixed: the prompt row's, C)
    row_query_len: int = 0  # W: mixed only: new tokens of every other row at most; 0 = not mixed

    @property
    def mixed(self) -> bool:
        return self.row_query_len > 0

    @classmethod
    def of(cls, desc: GraphDescriptor) -> ProgramShape:
        if desc.kind is GraphKind.DECODE:
            return cls(desc.batch_capacity, desc.batch_capacity, 1)
        if desc.kind is GraphKind.PREFILL:
            return cls(desc.prompt_capacity, 1, desc.prompt_capacity)
        if desc.kind is GraphKind.MIXED:
            b, w, c = desc.batch_capacity, desc.token_capacity, desc.prompt_capacity
            return cls(c + (b - 1) * w, b, c, w)
        raise ProgramError(f"no prepared program for {desc.kind.value} graphs yet")


INT_FIELDS_PER_TOKEN = ("input_ids", "positions", "slot_mapping")
# One query-length field: the packed offsets (``query_start``) and each lane's
# last token (``logits_indices``) are derived from it inside the body.
# ``state_row``: the lane's penalty-state row (its slot; padding: the scratch
# row); ``count_row``: where its sampled token is counted (its slot when it
# commits the token, else scratch).
INT_FIELDS_PER_LANE = (
    "query_lens",
    "context_lens",
    "top_k",
    "seed",
    "step",
    "min_tokens",
    "state_row",
    "count_row",
)
# ``reset_row``: the penalty-state row a new generation starts in (scratch:
# none); ``prompt_lane``: the lane whose tokens are prompt tokens (-1: none).
INT_SCALARS = ("prefill_row", "reset_row", "prompt_lane")
FLOAT_FIELDS_PER_LANE = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
INT_FIELD_NAMES = INT_FIELDS_PER_TOKEN + INT_FIELDS_PER_LANE + INT_SCALARS  # then the page table


@dataclass(frozen=True)
class ProgramInputs:
    """Views of one program's input arena: what the body reads.

    Integer fields lie back to back in one int64 arena (per token: N entries
    each; per lane: L each; the scalars; then the (L, P) page table),
    floats in one float32 arena, so a frame's inputs arrive in one host tensor
    and one copy.  Lane ``i``'s tokens are packed at the prefix sum of the
    query lengths before it (:meth:`query_start`), whatever its slot.  The
    logit-bias table ((L, :data:`MAX_LOGIT_BIAS`) ids, -1 padded, and values)
    is a third and fourth part of the arena, rewritten only when a frame or
    the previous one carries a bias, so frames without one pack nothing more.

    Wider rows (W > 1, speculative verification) fit without a new layout:
    a decode row's W tokens are packed at its offset like a prompt chunk, and
    its W logits rows would be ``query_start[:, None] + arange(W)`` masked by
    ``query_lens`` (an (L, W) index derived in the body beside
    :meth:`logits_indices`, the prompt row keeping its last token).
    """

    input_ids: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    slot_mapping: torch.Tensor  # (N,) -1 = write no KV
    query_lens: torch.Tensor  # (L,) 0 = inactive lane
    context_lens: torch.Tensor  # (L,)
    top_k: torch.Tensor  # (L,)
    seed: torch.Tensor  # (L,)
    step: torch.Tensor  # (L,)
    min_tokens: torch.Tensor  # (L,)
    state_row: torch.Tensor  # (L,) penalty-state row: the slot, scratch for padding
    count_row: torch.Tensor  # (L,) where the sampled token is counted (scratch: nowhere)
    prefill_row: torch.Tensor  # (1,) mixed programs: the prompt row's lane index, -1 = none
    reset_row: torch.Tensor  # (1,) penalty-state row to zero first (scratch: none)
    prompt_lane: torch.Tensor  # (1,) the lane whose tokens are prompt tokens, -1 = none
    page_tables: torch.Tensor  # (L, P)
    temperature: torch.Tensor  # (L,)
    top_p: torch.Tensor  # (L,)
    presence_penalty: torch.Tensor  # (L,)
    frequency_penalty: torch.Tensor  # (L,)
    repetition_penalty: torch.Tensor  # (L,)
    bias_ids: torch.Tensor  # (L, MAX_LOGIT_BIAS) -1 = unused
    bias_values: torch.Tensor  # (L, MAX_LOGIT_BIAS)

    @classmethod
    def over(
        cls,
        ints: torch.Tensor,
        floats: torch.Tensor,
        n: int,
        lanes: int,
        pages: int,
        bias_ids: torch.Tensor,
        bias_values: torch.Tensor,
    ) -> ProgramInputs:
        # One split call for every view (slicing field by field costs ~2 us each).
        sizes = [n] * len(INT_FIELDS_PER_TOKEN) + [lanes] * len(INT_FIELDS_PER_LANE)
        sizes += [1] * len(INT_SCALARS) + [lanes * pages]
        used = sum(sizes)
        parts = ints.split_with_sizes([*sizes, ints.shape[0] - used])
        views = dict(zip(INT_FIELD_NAMES, parts))
        views["page_tables"] = parts[len(INT_FIELD_NAMES)].view(lanes, pages)
        floats = floats.split_with_sizes([lanes] * len(FLOAT_FIELDS_PER_LANE))
        views.update(zip(FLOAT_FIELDS_PER_LANE, floats))
        return cls(**views, bias_ids=bias_ids, bias_values=bias_values)

    @staticmethod
    def int_size(n: int, lanes: int, pages: int) -> int:
        return (
            len(INT_FIELDS_PER_TOKEN) * n
            + len(INT_FIELDS_PER_LANE) * lanes
            + len(INT_SCALARS)
            + lanes * pages
        )

    def query_start(self) -> torch.Tensor:
        """(L,) packed offset of each lane: prefix sums of ``query_lens`` (tensor ops)."""
        return packed_query_start(self.query_lens)

    def logits_indices(self, query_start: torch.Tensor) -> torch.Tensor:
        """(L,) each lane's last new token (inactive lanes: a valid, ignored row)."""
        last = query_start + self.query_lens - 1  # (L,)
        return last.clamp(0, self.input_ids.shape[0] - 1)

    def prompt_rows(self, query_start: torch.Tensor, scratch: int) -> torch.Tensor:
        """(N,) the penalty-state row each packed token marks as a prompt token:
        the prompt lane's row for its tokens, ``scratch`` for every other token."""
        has = self.prompt_lane >= 0  # (1,)
        lane = self.prompt_lane.clamp(min=0)  # (1,)
        start = query_start.index_select(0, lane)  # (1,)
        length = torch.where(has, self.query_lens.index_select(0, lane), 0)  # (1,)
        n = torch.arange(self.input_ids.shape[0], device=self.input_ids.device)  # (N,)
        inside = (n >= start) & (n < start + length)
        return torch.where(inside, self.state_row.index_select(0, lane), scratch)


@dataclass(frozen=True)
class ProgramOutputs:
    """Static buffers shared by every program (rows 0..L-1 belong to the last run),
    with the model's EOS ids and the per-slot penalty state."""

    tokens: torch.Tensor  # (L_max,) int64: the sampled tokens
    logprob: torch.Tensor  # (L_max,) float32: the sampled token's raw log probability
    top_ids: torch.Tensor  # (L_max, K) int64: the top-K tokens, best first
    top_logprobs: torch.Tensor  # (L_max, K) float32: their log probabilities
    eos: torch.Tensor  # (E,) int64: the model's EOS ids, barred by min_tokens
    penalties: PenaltyState  # per slot: output-token counts, prompt-token mask

    @classmethod
    def allocate(cls, lanes: int, model: LlamaForCausalLM, device: torch.device) -> ProgramOutputs:
        vocab = model.config.vocab_size
        k = min(MAX_LOGPROBS, vocab)
        return cls(
            tokens=torch.zeros(lanes, dtype=torch.int64, device=device),
            logprob=torch.zeros(lanes, dtype=torch.float32, device=device),
            top_ids=torch.zeros(lanes, k, dtype=torch.int64, device=device),
            top_logprobs=torch.zeros(lanes, k, dtype=torch.float32, device=device),
            eos=eos_index(model.config.eos_token_ids, device),
            penalties=PenaltyState(MAX_SLOTS, vocab, device),
        )

    @property
    def max_logprobs(self) -> int:
        return self.top_ids.shape[1]


class PreparedProgram:
    """One descriptor's program: its input arena, its body, its captured graph.

    Captured programs read their own device arena (sized for the whole
    context), refilled by one host-to-device copy per frame.  Eager programs
    read the frame's host tensors directly, trimmed to the page-table columns
    the frame's longest context needs, so the reference attention's cost
    follows the context rather than ``max_context``.
    """

    def __init__(
        self,
        desc: GraphDescriptor,
        model: LlamaForCausalLM,
        outputs: ProgramOutputs,
        page_size: int,
        max_pages: int,
    ) -> None:
        self.desc = desc
        self.shape = ProgramShape.of(desc)
        if desc.kind is GraphKind.MIXED and (desc.token_capacity > 1 or desc.proposal_depth):
            # Wider verification rows need proposals, acceptance and a (L, W)
            # logits index (see ProgramInputs); the inputs already fit them.
            raise ProgramError(f"no prepared program for {desc.describe()} yet: W > 1")
        self.model = model
        self.outputs = outputs  # shared by every program
        self.out_tokens = outputs.tokens  # (L_max,)
        self.page_size = page_size
        self.max_pages = max_pages
        self.device = outputs.tokens.device
        self.graph: torch.cuda.CUDAGraph | None = None
        n, lanes = self.shape.tokens, self.shape.lanes
        self._ints = torch.zeros(ProgramInputs.int_size(n, lanes, max_pages), dtype=torch.int64)
        self._floats = torch.zeros(len(FLOAT_FIELDS_PER_LANE) * lanes, dtype=torch.float32)
        self._ints, self._floats = self._ints.to(self.device), self._floats.to(self.device)
        ids, values = bias_table((), lanes)
        self._bias_ids, self._bias_values = ids.to(self.device), values.to(self.device)
        self._bias_rows = 0  # rows of the bias table holding entries
        self.inputs = self._views(self._ints, self._floats, max_pages)

    def _views(self, ints: torch.Tensor, floats: torch.Tensor, pages: int) -> ProgramInputs:
        n, lanes = self.shape.tokens, self.shape.lanes
        return ProgramInputs.over(ints, floats, n, lanes, pages, self._bias_ids, self._bias_values)

    # -- the program body, over the input views ---------------------------------
    def _body(self, logprobs: bool = True, adjust: bool = True) -> None:
        """Forward, penalty state, sample; with ``logprobs`` also the raw log
        probabilities, with ``adjust`` the lanes' logit bias and penalties.

        ``logprobs`` and ``adjust`` are fixed per call site (always True under
        capture), never read from the data; lanes without adjustments sample
        bitwise the same either way.  The penalty state is updated in both:
        the prompt lane's row is reset when it starts a generation and its
        tokens marked before sampling (so a first token sees its whole
        prompt), and every committed token counted after.
        """
        x, shape, out = self.inputs, self.shape, self.outputs
        state = out.penalties
        lanes = shape.lanes
        query_start = x.query_start()  # (L,) derived from the one query-length upload
        meta = AttentionMetadata(
            query_start=query_start,
            query_lens=x.query_lens,
            context_lens=x.context_lens,
            page_tables=x.page_tables,
            slot_mapping=x.slot_mapping,
            max_query_len=shape.max_query_len,
            prefill_row=x.prefill_row if shape.mixed else None,
            row_query_len=shape.row_query_len,
        )
        logits_indices = x.logits_indices(query_start)  # (L,)
        logits = self.model(x.input_ids, x.positions, meta, logits_indices).float()  # (L, V)
        if self.desc.prompt_capacity:  # only programs with prompt capacity take a prompt lane
            state.reset(x.reset_row)
            state.mark_prompt(x.prompt_rows(query_start, state.scratch), x.input_ids)
        adjustments = None
        if adjust:
            counts, prompt_mask = state.gather(x.state_row)  # (L, V) each
            adjustments = LogitAdjustments(
                x.bias_ids,
                x.bias_values,
                x.presence_penalty,
                x.frequency_penalty,
                x.repetition_penalty,
                counts,
                prompt_mask,
            )
        params = SamplingBatch(
            x.temperature, x.top_p, x.top_k, x.seed, x.step, x.min_tokens, adjustments
        )
        tokens = sample(logits, params, out.eos)  # (L,)
        state.count(x.count_row, tokens)
        out.tokens[:lanes].copy_(tokens)
        if logprobs:
            chosen, top_values, top_ids = token_logprobs(logits, tokens, out.max_logprobs)
            out.logprob[:lanes].copy_(chosen)
            out.top_logprobs[:lanes].copy_(top_values)
            out.top_ids[:lanes].copy_(top_ids)

    def capture(self, pool: object | None = None) -> object | None:
        """CUDA: capture the body as a graph (returns its memory pool). CPU: no-op."""
        if self.device.type != "cuda":
            return None
        self._fill([], full_width=True)  # all padding, over every page-table column
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: allocator, autotuning, lazy init
                self._body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._body()
        self.graph = graph
        return graph.pool()

    # -- one execution ---------------------------------------------------------
    def _fill(
        self, inputs: list[LaneInput], full_width: bool | None = None, prompt_row: int = -1
    ) -> None:
        """Pack ``inputs`` into one int64 and one float32 host tensor and bind them.

        Building tensors from Python lists dominates a frame's host time, so
        every field goes into one list.  Captured programs get one copy into
        their device arena; eager ones read the host tensors (CPU) or a copy of
        them (eager CUDA).  ``full_width``: the page table spans every column
        (default: when a graph was captured, since it reads them all; capture
        itself asks for it).  ``prompt_row``: mixed programs, the index of the
        prompt row in ``inputs`` (up to C tokens; every other row up to W),
        -1 for none; other programs take -1.  The lane that consumes prompt
        tokens (``LaneInput.prefill``; at most one) marks them in its slot's
        penalty state, and resets that state first when it starts a generation.
        """
        shape, page_size = self.shape, self.page_size
        n, lanes = shape.tokens, shape.lanes
        if len(inputs) > lanes:
            raise ProgramError(f"{len(inputs)} lanes for {lanes} rows")
        if not -1 <= prompt_row < (len(inputs) if shape.mixed else 0):
            raise ProgramError(f"prompt row {prompt_row} for {self.desc.describe()}")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        longest = 1
        row_limit = shape.row_query_len if shape.mixed else shape.max_query_len
        for row, i in enumerate(inputs):
            q = len(i.tokens)
            ctx = i.start_position + q
            limit = shape.max_query_len if row == prompt_row else row_limit
            if q > limit or ctx > len(i.page_table) * page_size:
                raise ProgramError(f"slot {i.slot}: {q} tokens at {i.start_position} do not fit")
            if len(i.page_table) > self.max_pages:
                raise ProgramError(f"slot {i.slot}: {len(i.page_table)} pages > {self.max_pages}")
            q_lens.append(q)  # packed at the prefix sum of the lengths before it
            ctx_lens.append(ctx)
            longest = max(longest, ctx)
            ids.extend(i.tokens)
            table = i.page_table
            for pos in range(i.start_position, ctx):
                positions.append(pos)
                slots.append(table[pos // page_size] * page_size + pos % page_size)
        used = len(ids)
        if used > n:
            raise ProgramError(f"{used} tokens do not fit {self.desc.describe()}")
        scratch = self.outputs.penalties.scratch
        if any(not 0 <= i.slot < scratch for i in inputs):
            raise ProgramError(f"a slot outside the penalty state's {scratch} rows")
        prompt_lanes = [row for row, i in enumerate(inputs) if i.prefill]
        if len(prompt_lanes) > 1:
            raise ProgramError(f"prompt lanes {prompt_lanes}: a program takes at most one")
        prompt_lane = prompt_lanes[0] if prompt_lanes else -1
        if prompt_lane >= 0 and not self.desc.prompt_capacity:
            raise ProgramError(f"a prompt lane for {self.desc.describe()}")
        starts = prompt_lane >= 0 and inputs[prompt_lane].starts
        reset_row = inputs[prompt_lane].slot if starts else scratch
        pad_tokens, pad_lanes = n - used, lanes - len(inputs)
        if full_width is None:
            full_width = self.graph is not None
        pages = self.max_pages if full_width else -(-longest // page_size)
        packed = ids + [0] * pad_tokens
        packed += positions + [0] * pad_tokens
        packed += slots + [-1] * pad_tokens  # unused token capacity writes nothing
        packed += q_lens + [0] * pad_lanes  # inactive lanes
        packed += ctx_lens + [0] * pad_lanes
        packed += [i.sampling.top_k for i in inputs] + [-1] * pad_lanes
        packed += [i.sampling.seed for i in inputs] + [0] * pad_lanes
        packed += [i.step for i in inputs] + [0] * pad_lanes
        packed += [i.sampling.min_tokens for i in inputs] + [0] * pad_lanes
        packed += [i.slot for i in inputs] + [scratch] * pad_lanes  # state_row
        packed += [i.slot if i.samples else scratch for i in inputs] + [scratch] * pad_lanes
        packed += (prompt_row, reset_row, prompt_lane)
        for i in inputs:
            table = i.page_table
            packed += table[:pages]
            packed += [-1] * (pages - len(table))  # empty when the table is longer
        packed += [-1] * (pages * pad_lanes)
        floats = [i.sampling.temperature for i in inputs] + [0.0] * pad_lanes
        floats += [i.sampling.top_p for i in inputs] + [1.0] * pad_lanes
        floats += [i.sampling.presence_penalty for i in inputs] + [0.0] * pad_lanes
        floats += [i.sampling.frequency_penalty for i in inputs] + [0.0] * pad_lanes
        floats += [i.sampling.repetition_penalty for i in inputs] + [1.0] * pad_lanes
        self._fill_bias(inputs)
        host_ints = torch.tensor(packed, dtype=torch.int64)
        host_floats = torch.tensor(floats, dtype=torch.float32)
        if self.device.type != "cuda":
            self.inputs = self._views(host_ints, host_floats, pages)
            return
        self._ints[: len(packed)].copy_(host_ints, non_blocking=True)
        self._floats.copy_(host_floats, non_blocking=True)
        if self.graph is None:  # eager CUDA: views follow this frame's page count
            self.inputs = self._views(self._ints, self._floats, pages)

    def _fill_bias(self, inputs: list[LaneInput]) -> None:
        """Rewrite the bias table when this frame or the last one holds entries
        (the table is otherwise all padding already: nothing to pack)."""
        biased = sum(bool(i.sampling.logit_bias) for i in inputs)
        if not biased and not self._bias_rows:
            return
        ids, values = bias_table([i.sampling for i in inputs], self.shape.lanes, MAX_LOGIT_BIAS)
        self._bias_ids.copy_(ids, non_blocking=True)
        self._bias_values.copy_(values, non_blocking=True)
        self._bias_rows = biased

    def run(
        self, inputs: list[LaneInput], *, logprobs: bool = False, prompt_row: int = -1
    ) -> tuple[list[int], int]:
        """Execute for ``inputs``; returns (one sampled token per lane, device ns).

        ``logprobs``: the caller will read :meth:`logprobs` after this run (an
        eager program computes them only then; a captured one always does).
        ``prompt_row``: mixed programs, the frame's prompt row (-1: none).
        An eager program applies logit bias and penalties only when a lane
        has some (a captured one always does; other lanes are unchanged).
        """
        self._fill(inputs, prompt_row=prompt_row)
        adjust = any(i.sampling.adjusts_logits for i in inputs)
        if self.graph is not None:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self.graph.replay()
            end.record()
            end.synchronize()
            device_ns = round(start.elapsed_time(end) * 1e6)
        else:
            if self.device.type == "cuda":  # eager CUDA (capture disabled)
                torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            self._body(logprobs, adjust)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            device_ns = time.perf_counter_ns() - t0
        tokens = self.out_tokens[: len(inputs)].tolist()
        return tokens, max(1, device_ns)

    def logprobs(self, lanes: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last run's first ``lanes`` rows, on the CPU, after ``run(..., logprobs=True)``.

        Returns (float32 (lanes, 1 + k): the sampled token's log probability,
        then the top ``k``; int32 (lanes, k): the top ``k`` token ids).  ``k``
        is at most :attr:`ProgramOutputs.max_logprobs`.
        """
        out = self.outputs
        if not 0 <= k <= out.max_logprobs:
            raise ProgramError(f"{k} log probabilities, at most {out.max_logprobs}")
        values = torch.cat([out.logprob[:lanes, None], out.top_logprobs[:lanes, :k]], dim=1)
        return values.cpu(), out.top_ids[:lanes, :k].to(torch.int32).cpu()


def prepare_programs(
    catalog: Iterable[GraphDescriptor],
    model: LlamaForCausalLM,
    page_size: int,
    max_context: int,
    *,
    capture: bool = True,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> dict[tuple, PreparedProgram]:
    """One program per descriptor over shared buffers; captured largest first."""
    catalog = list(catalog)
    shapes = [ProgramShape.of(d) for d in catalog]
    device = model.model.embed_tokens.weight.device
    max_pages = -(-max_context // page_size)
    outputs = ProgramOutputs.allocate(max(s.lanes for s in shapes), model, device)
    programs = {d.key: PreparedProgram(d, model, outputs, page_size, max_pages) for d in catalog}
    order = sorted(programs.values(), key=lambda p: (p.shape.tokens, p.shape.lanes), reverse=True)
    pool = None
    for program in progress(order) if progress else order:
        if capture:
            pool = program.capture(pool)
    return programs
