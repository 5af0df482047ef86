"""A tiny random-weight LLaVA checkpoint in transformers (a CLIP encoder of 32-pixel
images in 8-pixel patches, :data:`N` feature rows per image, a Llama decoder of
128 ids with :data:`IMAGE` the image token), shared by the rank and deployment
tests of vision (issue 27)."""

from __future__ import annotations

import torch

IMAGE = 120  # the image token
N = 16  # feature rows per image: (32 / 8) ** 2 patches, the CLS row dropped


def hf_model():
    """transformers' LlavaForConditionalGeneration with seeded weights drawn away from
    the initializer's (so every layer and the image features matter)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as HFLlava

    text = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=127, bos_token_id=1,
    )  # fmt: skip
    encoder = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
        image_size=32, patch_size=8, projection_dim=32,
    )  # fmt: skip
    torch.manual_seed(3)
    config = LlavaConfig(vision_config=encoder, text_config=text, image_token_index=IMAGE)
    model = HFLlava(config).eval()
    with torch.no_grad():  # away from the initializer's unit norms and zero biases
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + torch.randn_like(param) * 0.1)
            else:
                param.copy_(torch.randn_like(param) * 0.1)
    return model


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(127) + 1] if 127 in tokens else tokens
