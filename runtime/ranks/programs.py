"""Prepared programs: fixed-shape forward + sampling over shared static buffers.

Graph capture is one component (STYLE.md).  One set of static buffers is sized
for the largest program; every program binds views of them, so a CUDA graph
captured over the views replays with whatever the host copied in.

* CUDA: each program is captured with ``torch.cuda.CUDAGraph`` (largest first,
  one memory pool) and timed with CUDA events around the replay.
* CPU: the same static-buffer program runs eagerly, timed with
  ``perf_counter_ns`` around the synchronous run.

A program's shape: decode batch B has B tokens, B lanes, one token per lane;
prefill capacity C has C tokens and one lane.  Padded tokens and lanes write no
KV (slot -1) and their sampled tokens are ignored, so inactive rows mutate
nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.model.attention import AttentionMetadata
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.sampling import SamplingBatch, sample
from runtime.ranks.slots import LaneInput


class ProgramError(ValueError):
    """A frame does not fit the program it names."""


@dataclass(frozen=True)
class ProgramShape:
    tokens: int  # N: packed token rows
    lanes: int  # L: request rows
    max_query_len: int  # Q: new tokens per lane at most

    @classmethod
    def of(cls, desc: GraphDescriptor) -> ProgramShape:
        if desc.kind is GraphKind.DECODE:
            return cls(desc.batch_capacity, desc.batch_capacity, 1)
        if desc.kind is GraphKind.PREFILL:
            return cls(desc.prompt_capacity, 1, desc.prompt_capacity)
        raise ProgramError(f"no prepared program for {desc.kind.value} graphs yet")


class StaticBuffers:
    """Inputs and outputs of every program, sized for the largest."""

    def __init__(self, tokens: int, lanes: int, max_pages: int, device: torch.device) -> None:
        i64 = {"dtype": torch.int64, "device": device}
        f32 = {"dtype": torch.float32, "device": device}
        self.input_ids = torch.zeros(tokens, **i64)  # (N,)
        self.positions = torch.zeros(tokens, **i64)  # (N,)
        self.slot_mapping = torch.full((tokens,), -1, **i64)  # (N,)
        self.query_start = torch.zeros(lanes, **i64)  # (L,)
        self.query_lens = torch.zeros(lanes, **i64)  # (L,)
        self.context_lens = torch.zeros(lanes, **i64)  # (L,)
        self.page_tables = torch.full((lanes, max_pages), -1, **i64)  # (L, P)
        self.logits_indices = torch.zeros(lanes, **i64)  # (L,)
        self.temperature = torch.zeros(lanes, **f32)  # (L,)
        self.top_p = torch.ones(lanes, **f32)  # (L,)
        self.top_k = torch.full((lanes,), -1, **i64)  # (L,)
        self.seed = torch.zeros(lanes, **i64)  # (L,)
        self.step = torch.zeros(lanes, **i64)  # (L,)
        self.out_tokens = torch.zeros(lanes, **i64)  # (L,)
        self.max_pages = max_pages


class PreparedProgram:
    def __init__(
        self,
        desc: GraphDescriptor,
        model: LlamaForCausalLM,
        buffers: StaticBuffers,
        page_size: int,
    ) -> None:
        self.desc = desc
        self.shape = ProgramShape.of(desc)
        self.model = model
        self.buffers = buffers
        self.page_size = page_size
        self.device = buffers.input_ids.device
        self.graph: torch.cuda.CUDAGraph | None = None
        # Page-table columns the body reads.  A captured graph reads them all;
        # an eager run reads only as many as this frame's longest context needs,
        # so the reference attention's cost follows the context, not max_context.
        self.active_pages = buffers.max_pages

    # -- the program body, over views of the static buffers ---------------------
    def _body(self) -> None:
        b, n, lanes = self.buffers, self.shape.tokens, self.shape.lanes
        meta = AttentionMetadata(
            query_start=b.query_start[:lanes],
            query_lens=b.query_lens[:lanes],
            context_lens=b.context_lens[:lanes],
            page_tables=b.page_tables[:lanes, : self.active_pages],
            slot_mapping=b.slot_mapping[:n],
            max_query_len=self.shape.max_query_len,
        )
        logits = self.model(b.input_ids[:n], b.positions[:n], meta, b.logits_indices[:lanes])
        params = SamplingBatch(
            b.temperature[:lanes], b.top_p[:lanes], b.top_k[:lanes], b.seed[:lanes], b.step[:lanes]
        )
        b.out_tokens[:lanes].copy_(sample(logits, params))  # (L,)

    def capture(self, pool: object | None = None) -> object | None:
        """CUDA: capture the body as a graph (returns its memory pool). CPU: no-op."""
        if self.device.type != "cuda":
            return None
        self._fill([])  # a valid all-padding input
        self.active_pages = self.buffers.max_pages
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
    def _fill(self, inputs: list[LaneInput]) -> None:
        """Pack ``inputs`` into the static buffers (host lists, one copy per field)."""
        shape, b, page_size = self.shape, self.buffers, self.page_size
        n, lanes = shape.tokens, shape.lanes
        if len(inputs) > lanes:
            raise ProgramError(f"{len(inputs)} lanes for {lanes} rows")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        longest = 1
        for i in inputs:
            q = len(i.tokens)
            ctx = i.start_position + q
            if q > shape.max_query_len or ctx > len(i.page_table) * page_size:
                raise ProgramError(f"slot {i.slot}: {q} tokens at {i.start_position} do not fit")
            if len(i.page_table) > b.max_pages:
                raise ProgramError(f"slot {i.slot}: {len(i.page_table)} pages > {b.max_pages}")
            starts.append(len(ids))
            q_lens.append(q)
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
        pad_tokens, pad_lanes = n - used, lanes - len(inputs)
        ids += [0] * pad_tokens
        positions += [0] * pad_tokens
        slots += [-1] * pad_tokens  # padding writes nothing
        last = [s + q - 1 for s, q in zip(starts, q_lens)] + [0] * pad_lanes
        starts += [used] * pad_lanes
        q_lens += [0] * pad_lanes  # inactive lanes
        ctx_lens += [0] * pad_lanes
        pages = b.max_pages if self.graph is not None else -(-longest // page_size)
        tables = [list(i.page_table[:pages]) + [-1] * (pages - len(i.page_table)) for i in inputs]
        tables += [[-1] * pages] * pad_lanes
        rows = [(i.sampling.temperature, i.sampling.top_p) for i in inputs]
        rows += [(0.0, 1.0)] * pad_lanes
        ints = [(i.sampling.top_k, i.sampling.seed, i.step) for i in inputs]
        ints += [(-1, 0, 0)] * pad_lanes

        nb = self.device.type == "cuda"

        def put(dst: torch.Tensor, values, dtype=torch.int64) -> None:
            dst.copy_(torch.tensor(values, dtype=dtype), non_blocking=nb)

        put(b.input_ids[:n], ids)
        put(b.positions[:n], positions)
        put(b.slot_mapping[:n], slots)
        put(b.query_start[:lanes], starts)
        put(b.query_lens[:lanes], q_lens)
        put(b.context_lens[:lanes], ctx_lens)
        put(b.page_tables[:lanes, :pages], tables)
        put(b.logits_indices[:lanes], last)
        floats = torch.tensor(rows, dtype=torch.float32)  # (L, 2)
        b.temperature[:lanes].copy_(floats[:, 0], non_blocking=nb)
        b.top_p[:lanes].copy_(floats[:, 1], non_blocking=nb)
        packed = torch.tensor(ints, dtype=torch.int64)  # (L, 3)
        b.top_k[:lanes].copy_(packed[:, 0], non_blocking=nb)
        b.seed[:lanes].copy_(packed[:, 1], non_blocking=nb)
        b.step[:lanes].copy_(packed[:, 2], non_blocking=nb)
        self.active_pages = pages

    def run(self, inputs: list[LaneInput]) -> tuple[list[int], int]:
        """Execute for ``inputs``; returns (one sampled token per lane, device ns)."""
        self._fill(inputs)
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
            self._body()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            device_ns = time.perf_counter_ns() - t0
        tokens = self.buffers.out_tokens[: len(inputs)].tolist()
        return tokens, max(1, device_ns)


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
    buffers = StaticBuffers(
        max(s.tokens for s in shapes), max(s.lanes for s in shapes), max_pages, device
    )
    programs = {d.key: PreparedProgram(d, model, buffers, page_size) for d in catalog}
    order = sorted(programs.values(), key=lambda p: (p.shape.tokens, p.shape.lanes), reverse=True)
    pool = None
    for program in progress(order) if progress else order:
        if capture:
            pool = program.capture(pool)
    return programs
