"""Complete speculative programs (spec, "Speculative graph coverage", "Completed
confidence and acceptance"): proposals, confidence, prefix allocation,
verification and the accepted-state commit, as one program.

A program (B, W, D, P) runs B lanes, each continuing from its pending token at
the position the slot's last program left on the device
(:attr:`~runtime.ranks.arena.SlotArena.next_pos`), in stages:

1. **Proposals**, D per lane.  Learned (``draft``): the draft model feeds the
   pending token and then each proposal (:mod:`runtime.ranks.draft`), and
   each proposal is drawn from the draft's final sampling distribution q
   (after the request's logit bias, penalties, ``min_tokens`` mask,
   temperature, top-k and top-p; a greedy request's q is a point mass on the
   draft's argmax) by the inverse CDF at a counter-based uniform.  Copied
   (``copy``): :func:`copy_proposals` looks the slot's last n tokens up in its
   own history (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
   and proposes what followed the latest earlier occurrence, q a point mass.
2. **Confidence**, FP32 [2, B, D]: plane 0 the conditional confidence of each
   proposal (its probability under the draft's distribution before the greedy
   collapse: at temperature 1 for a greedy request; 1 for a copied token, 0
   where the history had nothing to copy), plane 1 the joint prefix
   probability, the running product.  ``confidence_width`` = D.
3. **Allocation**: an exact program reads each lane's query length from the
   frame; a prefix-limit (device-allocated) program reads each lane's ceiling
   and allocates its P rows from plane 1 (kernels/reference/prefix_allocation.py on CPU,
   kernels/triton/prefix_allocation.py on CUDA), the coordinator's own rule,
   so every rank computes the same lengths from the same (all-reduced)
   logits: no broadcast is needed, and ``--check-ranks`` compares them.
4. **Verification**: one target forward over every lane's pending token and
   its first ``q - 1`` proposals, packed into the P rows; p at each position
   is the target's final sampling distribution with the penalty counts and
   step of the tokens before it; rejection sampling
   (kernels/reference/speculative_verify.py, kernels/triton/speculative_verify.py) accepts a
   prefix and draws the correction or bonus token.  Uniforms are the hash
   stream of (seed, step + j), so a seeded request's output depends on the
   widths its rounds had (docs/speculation.md).
5. **Commit**: the emitted tokens (accepted + 1, cut after the first EOS) become
   the slot's history, penalty counts, step and pending token; the next
   position advances by the emitted count.  KV the target wrote for rejected
   positions lies past the lane's new context, is never attended to, and the
   next program overwrites it.

Outputs per lane: up to W tokens and their count, raw log probabilities of
each, the confidence sidecar and survival rows (cumulative products of
min(1, p/q) over the offered prefixes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.reference.prefix_allocation import prefix_allocation_reference
from kernels.reference.speculative_verify import verify_reference
from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.arena import FrameInputs, SlotArena
from runtime.ranks.draft import DraftContext, pack_lanes
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.proposals import (
    ProposerConfig,
    copy_proposals,
    draft_proposals,
    round_distribution,
)
from runtime.ranks.sampling import (
    PenaltyState,
    uniform_noise,
)
from runtime.transport.sampling import MAX_LOGPROBS


@dataclass
class RoundOutputs:
    """A speculative round's results on the host (pinned on CUDA; valid once the
    launch finished), for its R lanes: ``tokens`` (R, K + 1) the emitted tokens
    (-1 after ``counts``), ``counts`` (R,), ``confidence`` (2, R, D),
    ``survival`` (R, K), and with log probabilities ``logprob`` (R, K + 1),
    ``top_ids`` / ``top_logprobs`` (R, K + 1, top)."""

    tokens: torch.Tensor
    counts: torch.Tensor
    confidence: torch.Tensor
    survival: torch.Tensor
    logprob: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class RoundLanes:
    """A speculative round's lanes as its stages read them
    (:meth:`SpeculativeStages._lanes`): L lanes, V the vocabulary."""

    program: Any  # the owning PreparedProgram
    x: FrameInputs  # its input views
    arena: SlotArena
    device: torch.device
    rows: torch.Tensor  # (L,) each lane's slot row
    lengths: torch.Tensor  # (L,) query lengths, ceilings, or the prompt row's chunk
    active: torch.Tensor  # (L,) bool
    verifying: torch.Tensor  # (L,) bool: the lanes that verify proposals
    prompt: torch.Tensor  # (L,) bool: at most one, a wide mixed program's prompt row
    start: torch.Tensor  # (L,) the position each lane continues from
    step: torch.Tensor  # (L,) its sampling step
    pending: torch.Tensor  # (L,) its pending token
    greedy_only: bool  # the argmax variant: every lane greedy, nothing adjusted
    s: dict[str, torch.Tensor]  # the lanes' sampling settings
    penalty: PenaltyState
    chunk: torch.Tensor | None  # (L, C) the prompt row's tokens (mixed programs)
    counts: torch.Tensor  # (L, V) penalty counts
    prompt_mask: torch.Tensor  # (L, V)
    held: torch.Tensor  # (L,) positions a lane may write (its table's pages)


class SpeculativeStages:
    """The stages of one speculative program's body (module docstring), over the
    rank's shared state; :class:`~runtime.ranks.programs.PreparedProgram` calls
    :meth:`run` for SPECULATIVE descriptors."""

    def __init__(
        self,
        desc: GraphDescriptor,
        model: LlamaForCausalLM,
        draft: DraftContext | None,
        proposer: ProposerConfig,
        eos: torch.Tensor,
        device: torch.device,
    ) -> None:
        if proposer.kind == "draft" and draft is None:
            raise ValueError(f"{desc.describe()}: learned proposals need a draft model")
        self.desc = desc
        self.model = model
        self.draft = draft if proposer.kind == "draft" else None
        self.proposer = proposer
        self.eos = eos
        lanes, width, depth = desc.batch_capacity, desc.token_capacity, desc.proposal_depth
        self.depth = depth
        self.verify_width = min(width - 1, depth)  # K: proposals a lane can offer
        self.rows = desc.target_capacity  # packed rows (mixed: C + (B - 1) x W)
        if desc.kind is GraphKind.MIXED:
            self.rows = desc.prompt_capacity + (lanes - 1) * width
        # A wide mixed program: one prompt row beside the verifying lanes.
        self.mixed = desc.kind is GraphKind.MIXED
        vocab = model.config.vocab_size
        k = self.verify_width
        self.tokens = torch.zeros(lanes, k + 1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(lanes, dtype=torch.int64, device=device)
        self.confidence = torch.zeros(2, lanes, depth, dtype=torch.float32, device=device)
        self.survival = torch.zeros(lanes, k, dtype=torch.float32, device=device)
        self.logprob = torch.zeros(lanes, k + 1, dtype=torch.float32, device=device)
        top = min(MAX_LOGPROBS, vocab)
        self.top_ids = torch.zeros(lanes, k + 1, top, dtype=torch.int64, device=device)
        self.top_logprobs = torch.zeros(lanes, k + 1, top, dtype=torch.float32, device=device)

    def copy_out(self, lanes: int, variant: str) -> RoundOutputs:
        """Host copies of the first ``lanes`` rows of the outputs (non-blocking on
        CUDA: read them after the launch's event)."""
        cuda = self.tokens.device.type == "cuda"

        def host(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
            out.copy_(t, non_blocking=cuda)
            return out

        logprobs = variant == "logprobs"
        return RoundOutputs(
            tokens=host(self.tokens[:lanes]),
            counts=host(self.counts[:lanes]),
            confidence=host(self.confidence[:, :lanes]),
            survival=host(self.survival[:lanes]),
            logprob=host(self.logprob[:lanes]) if logprobs else None,
            top_ids=host(self.top_ids[:lanes]) if logprobs else None,
            top_logprobs=host(self.top_logprobs[:lanes]) if logprobs else None,
        )

    # -- the body ----------------------------------------------------------------
    def run(self, program, variant: str, width: int) -> None:
        """The program body; ``program`` is the owning PreparedProgram."""
        r = self._lanes(program, variant, width)
        proposals, q, joint = self._propose(r, width)

        # 3. allocation: query lengths (L,), at most K + 1.
        if self.desc.device_allocated:
            q_lens = self._allocate(joint, r.lengths, r.rows, r.active)
        else:
            q_lens = r.lengths
        q_lens = torch.where(r.verifying, q_lens.clamp(1, self.verify_width + 1), 0)

        lane_logits, drafted = self._verify_forward(r, proposals, q_lens, width)
        accepted, emitted, survival = self._verify(r, lane_logits, drafted, q, q_lens)
        tokens = self._commit(r, accepted, emitted, survival)
        if variant == "logprobs":
            self._logprobs(lane_logits, tokens)

    def _lanes(self, program, variant: str, width: int) -> RoundLanes:
        """The frame's lanes as the stages read them; a wide mixed program's prompt
        row's tokens into the slot's history and, unless the round is greedy-only,
        its penalty row reset and its prompt marked."""
        x, arena, out = program.inputs, program.slots, program.outputs
        device = x.state_row.device
        rows = x.state_row  # (L,)
        lengths = x.query_lens  # (L,) query lengths, ceilings, or the prompt row's chunk
        active = lengths > 0  # (L,)
        # A wide mixed program's prompt row (prefill_row) continues its prompt from
        # the frame's position; every other lane from its pending token.
        from_pending = x.from_pending > 0  # (L,)
        verifying = active & from_pending  # (L,) the lanes that verify proposals
        prompt = active & ~from_pending  # (L,) at most one: the prompt row
        start = torch.where(from_pending, arena.next_pos.index_select(0, rows), x.start_pos)
        step = torch.where(from_pending, arena.steps.index_select(0, rows), x.step)
        pending = arena.pending.index_select(0, rows)  # (L,)
        greedy_only = variant == "argmax"
        s = program.slots.settings(rows)
        penalty = out.penalties
        chunk = None
        if self.mixed:
            ends = torch.cumsum(lengths, 0)
            chunk = self._chunk(x, ends - lengths, prompt)  # (L, C) the prompt row's tokens
            if arena.history is not None:  # the prompt's tokens at their positions
                h = arena.history_width
                c = torch.arange(chunk.shape[1], device=device)[None, :]
                inside = prompt[:, None] & (c < lengths[:, None])
                at = torch.where(inside, rows[:, None], arena.scratch) * h + (
                    start[:, None] + c
                ).clamp(max=h - 1)
                arena.history.view(-1).index_copy_(0, at.reshape(-1), chunk.reshape(-1))
            if not greedy_only:  # a new generation's penalty row, its prompt marked
                penalty.reset(program._reset_rows())
                penalty.mark_prompt(
                    program._prompt_rows(*program._token_lanes(), penalty.scratch), x.input_ids
                )
        counts, prompt_mask = penalty.gather(rows)  # (L, V) each
        # Page capacity: positions a lane may write (its table's pages).
        page_size = program.page_size
        held = (arena.page_tables[:, :width].index_select(0, rows) >= 0).sum(dim=1) * page_size
        return RoundLanes(
            program, x, arena, device, rows, lengths, active, verifying, prompt, start, step,
            pending, greedy_only, s, penalty, chunk, counts, prompt_mask, held,
        )  # fmt: skip

    def _propose(
        self, r: RoundLanes, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """1-2. (proposals (L, D), their distributions q (L, D, V), the joint prefix
        probabilities (L, D)); the confidence planes (conditional, joint) into
        :attr:`confidence`."""
        arena, lanes, depth = r.arena, self.desc.batch_capacity, self.depth
        page_size = r.program.page_size
        vocab = r.counts.shape[1]
        if self.mixed and self.draft is not None:  # the prompt row feeds the draft too
            fed = pack_lanes(
                arena, r.rows, r.start, torch.where(r.prompt, r.lengths, 0), self.rows, width,
                page_size, r.chunk.shape[1], ids=r.chunk,
            )  # fmt: skip
            self.draft.feed(fed.input_ids, fed.positions, fed.meta)
        if self.draft is None:
            assert arena.history is not None
            history = arena.history.index_select(0, r.rows)
            proposals = copy_proposals(
                history, r.start, depth, self.proposer.prompt_lookup_min,
                self.proposer.prompt_lookup_max,
            )  # fmt: skip
            conditional = (proposals >= 0).float()
            q = torch.zeros(lanes, depth, vocab, device=r.device)
            q.scatter_(2, proposals.clamp(min=0)[:, :, None], conditional[:, :, None])
        else:
            proposals, q, conditional = draft_proposals(
                self.draft, depth, self.eos, arena, r.rows, r.start, r.step, r.pending,
                r.verifying, r.held, r.s, r.counts, r.prompt_mask, width, page_size,
                r.greedy_only,
            )  # fmt: skip
        conditional = conditional * r.verifying[:, None]
        joint = torch.cumprod(conditional, dim=1)  # (L, D)
        self.confidence[0].copy_(conditional)
        self.confidence[1].copy_(joint)
        return proposals, q, joint

    def _verify_forward(
        self, r: RoundLanes, proposals: torch.Tensor, q_lens: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """4. the verification forward: pending + first q - 1 proposals per lane (and
        a wide mixed program's prompt chunk, whose last token's row is row 0).
        Returns (each lane's K + 1 logit rows (L*(K+1), V), the drafted tokens (L, K))."""
        k, chunk, prompt, lengths = self.verify_width, r.chunk, r.prompt, r.lengths
        ids = torch.cat([r.pending[:, None], proposals[:, :k]], dim=1)  # (L, K + 1)
        fed = q_lens
        if chunk is not None:
            ids = torch.nn.functional.pad(ids, (0, max(0, chunk.shape[1] - k - 1)))
            ids = torch.where(prompt[:, None], chunk, ids[:, : chunk.shape[1]])
            fed = torch.where(prompt, lengths, q_lens)
        packed = pack_lanes(
            r.arena, r.rows, r.start, fed, self.rows, width, r.program.page_size, ids.shape[1],
            ids=ids, limit=torch.where(prompt, r.start + lengths, r.held),
        )  # fmt: skip
        if self.mixed:
            packed.meta.prefill_row = r.x.prefill_row
            packed.meta.row_query_len = self.desc.token_capacity
        index = torch.arange(self.rows, device=r.device)
        logits = r.program.model(packed.input_ids, packed.positions, packed.meta, index).float()
        first = packed.meta.query_start + torch.where(prompt, lengths - 1, 0)  # (L,)
        at = (first[:, None] + torch.arange(k + 1, device=r.device)[None, :]).clamp(
            max=self.rows - 1
        )
        lane_logits = logits.index_select(0, at.reshape(-1))  # (L*(K+1), V)
        return lane_logits, proposals[:, :k]

    def _verify(
        self,
        r: RoundLanes,
        lane_logits: torch.Tensor,
        drafted: torch.Tensor,
        q: torch.Tensor,
        q_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rejection sampling of the drafts against p: (accepted, emitted, survival)."""
        lanes, k, device = self.desc.batch_capacity, self.verify_width, r.device
        counts = r.counts
        vocab = counts.shape[1]
        verify = verify_reference
        if device.type == "cuda":
            from kernels.triton.speculative_verify import speculative_verify as verify
        offered = (q_lens - 1).clamp(min=0)
        if r.greedy_only:  # every lane greedy, nothing adjusted: exact match on the argmax
            p = lane_logits.view(lanes, k + 1, vocab)
            return verify(p, None, drafted.contiguous(), offered, greedy=True)
        # p at position j sees the penalty counts of the proposals before it.
        seen = torch.zeros(lanes, k + 1, vocab, dtype=counts.dtype, device=device)
        if k:
            onehot = torch.zeros(lanes, k, vocab, dtype=counts.dtype, device=device)
            real = (drafted >= 0).to(counts.dtype)[:, :, None]
            onehot.scatter_(2, drafted.clamp(min=0)[:, :, None], real)
            seen[:, 1:] = torch.cumsum(onehot, dim=1)
        pos_counts = (counts[:, None, :] + seen).reshape(-1, vocab)
        pos_step = (r.step[:, None] + torch.arange(k + 1, device=device)[None, :]).reshape(-1)
        p, _ = round_distribution(
            lane_logits, r.s, pos_step, pos_counts, r.prompt_mask, k + 1, r.greedy_only, self.eos
        )
        p = p.view(lanes, k + 1, vocab)
        u = uniform_noise(r.s["seed"].repeat_interleave(k + 1), pos_step, 4).view(lanes, k + 1, 4)
        return verify(
            p.contiguous(),
            q[:, :k].contiguous(),
            drafted.contiguous(),
            offered,
            u[:, :k, 0].contiguous(),
            u[:, :k, 1].contiguous(),
            u[torch.arange(lanes, device=device), offered, 2].contiguous(),
        )

    def _commit(
        self, r: RoundLanes, accepted: torch.Tensor, emitted: torch.Tensor, survival: torch.Tensor
    ) -> torch.Tensor:
        """5. commit: accepted + 1 tokens, cut after the first EOS (a prompt row: its
        first token when it commits one), into the slot's pending token, position,
        step, history and penalty counts, and the round's outputs.  Returns the
        kept tokens (L, K + 1), 0 past each lane's count."""
        arena, k = r.arena, self.verify_width
        scratch = arena.scratch
        commit = r.x.count_row  # (L,) the slot, or scratch for padding and no commit
        j = torch.arange(k + 1, device=r.device)[None, :]  # (1, K + 1)
        count = accepted + 1
        is_eos = torch.isin(emitted, self.eos) & (j < count[:, None])
        first_eos = torch.where(is_eos, j, k + 1).amin(dim=1)  # (L,)
        count = torch.where(r.verifying, torch.minimum(count, first_eos + 1), 0)
        count = torch.where(r.prompt & (commit != scratch), 1, count)
        kept = j < count[:, None]  # (L, K + 1)
        tokens = torch.where(kept, emitted, 0)
        last = tokens.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
        base = torch.where(r.prompt, r.start + r.lengths, r.start + 1)  # the first token's position
        arena.pending.index_copy_(0, commit, last)
        arena.next_pos.index_copy_(0, commit, base + count - 1)
        arena.steps.index_copy_(0, commit, r.step + count)
        token_rows = torch.where(kept, commit[:, None], scratch)  # (L, K + 1)
        if arena.history is not None:
            h = arena.history_width
            where = (base[:, None] + j).clamp(max=h - 1)
            arena.history.view(-1).index_copy_(
                0, (token_rows * h + where).reshape(-1), tokens.reshape(-1)
            )
        if not r.greedy_only:
            r.penalty.count(token_rows.reshape(-1), tokens.reshape(-1))
        self.tokens.copy_(torch.where(kept, emitted, -1))
        self.counts.copy_(count)
        self.survival.copy_(survival * r.verifying[:, None])
        return tokens

    def _logprobs(self, lane_logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """The raw log probabilities of each emitted token and the top ones."""
        lanes, k = self.desc.batch_capacity, self.verify_width
        logp = torch.log_softmax(lane_logits, dim=-1)  # (L*(K+1), V) raw
        chosen = logp.gather(1, tokens.reshape(-1, 1)).view(lanes, k + 1)
        top = self.top_ids.shape[2]
        values, ids_ = logp.topk(top, dim=-1)
        self.logprob.copy_(chosen)
        self.top_logprobs.copy_(values.view(lanes, k + 1, top))
        self.top_ids.copy_(ids_.view(lanes, k + 1, top))

    def _chunk(self, x, query_start: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """(L, C) the prompt row's packed tokens from the frame (zeros elsewhere)."""
        c = self.desc.prompt_capacity
        n = x.input_ids.shape[0]
        index = (query_start[:, None] + torch.arange(c, device=prompt.device)[None, :]).clamp(
            max=n - 1
        )
        return torch.where(
            prompt[:, None], x.input_ids.index_select(0, index.reshape(-1)).view(-1, c), 0
        )

    def _allocate(
        self, joint: torch.Tensor, ceilings: torch.Tensor, rows: torch.Tensor, active: torch.Tensor
    ) -> torch.Tensor:
        """Device allocation within P over the frame's lanes: padding lanes pass
        ceiling 0, so they take no row and do not count against P (the
        coordinator, which sees only the plan's lanes, computes the same)."""
        joint = joint * active[:, None]
        ceilings = torch.where(active, ceilings, 0)
        if joint.device.type == "cuda":
            from kernels.triton.prefix_allocation import prefix_allocation

            return prefix_allocation(joint.contiguous(), ceilings, rows, self.rows)
        return prefix_allocation_reference(joint, ceilings, rows, self.rows)
