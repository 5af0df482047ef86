"""Prepared programs: fixed-shape forward + sampling over persistent input arenas.

Graph capture is one component (STYLE.md).  Each program owns one small
integer arena on the device (:class:`~runtime.ranks.arena.FrameInputs`: per
lane its slot, query length, start position, step, commit row, whether its
token is the slot's pending one and the penalty row it resets; per token the
prompt ids), refilled by one copy of the used slice per frame.  Everything
that persists across frames lives in the rank's
:class:`~runtime.ranks.arena.SlotArena` (page tables, pending tokens,
sampling settings) and is gathered by slot inside the body, so positions,
slot mappings and page tables are derived on the device and the host packs a
handful of numbers per lane, whatever the context length.

The sampled token of every committing lane is written into the slot's pending
row on the device (the next decode frame reads it there) and into the shared
output buffers (:class:`~runtime.ranks.outputs.ProgramOutputs`), from which a
non-blocking copy into host staging, completed by an event, serves
publication only.

* CUDA: each variant is captured with ``torch.cuda.CUDAGraph`` (largest first,
  one memory pool) and timed with CUDA events around the replay.
* CPU: the same body runs eagerly, synchronously, timed with
  ``perf_counter_ns``, over page tables trimmed to the frame's longest lane
  and over the frame's own lanes and packed tokens (the padding of the
  program's shape is inert, so it is not computed).

A program's shape and its sampling variants: :mod:`runtime.ranks.shapes`.

A vision model's prompt programs (prefill, scored prefill, mixed) also take,
after the arena's other fields, each packed token's feature-store row (the
frame's ``feature_rows``, -1: its embedding) and pass the store to the model
(:mod:`runtime.ranks.vision_programs`); its VISION programs are
:class:`~runtime.ranks.vision_programs.VisionProgram`, captured here with the
others.  A text-only model's arenas and bodies are unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from runtime.catalog import PROMPT_KINDS, GraphDescriptor, GraphKind
from runtime.ranks.arena import LANE_FIELDS, FrameInputs, SlotArena, int_size
from runtime.ranks.checked_frame import CheckedFrame
from runtime.ranks.draft import DraftContext
from runtime.ranks.frame_packing import pack_frame
from runtime.ranks.launch import Launch
from runtime.ranks.model.attention import AttentionMetadata
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.model.parallel import RELEASE
from runtime.ranks.outputs import HostOutputs, ProgramOutputs
from runtime.ranks.proposals import ProposerConfig
from runtime.ranks.sampling import (
    LogitAdjustments,
    SamplingBatch,
    sample,
    token_logprobs,
)
from runtime.ranks.shapes import SCORE_ROWS, VARIANTS, ProgramError, ProgramShape
from runtime.ranks.speculative import SpeculativeStages
from runtime.ranks.vision_programs import FeatureStore, VisionProgram


class PreparedProgram:
    """One descriptor's program: its input arena, its body, its captured variants."""

    def __init__(
        self,
        desc: GraphDescriptor,
        model: LlamaForCausalLM,
        outputs: ProgramOutputs,
        slots: SlotArena,
        page_size: int,
        draft: DraftContext | None = None,
        proposer: ProposerConfig | None = None,
        store: FeatureStore | None = None,
    ) -> None:
        self.desc = desc
        self.shape = ProgramShape.of(desc)
        self.draft = draft
        if desc.kind is GraphKind.SPECULATIVE and desc.token_capacity == 1:
            raise ProgramError(f"{desc.describe()}: width-one rounds are ordinary decode programs")
        self.model = model
        self.outputs = outputs  # shared by every program
        self.slots = slots  # shared by every program
        self.page_size = page_size
        self.max_pages = slots.max_pages
        self.device = outputs.tokens.device
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        n, lanes = self.shape.tokens, self.shape.lanes
        self.int_size = int_size(n, lanes)
        # A scored prefill's lanes also send the prompt token after their chunk
        # (the frame's score_next), after the arena's other fields.
        self.score_at = self.int_size
        if self.shape.scored:
            self.int_size += lanes
        # A vision model's prompt program: each packed token's feature-store row
        # (the frame's feature_rows), after those.  None: no tail, no features.
        speculative = desc.kind is GraphKind.SPECULATIVE or bool(desc.proposal_depth)
        prompt = desc.kind in PROMPT_KINDS and not speculative
        self.store = store if prompt else None
        self.feature_at = self.int_size
        if self.store is not None:
            self.int_size += n
        self._ints = torch.zeros(self.int_size, dtype=torch.int64, device=self.device)
        self.inputs = FrameInputs.over(self._ints, n, lanes)
        self.vocab = model.config.vocab_size
        self._token_index = torch.arange(n, device=self.device)  # (N,)
        self.speculative: SpeculativeStages | None = None
        if desc.kind is GraphKind.SPECULATIVE or (
            desc.kind is GraphKind.MIXED and desc.proposal_depth
        ):
            if proposer is None:
                raise ProgramError(f"{desc.describe()}: a speculative program needs a proposer")
            self.speculative = SpeculativeStages(
                desc, model, draft, proposer, outputs.eos, self.device
            )

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    # -- the program body, over the input views ---------------------------------
    def _view(self, lanes: int, tokens: int) -> FrameInputs:
        """The input arena's first ``lanes`` lanes and ``tokens`` tokens: an eager
        frame's extent (the views of :attr:`inputs`, trimmed; the rest of the
        arena is padding, which writes nothing but the scratch row)."""
        if lanes == self.shape.lanes and tokens == self.shape.tokens:
            return self.inputs
        x = self.inputs
        return FrameInputs(
            *(getattr(x, name)[:lanes] for name in LANE_FIELDS),
            x.prefill_row,
            x.input_ids[:tokens],
        )

    def _body(self, variant: str, width: int, lanes: int = 0, extent: int = 0) -> None:
        """Forward and sampling for ``variant``, page tables ``width`` columns wide.

        ``lanes``/``extent`` (eager CPU frames): run only the frame's first lanes
        and ``extent`` packed tokens (0: the program's whole shape, as captured).  Padding
        lanes and tokens are inert, so the result is the padded run's without
        computing the padding."""
        if self.speculative is not None:
            self.speculative.run(self, variant, width)
            return
        shape, out, arena = self.shape, self.outputs, self.slots
        lanes, extent = lanes or shape.lanes, extent or shape.tokens
        x = self._view(lanes, extent)
        page_size = self.page_size
        rows = x.state_row  # (L,) each lane's slot row
        q_lens = x.query_lens  # (L,)
        # A lane continuing from its pending token starts where the slot's last
        # program left it (a speculative round's end is known only on the device).
        from_pending = x.from_pending > 0  # (L,)
        start_pos = torch.where(from_pending, arena.next_pos.index_select(0, rows), x.start_pos)
        step = torch.where(from_pending, arena.steps.index_select(0, rows), x.step)
        ends = torch.cumsum(q_lens, 0)  # (L,)
        query_start = ends - q_lens  # (L,)
        context = torch.where(q_lens > 0, start_pos + q_lens, 0)  # (L,)
        n = self._token_index[:extent]  # (N,)
        lane = torch.searchsorted(ends, n, right=True)  # (N,) in [0, L]; L = padding
        valid = lane < lanes
        lane = lane.clamp(max=lanes - 1)
        # index_select rather than advanced indexing: the same gather, a cheaper op.
        start = start_pos.index_select(0, lane) - query_start.index_select(0, lane)
        positions = torch.where(valid, start + n, 0)  # (N,)
        pending = valid & from_pending.index_select(0, lane)
        token_rows = rows.index_select(0, lane)  # (N,)
        pending_ids = arena.pending.index_select(0, token_rows)
        input_ids = torch.where(pending, pending_ids, x.input_ids)  # (N,)
        if arena.history is not None:  # every fed token at its position (the prompt's)
            h = arena.history_width
            flat = torch.where(valid, token_rows, arena.scratch) * h + positions.clamp(max=h - 1)
            arena.history.view(-1).index_copy_(0, flat, input_ids)
        tables = arena.page_tables[:, :width].index_select(0, rows)  # (L, width)
        column = (positions // page_size).clamp(max=width - 1)
        page = tables.view(-1).index_select(0, lane * width + column)  # (N,)
        slot_mapping = torch.where(valid, page * page_size + positions % page_size, -1)  # (N,)
        meta = AttentionMetadata(
            query_start=query_start,
            query_lens=q_lens,
            context_lens=context,
            page_tables=tables,
            slot_mapping=slot_mapping,
            max_query_len=shape.max_query_len,
            prefill_row=x.prefill_row if shape.mixed else None,
            row_query_len=shape.row_query_len,
        )
        last = (ends - 1).clamp(0, extent - 1)  # (L,) each lane's last new token
        image: dict[str, torch.Tensor] = {}
        if self.store is not None:  # each token's feature row, -1: its embedding
            rows = self._ints[self.feature_at : self.feature_at + extent]  # (N,)
            image = {"image_rows": rows, "features": self.store.features}
        if shape.scored:  # logits at every packed token: score them, then sample the last
            every = self.model(input_ids, positions, meta, n, **image)  # (N, V)
            self._score(every, input_ids, ends, lane, valid, lanes)
            logits = every.index_select(0, last).float()  # (L, V)
        else:
            logits = self.model(input_ids, positions, meta, last, **image).float()  # (L, V)
        if self.draft is not None:  # the draft's context follows the target's
            self.draft.feed(input_ids, positions, meta)
        if variant == "argmax":
            tokens = logits.argmax(dim=-1)  # (L,)
        else:
            tokens = self._sample(logits, input_ids, step, lane, valid, x)
            if variant == "logprobs":
                chosen, top_values, top_ids = token_logprobs(logits, tokens, out.max_logprobs)
                out.logprob[:lanes].copy_(chosen)
                out.top_logprobs[:lanes].copy_(top_values)
                out.top_ids[:lanes].copy_(top_ids)
        arena.pending.index_copy_(0, x.count_row, tokens)  # the next decode frame's input
        arena.next_pos.index_copy_(0, x.count_row, start_pos + q_lens)
        arena.steps.index_copy_(0, x.count_row, step + 1)
        if arena.history is not None:
            h = arena.history_width
            at = (start_pos + q_lens).clamp(max=h - 1)
            arena.history.view(-1).index_copy_(0, x.count_row * h + at, tokens)
        out.tokens[:lanes].copy_(tokens)

    def _score(
        self,
        every: torch.Tensor,
        input_ids: torch.Tensor,
        ends: torch.Tensor,
        lane: torch.Tensor,
        valid: torch.Tensor,
        lanes: int,
    ) -> None:
        """A scored prefill's prompt log probabilities: for every packed token, the
        fp32 log-softmax of its logits at the next prompt token (the next packed
        token of its lane, or after the chunk's last token the lane's
        ``score_next``; 0 where there is none) and the top-K, written to the
        outputs' score rows, :data:`SCORE_ROWS` tokens at a time.  ``every``
        (N, V) the logits of every packed token; ``ends`` (L,) the lanes' packed
        ends; ``lane``/``valid`` (N,) each token's lane and whether it has one."""
        out = self.outputs
        extent = every.shape[0]
        score_next = self._ints[self.score_at : self.score_at + lanes]  # (L,)
        index = self._token_index[:extent]
        inside = index + 1 < ends.index_select(0, lane)  # (N,) the next token is packed
        target = torch.where(inside, input_ids.roll(-1), score_next.index_select(0, lane))
        scored = valid & (target >= 0)
        target = torch.where(scored, target, 0)  # (N,)
        k = out.max_logprobs
        for s in range(0, extent, SCORE_ROWS):
            e = min(extent, s + SCORE_ROWS)
            logp = torch.log_softmax(every[s:e].float(), dim=-1)  # (S, V)
            chosen = logp.gather(1, target[s:e, None]).squeeze(1)  # (S,)
            out.score_logprob[s:e].copy_(torch.where(scored[s:e], chosen, 0.0))
            top_values, top_ids = logp.topk(k, dim=-1, largest=True, sorted=True)  # (S, K)
            out.score_top[s:e].copy_(top_values)
            out.score_ids[s:e].copy_(top_ids)

    def _sample(
        self,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        step: torch.Tensor,
        lane: torch.Tensor,
        valid: torch.Tensor,
        x: FrameInputs | None = None,
    ) -> torch.Tensor:
        """The full sampler, with the penalty state: each prompt lane's row is reset
        when it starts a generation and its tokens marked before sampling (so a
        first token sees its whole prompt), every committed token counted after.
        ``lane``/``valid`` (N,): each packed token's lane (clamped) and whether
        it belongs to one.  ``x``: the frame's inputs (default :attr:`inputs`)."""
        x = self.inputs if x is None else x
        out = self.outputs
        state = out.penalties
        if self.desc.prompt_capacity:  # only programs with prompt capacity take prompt lanes
            state.reset(self._reset_rows(x))
            state.mark_prompt(self._prompt_rows(lane, valid, state.scratch, x), input_ids)
        s = self.slots.settings(x.state_row)
        counts, prompt_mask = state.gather(x.state_row)  # (L, V) each
        adjustments = LogitAdjustments(
            s["bias_ids"],
            s["bias_values"],
            s["presence_penalty"],
            s["frequency_penalty"],
            s["repetition_penalty"],
            counts,
            prompt_mask,
        )
        params = SamplingBatch(
            s["temperature"],
            s["top_p"],
            s["top_k"],
            s["seed"],
            step,
            s["min_tokens"],
            adjustments,
        )
        tokens = sample(logits, params, out.eos)  # (L,)
        state.count(x.count_row, tokens)
        return tokens

    def _token_lanes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lane (N,): each packed token's lane, clamped to L - 1; valid (N,):
        whether the token belongs to a lane): lane ``i`` owns the tokens from the
        prefix sum of the query lengths before it."""
        ends = torch.cumsum(self.inputs.query_lens, 0)  # (L,)
        lane = torch.searchsorted(ends, self._token_index, right=True)  # (N,) L = padding
        return lane.clamp(max=self.shape.lanes - 1), lane < self.shape.lanes

    def _reset_rows(self, x: FrameInputs | None = None) -> torch.Tensor:
        """The penalty rows a program with prompt capacity resets: every lane's
        ``reset_row`` in a prefill program (each lane may be a prompt row), the
        prompt row's alone in a mixed one ((1,): its other lanes never reset)."""
        x = self.inputs if x is None else x
        if self.shape.mixed:
            return x.reset_row.index_select(0, x.prefill_row.clamp(min=0))  # (1,)
        return x.reset_row  # (L,)

    def _prompt_rows(
        self,
        lane: torch.Tensor,
        valid: torch.Tensor,
        scratch: int,
        x: FrameInputs | None = None,
    ) -> torch.Tensor:
        """(N,) the penalty-state row each packed token marks as a prompt token:
        its lane's slot for the tokens of a prompt lane (one not continuing from
        its pending token), ``scratch`` for every other token.  ``lane``/``valid``:
        :meth:`_token_lanes`; ``x``: the frame's inputs (default :attr:`inputs`)."""
        x = self.inputs if x is None else x
        prompt = valid & (x.from_pending.index_select(0, lane) == 0)  # (N,)
        return torch.where(prompt, x.state_row.index_select(0, lane), scratch)

    def capture(self, pool: object | None = None) -> object | None:
        """CUDA: capture every variant as a graph (returns the memory pool). CPU: no-op."""
        if self.device.type != "cuda":
            return None
        self._pad()
        for variant in VARIANTS:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: allocator, autotuning, lazy init
                    self._body(variant, self.max_pages)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._body(variant, self.max_pages)
            self.graphs[variant] = graph
            pool = graph.pool()
        return pool

    def _pad(self) -> None:
        """Every lane padding (used before capture: inert rows, scratch writes)."""
        scratch = self.slots.scratch
        host = torch.zeros(self.int_size, dtype=torch.int64)
        views = FrameInputs.over(host, self.shape.tokens, self.shape.lanes)
        for row in (views.state_row, views.count_row, views.reset_row):
            row.fill_(scratch)
        views.prefill_row.fill_(-1)
        host[self.feature_at :].fill_(-1)  # a vision model's feature rows: none
        self._ints.copy_(host)

    # -- one frame ---------------------------------------------------------------
    def pack(
        self, checked: CheckedFrame, a: np.ndarray, memo: list | None = None
    ) -> tuple[int, int]:
        """Pack ``checked`` into the host int64 array ``a``: :func:`pack_frame`."""
        return pack_frame(self, checked, a, memo)

    def launch(
        self,
        checked: CheckedFrame,
        packed: torch.Tensor,
        used: int,
        width: int,
        host: HostOutputs,
        variant: str,
    ) -> Launch:
        """Copy the first ``used`` entries of the packed host arena ``packed`` (see
        :meth:`pack`) and start ``variant``; on CPU the frame also runs to the end."""
        launch = Launch(checked, self, variant, host, time.perf_counter_ns())
        r = checked.lanes
        self._ints[:used].copy_(packed[:used], non_blocking=True)
        spec = self.speculative
        if self.device.type != "cuda":
            # Eager: the frame's own extent, its lanes and their packed tokens
            # (no padding computed; a speculative round keeps its shape).
            extent = max(1, int(checked.query_len.sum()))
            RELEASE.arm()
            t0 = time.perf_counter_ns()
            self._body(variant, width, r, min(extent, self.shape.tokens))
            launch.device_ns = time.perf_counter_ns() - t0
            launch.launch_wait_ns = min(RELEASE.take(), launch.device_ns)
            if spec is not None:
                launch.round = spec.copy_out(r, variant)
                return launch
            host.tokens[:r].copy_(self.outputs.tokens[:r])
            if variant == "logprobs":
                self._copy_logprobs(host, r)
            if self.shape.scored:
                self._copy_scores(host, extent)
            return launch
        launch.start = torch.cuda.Event(enable_timing=True)
        launch.end = torch.cuda.Event(enable_timing=True)
        launch.done = torch.cuda.Event()
        launch.start.record()
        graph = self.graphs.get(variant)
        if graph is not None:
            graph.replay()
        else:  # eager CUDA (capture disabled)
            self._body(variant, width)
        launch.end.record()
        if spec is not None:
            launch.round = spec.copy_out(r, variant)
        else:
            host.tokens[:r].copy_(self.outputs.tokens[:r], non_blocking=True)
            if variant == "logprobs":
                self._copy_logprobs(host, r)
            if self.shape.scored:
                self._copy_scores(host, int(checked.query_len.sum()))
        launch.done.record()
        return launch

    def _copy_logprobs(self, host: HostOutputs, r: int) -> None:
        out = self.outputs
        blocking = self.device.type == "cuda"
        host.logprob[:r].copy_(out.logprob[:r], non_blocking=blocking)
        host.top_logprobs[:r].copy_(out.top_logprobs[:r], non_blocking=blocking)
        host.top_ids[:r].copy_(out.top_ids[:r], non_blocking=blocking)

    def _copy_scores(self, host: HostOutputs, t: int) -> None:
        """A scored prefill's first ``t`` score rows (the frame's packed tokens)."""
        out = self.outputs
        blocking = self.device.type == "cuda"
        host.score_logprob[:t].copy_(out.score_logprob[:t], non_blocking=blocking)
        host.score_top[:t].copy_(out.score_top[:t], non_blocking=blocking)
        host.score_ids[:t].copy_(out.score_ids[:t], non_blocking=blocking)


def prepare_programs(
    catalog: Iterable[GraphDescriptor],
    model: LlamaForCausalLM,
    slots: SlotArena,
    page_size: int,
    *,
    capture: bool = True,
    progress: Callable[[Iterable], Iterable] | None = None,
    draft: DraftContext | None = None,
    proposer: ProposerConfig | None = None,
    store: FeatureStore | None = None,
    vision: Iterable[VisionProgram] = (),
) -> tuple[dict[tuple, PreparedProgram], ProgramOutputs]:
    """One program per descriptor over shared buffers; captured largest first.
    With a ``draft``, every program also feeds it (runtime/ranks/draft.py);
    speculative descriptors need a ``proposer``.  ``store``: a vision model's
    feature store (its prompt programs read it); ``vision``: its VISION
    programs (built by the caller, not in the returned dict), captured after
    the others in the same memory pool; VISION descriptors are skipped."""
    catalog = [d for d in catalog if d.kind is not GraphKind.VISION]
    shapes = [ProgramShape.of(d) for d in catalog]
    device = model.model.embed_tokens.weight.device
    scored = max((s.tokens for s in shapes if s.scored), default=0)
    outputs = ProgramOutputs.allocate(max(s.lanes for s in shapes), model, device, scored)
    programs = {
        d.key: PreparedProgram(d, model, outputs, slots, page_size, draft, proposer, store)
        for d in catalog
    }
    order = sorted(programs.values(), key=lambda p: (p.shape.tokens, p.shape.lanes), reverse=True)
    pool = None
    for program in progress(order) if progress else order:
        if capture:
            pool = program.capture(pool)
    for encoder in vision:
        if capture:
            pool = encoder.capture(pool)
    return programs, outputs
