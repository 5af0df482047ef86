"""A token-by-token torch reference of logit bias and penalties (vLLM's semantics)."""

from __future__ import annotations

from collections import Counter

import torch

from runtime.transport.sampling import SamplingParams


def reference(logits: torch.Tensor, p: SamplingParams, prompt, output) -> torch.Tensor:
    """One row (V,) float32, token by token in vLLM's order: bias, repetition over
    prompt and output tokens, frequency, presence (output tokens only)."""
    x = logits.clone().float()
    f32 = torch.float32
    for token, bias in p.logit_bias:
        x[token] = x[token] + torch.tensor(bias, dtype=f32)
    rep = torch.tensor(p.repetition_penalty, dtype=f32)
    for token in set(prompt) | set(output):
        x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    freq = torch.tensor(p.frequency_penalty, dtype=f32)
    presence = torch.tensor(p.presence_penalty, dtype=f32)
    for token, count in Counter(output).items():
        x[token] = x[token] - freq * torch.tensor(float(count), dtype=f32)
    for token in set(output):
        x[token] = x[token] - presence
    return x
