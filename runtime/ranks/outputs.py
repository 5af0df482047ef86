"""A rank's program outputs: the static device buffers every program writes
(:class:`ProgramOutputs`, with the per-slot penalty state) and the host copies
of one frame's outputs (:class:`HostOutputs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.sampling import PenaltyState, eos_index
from runtime.transport.frame_lane import MAX_SLOTS
from runtime.transport.sampling import MAX_LOGPROBS


@dataclass(frozen=True)
class ProgramOutputs:
    """Static device buffers shared by every program (rows 0..L-1 belong to the
    last run), with the model's EOS ids and the per-slot penalty state."""

    tokens: torch.Tensor  # (L_max,) int64: the sampled tokens
    logprob: torch.Tensor  # (L_max,) float32: the sampled token's raw log probability
    top_ids: torch.Tensor  # (L_max, K) int64: the top-K tokens, best first
    top_logprobs: torch.Tensor  # (L_max, K) float32: their log probabilities
    eos: torch.Tensor  # (E,) int64: the model's EOS ids, barred by min_tokens
    penalties: PenaltyState  # per slot: output-token counts, prompt-token mask
    # Scored prefill, per packed token (T_max = the largest scored program's tokens):
    score_logprob: torch.Tensor  # (T_max,) float32: the next prompt token's log probability
    score_top: torch.Tensor  # (T_max, K) float32: the top-K log probabilities
    score_ids: torch.Tensor  # (T_max, K) int64: their token ids

    @classmethod
    def allocate(
        cls, lanes: int, model: LlamaForCausalLM, device: torch.device, score_tokens: int = 0
    ) -> ProgramOutputs:
        vocab = model.config.vocab_size
        k = min(MAX_LOGPROBS, vocab)
        return cls(
            tokens=torch.zeros(lanes, dtype=torch.int64, device=device),
            logprob=torch.zeros(lanes, dtype=torch.float32, device=device),
            top_ids=torch.zeros(lanes, k, dtype=torch.int64, device=device),
            top_logprobs=torch.zeros(lanes, k, dtype=torch.float32, device=device),
            eos=eos_index(model.config.eos_token_ids, device),
            penalties=PenaltyState(MAX_SLOTS, vocab, device),
            score_logprob=torch.zeros(score_tokens, dtype=torch.float32, device=device),
            score_top=torch.zeros(score_tokens, k, dtype=torch.float32, device=device),
            score_ids=torch.zeros(score_tokens, k, dtype=torch.int64, device=device),
        )

    @property
    def max_logprobs(self) -> int:
        return self.top_ids.shape[1]


class HostOutputs:
    """Host copies of one frame's outputs (pinned on CUDA): tokens, and the log
    probabilities when the frame asked for them, a scored prefill's per-token
    prompt log probabilities (``score_tokens`` rows)."""

    def __init__(self, lanes: int, k: int, device: torch.device, score_tokens: int = 0) -> None:
        pin = device.type == "cuda"
        self.tokens = torch.zeros(lanes, dtype=torch.int64, pin_memory=pin)
        self.logprob = torch.zeros(lanes, dtype=torch.float32, pin_memory=pin)
        self.top_ids = torch.zeros(lanes, k, dtype=torch.int64, pin_memory=pin)
        self.top_logprobs = torch.zeros(lanes, k, dtype=torch.float32, pin_memory=pin)
        self.token_array = self.tokens.numpy()
        self.score_logprob = torch.zeros(score_tokens, dtype=torch.float32, pin_memory=pin)
        self.score_top = torch.zeros(score_tokens, k, dtype=torch.float32, pin_memory=pin)
        self.score_ids = torch.zeros(score_tokens, k, dtype=torch.int64, pin_memory=pin)
