"""Tiny random Hugging Face checkpoints and their greedy reference tokens, for tests."""

from __future__ import annotations

from pathlib import Path

import torch


def write_tiny(
    arch: str,
    path: Path,
    *,
    seed: int,
    vocab: int = 128,
    max_positions: int = 256,
    tie: bool = False,
    bias: bool = False,
):
    """A 2-layer, 64-wide random Llama or Qwen2 saved to ``path``; returns the model.

    The last vocabulary id is eos and the one before it bos.  ``bias`` gives
    Qwen2's q/k/v biases non-zero values, so a loader must place them.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=0.1, eos_token_id=vocab - 1, bos_token_id=vocab - 2,
        tie_word_embeddings=tie,
    )  # fmt: skip
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common)).eval()
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    else:
        raise ValueError(f"unknown arch {arch!r}")
    if bias:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.copy_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return model


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly ``new_tokens`` long."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
            out.append(gen[0, len(prompt) :].tolist())
    return out
