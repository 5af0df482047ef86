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

import torch

from kernels.reference.prefix_allocation import prefix_allocation_reference
from kernels.reference.speculative_verify import sample_inverse_cdf, verify_reference
from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.draft import DraftContext, pack_lanes
from runtime.ranks.model.attention import AttentionMetadata
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.sampling import (
    LogitAdjustments,
    SamplingBatch,
    sampling_distribution,
    uniform_noise,
)
from runtime.transport.sampling import MAX_LOGPROBS

PROPOSERS = ("draft", "copy")


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
class ProposerConfig:
    """Where proposals come from: ``draft`` (a draft model) or ``copy`` (n-gram
    lookup in the request's own tokens, ``prompt_lookup_min`` through
    ``prompt_lookup_max`` tokens)."""

    kind: str = "draft"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.kind not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.kind!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"{name} must be an integer in [1, 64], got {value!r}")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")


def copy_proposals(
    history: torch.Tensor, end: torch.Tensor, depth: int, n_min: int, n_max: int
) -> torch.Tensor:
    """Copy proposals (L, depth) int64, -1 where there is none.

    ``history`` (L, T): each lane's tokens by position; ``end`` (L,): the
    position of its last token (the pending one).  For n from ``n_max`` down to
    ``n_min``, the lane's last n tokens are looked up among earlier positions;
    an occurrence followed by ``depth`` known tokens wins, then the longest n,
    then the latest occurrence, and the tokens that followed it (up to ``end``)
    are proposed.  Tensor ops only.
    """
    lanes, width = history.shape
    device = history.device
    j = torch.arange(width, device=device)  # (T,) candidate match ends
    # shifted[m][:, j] = history[:, j - m]: slices of a left-padded copy, no gather.
    padded = torch.nn.functional.pad(history, (n_max, 0))
    shifted = [padded[:, n_max - m : n_max - m + width] for m in range(n_max)]
    full = j[None, :] + depth <= end[:, None]  # (L, T) followed by depth known tokens
    # Score: a full continuation, then the longer n, then the later occurrence.
    score = torch.full((lanes,), -1, dtype=torch.int64, device=device)
    span = n_max + 1
    for n in range(n_max, n_min - 1, -1):
        match = (j[None, :] < end[:, None]) & (j[None, :] >= n - 1)  # (L, T)
        for m in range(n):
            tail = history.gather(1, (end - m).clamp(min=0)[:, None])  # (L, 1)
            match &= shifted[m] == tail
        match &= (end >= n - 1)[:, None]
        value = (full.long() * span + n) * width + j[None, :]  # (L, T)
        score = torch.maximum(score, torch.where(match, value, -1).amax(dim=1))
    found = score >= 0
    best = torch.where(found, score % width, -1)
    offsets = torch.arange(1, depth + 1, device=device)  # (D,)
    at = best[:, None] + offsets[None, :]  # (L, D)
    ok = found[:, None] & (at <= end[:, None])
    tokens = history.gather(1, at.clamp(0, width - 1))
    return torch.where(ok, tokens, -1)


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

    # -- helpers -----------------------------------------------------------------
    @staticmethod
    def _params(s: dict, step: torch.Tensor, counts, prompt_mask, repeat: int) -> SamplingBatch:
        """The lanes' settings, each repeated ``repeat`` times (rows of positions)."""

        def r(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(repeat, dim=0)

        adjustments = LogitAdjustments(
            r(s["bias_ids"]),
            r(s["bias_values"]),
            r(s["presence_penalty"]),
            r(s["frequency_penalty"]),
            r(s["repetition_penalty"]),
            counts,
            r(prompt_mask),
        )
        return SamplingBatch(
            r(s["temperature"]),
            r(s["top_p"]),
            r(s["top_k"]),
            r(s["seed"]),
            step,
            r(s["min_tokens"]),
            adjustments,
        )

    def _distribution(
        self, logits, s, step, counts, prompt_mask, repeat: int, greedy_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(final distribution, soft distribution) of ``logits`` (R*repeat, V)."""
        if greedy_only:  # every lane greedy with no adjustment: a point mass on the argmax
            point = torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
            return point, torch.softmax(logits, dim=-1)
        params = self._params(s, step, counts, prompt_mask, repeat)
        return sampling_distribution(logits, params, self.eos)

    # -- the body ----------------------------------------------------------------
    def run(self, program, variant: str, width: int) -> None:
        """The program body; ``program`` is the owning PreparedProgram."""
        x, arena, out = program.inputs, program.slots, program.outputs
        lanes, depth, k = self.desc.batch_capacity, self.depth, self.verify_width
        page_size = program.page_size
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
                penalty.reset(x.reset_row)
                penalty.mark_prompt(
                    program._prompt_rows(ends - lengths, penalty.scratch), x.input_ids
                )
        counts, prompt_mask = penalty.gather(rows)  # (L, V) each
        vocab = counts.shape[1]
        seed = s["seed"]
        # Page capacity: positions a lane may write (its table's pages).
        held = (arena.page_tables[:, :width].index_select(0, rows) >= 0).sum(dim=1) * page_size

        # 1-2. proposals (L, D), their distributions q (L, D, V), conditional confidence.
        if self.mixed and self.draft is not None:  # the prompt row feeds the draft too
            fed = pack_lanes(
                arena, rows, start, torch.where(prompt, lengths, 0), self.rows, width,
                page_size, chunk.shape[1], ids=chunk,
            )  # fmt: skip
            self.draft.feed(fed.input_ids, fed.positions, fed.meta)
        if self.draft is None:
            assert arena.history is not None
            history = arena.history.index_select(0, rows)
            proposals = copy_proposals(
                history, start, depth, self.proposer.prompt_lookup_min,
                self.proposer.prompt_lookup_max,
            )  # fmt: skip
            conditional = (proposals >= 0).float()
            q = torch.zeros(lanes, depth, vocab, device=device)
            q.scatter_(2, proposals.clamp(min=0)[:, :, None], conditional[:, :, None])
        else:
            proposals, q, conditional = self._draft(
                arena, rows, start, step, pending, verifying, held, s, counts, prompt_mask,
                width, page_size, greedy_only,
            )  # fmt: skip
        conditional = conditional * verifying[:, None]
        joint = torch.cumprod(conditional, dim=1)  # (L, D)
        self.confidence[0].copy_(conditional)
        self.confidence[1].copy_(joint)

        # 3. allocation: query lengths (L,), at most K + 1.
        if self.desc.device_allocated:
            q_lens = self._allocate(joint, lengths, rows, active)
        else:
            q_lens = lengths
        q_lens = torch.where(verifying, q_lens.clamp(1, k + 1), 0)

        # 4. verification forward: pending + first q - 1 proposals per lane (and
        # a wide mixed program's prompt chunk, whose last token's row is row 0).
        ids = torch.cat([pending[:, None], proposals[:, :k]], dim=1)  # (L, K + 1)
        fed = q_lens
        if chunk is not None:
            ids = torch.nn.functional.pad(ids, (0, max(0, chunk.shape[1] - k - 1)))
            ids = torch.where(prompt[:, None], chunk, ids[:, : chunk.shape[1]])
            fed = torch.where(prompt, lengths, q_lens)
        packed = pack_lanes(
            arena, rows, start, fed, self.rows, width, page_size, ids.shape[1], ids=ids,
            limit=torch.where(prompt, start + lengths, held),
        )  # fmt: skip
        if self.mixed:
            packed.meta.prefill_row = x.prefill_row
            packed.meta.row_query_len = self.desc.token_capacity
        index = torch.arange(self.rows, device=device)
        logits = program.model(packed.input_ids, packed.positions, packed.meta, index).float()
        first = packed.meta.query_start + torch.where(prompt, lengths - 1, 0)  # (L,)
        at = (first[:, None] + torch.arange(k + 1, device=device)[None, :]).clamp(max=self.rows - 1)
        lane_logits = logits.index_select(0, at.reshape(-1))  # (L*(K+1), V)
        drafted = proposals[:, :k]
        verify = verify_reference
        if device.type == "cuda":
            from kernels.triton.speculative_verify import speculative_verify as verify
        offered = (q_lens - 1).clamp(min=0)
        if greedy_only:  # every lane greedy, nothing adjusted: exact match on the argmax
            p = lane_logits.view(lanes, k + 1, vocab)
            accepted, emitted, survival = verify(
                p, None, drafted.contiguous(), offered, greedy=True
            )
        else:
            # p at position j sees the penalty counts of the proposals before it.
            seen = torch.zeros(lanes, k + 1, vocab, dtype=counts.dtype, device=device)
            if k:
                onehot = torch.zeros(lanes, k, vocab, dtype=counts.dtype, device=device)
                real = (drafted >= 0).to(counts.dtype)[:, :, None]
                onehot.scatter_(2, drafted.clamp(min=0)[:, :, None], real)
                seen[:, 1:] = torch.cumsum(onehot, dim=1)
            pos_counts = (counts[:, None, :] + seen).reshape(-1, vocab)
            pos_step = (step[:, None] + torch.arange(k + 1, device=device)[None, :]).reshape(-1)
            p, _ = self._distribution(
                lane_logits, s, pos_step, pos_counts, prompt_mask, k + 1, greedy_only
            )
            p = p.view(lanes, k + 1, vocab)
            u = uniform_noise(seed.repeat_interleave(k + 1), pos_step, 4).view(lanes, k + 1, 4)
            accepted, emitted, survival = verify(
                p.contiguous(),
                q[:, :k].contiguous(),
                drafted.contiguous(),
                offered,
                u[:, :k, 0].contiguous(),
                u[:, :k, 1].contiguous(),
                u[torch.arange(lanes, device=device), offered, 2].contiguous(),
            )
        # 5. commit: accepted + 1 tokens, cut after the first EOS (a prompt row: its
        # first token when it commits one).
        scratch = arena.scratch
        commit = x.count_row  # (L,) the slot, or scratch for padding and no commit
        j = torch.arange(k + 1, device=device)[None, :]  # (1, K + 1)
        count = accepted + 1
        is_eos = torch.isin(emitted, self.eos) & (j < count[:, None])
        first_eos = torch.where(is_eos, j, k + 1).amin(dim=1)  # (L,)
        count = torch.where(verifying, torch.minimum(count, first_eos + 1), 0)
        count = torch.where(prompt & (commit != scratch), 1, count)
        kept = j < count[:, None]  # (L, K + 1)
        tokens = torch.where(kept, emitted, 0)
        last = tokens.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
        base = torch.where(prompt, start + lengths, start + 1)  # the first token's position
        arena.pending.index_copy_(0, commit, last)
        arena.next_pos.index_copy_(0, commit, base + count - 1)
        arena.steps.index_copy_(0, commit, step + count)
        token_rows = torch.where(kept, commit[:, None], scratch)  # (L, K + 1)
        if arena.history is not None:
            h = arena.history_width
            where = (base[:, None] + j).clamp(max=h - 1)
            arena.history.view(-1).index_copy_(
                0, (token_rows * h + where).reshape(-1), tokens.reshape(-1)
            )
        if not greedy_only:
            penalty.count(token_rows.reshape(-1), tokens.reshape(-1))
        self.tokens.copy_(torch.where(kept, emitted, -1))
        self.counts.copy_(count)
        self.survival.copy_(survival * verifying[:, None])
        if variant == "logprobs":
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

    def _draft(
        self, arena, rows, start, step, pending, active, held, s, counts, prompt_mask,
        width, page_size, greedy_only,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Learned proposals: the draft feeds the pending token, then each proposal."""
        assert self.draft is not None
        lanes, depth = rows.shape[0], self.depth
        device = rows.device
        vocab = counts.shape[1]
        proposals = torch.full((lanes, depth), -1, dtype=torch.int64, device=device)
        q = torch.zeros(lanes, depth, vocab, device=device)
        conditional = torch.zeros(lanes, depth, device=device)
        token = pending
        seen = counts.clone()
        seed = s["seed"]
        tables = arena.page_tables[:, :width].index_select(0, rows)  # (L, width)
        lane_index = torch.arange(lanes, device=device)
        for d in range(depth + 1):
            # One token per lane at start + d: a decode step's metadata.
            positions = torch.where(active, start + d, 0)  # (L,)
            column = (positions // page_size).clamp(max=width - 1)
            page = tables.gather(1, column[:, None]).squeeze(1)
            writes = active & (page >= 0) & (positions < held)
            meta = AttentionMetadata(
                query_start=lane_index,
                query_lens=writes.long(),
                context_lens=torch.where(writes, positions + 1, 0),
                page_tables=tables,
                slot_mapping=torch.where(writes, page * page_size + positions % page_size, -1),
                max_query_len=1,
            )
            if d == depth:  # the last proposal's KV only
                self.draft.feed(token, positions, meta)
                break
            logits = self.draft.step(token, positions, meta)  # (L, V)
            dist, soft = self._distribution(logits, s, step + d, seen, prompt_mask, 1, greedy_only)
            if greedy_only:  # a point mass: its argmax
                token = logits.argmax(dim=-1)
            else:
                u = uniform_noise(seed, step + d, 4)[:, 3]
                token = sample_inverse_cdf(dist, u)  # (L,)
                seen = seen + torch.zeros_like(seen).scatter_(1, token[:, None], 1)
            proposals[:, d] = token
            q[:, d] = dist
            conditional[:, d] = soft.gather(1, token[:, None]).squeeze(1)
        return proposals, q, conditional

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
