"""The CLIP ViT encoder and the LLaVA projector on one rank.

Module names mirror transformers' ``CLIPVisionModel`` (``embeddings``,
``pre_layrnorm``, ``encoder.layers.N.self_attn...``) and
``LlavaMultiModalProjector`` (``linear_1``, ``linear_2``), except the merged
``qkv_proj``, which the loader fills from ``q_proj``/``k_proj``/``v_proj``.

Tensor parallelism: when the encoder's heads and intermediate size divide by
the group size, each layer is split like the decoder's (column-parallel
``qkv_proj`` and ``fc1``, row-parallel ``out_proj`` and ``fc2``, whose
all-reduce ends each half); otherwise every rank holds and runs the whole
encoder (replicated, no communication). The projector is split the same way
(column-parallel ``linear_1``, row-parallel ``linear_2``) when the text hidden
size divides, else replicated. Either way every rank ends with the same
features.

Only the layers up to the selected hidden state (``vision_feature_layer``) are
built and run; ``post_layernorm`` is never used by LLaVA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.ranks.model.parallel import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
)
from runtime.ranks.model.vision_config import ClipVisionConfig, VisionConfig

__all__ = ["ClipVisionTower", "LlavaProjector", "activation"]


def _quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "quick_gelu": _quick_gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """transformers' ACT2FN[name] for the names vision_config accepts."""
    return _ACTIVATIONS[name]


class ClipEmbeddings(nn.Module):
    """Patches (a strided conv), the CLS embedding first, learned positions added."""

    def __init__(self, config: ClipVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.image_size = config.image_size
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            hidden,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
            dtype=dtype,
        )
        self.position_embedding = nn.Embedding(config.num_patches + 1, hidden, dtype=dtype)
        self.requires_grad_(False)

    def forward(self, pixels: Tensor) -> Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixels.to(weight.dtype))  # (B, hidden, g, g)
        patches = patches.flatten(2).transpose(1, 2)  # (B, g*g, hidden)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)  # (B, 1, hidden)
        x = torch.cat([cls, patches], dim=1)  # (B, T, hidden), T = g*g + 1
        return x + self.position_embedding.weight  # (B, T, hidden)


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention over one image's T positions."""

    def __init__(self, config: ClipVisionConfig, group: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, config.head_dim, heads, heads, bias=True, group=group, dtype=dtype
        )
        self.out_proj = RowParallelLinear(hidden, hidden, bias=True, group=group, dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads  # local
        self.head_dim = config.head_dim

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)  # (B, T, 3 * H_local * d)
        q, k, v = (
            part.reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            for part in qkv.split(self.qkv_proj.q_size, dim=-1)
        )  # (B, H_local, T, d) each
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(b, t, self.qkv_proj.q_size)  # (B, T, H_local * d)
        return self.out_proj(out)  # (B, T, hidden) all-reduced


class ClipMLP(nn.Module):
    def __init__(self, config: ClipVisionConfig, group: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.fc1 = ColumnParallelLinear(hidden, inter, bias=True, group=group, dtype=dtype)
        self.fc2 = RowParallelLinear(inter, hidden, bias=True, group=group, dtype=dtype)
        self.act = activation(config.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (B, T, hidden)


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: ClipVisionConfig, group: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.self_attn = ClipAttention(config, group, dtype)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = ClipMLP(config, group, dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))  # (B, T, hidden)


class ClipEncoder(nn.Module):
    def __init__(
        self, config: ClipVisionConfig, num_layers: int, group: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            ClipEncoderLayer(config, group, dtype) for _ in range(num_layers)
        )

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class ClipVisionTower(nn.Module):
    """The CLIP encoder up to LLaVA's selected hidden state (module docstring)."""

    def __init__(self, vision: VisionConfig, group: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        config = vision.encoder
        self.config = config
        self.split = vision.encoder_splits(group.world_size)
        self.group = group if self.split else TPGroup.single()
        self.keep_cls = vision.select_strategy == "full"
        self.embeddings = ClipEmbeddings(config, dtype)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.encoder = ClipEncoder(config, vision.encoder_layers_used, self.group, dtype)
        self.requires_grad_(False)

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels (B, C, S, S) -> the selected hidden state (B, N, vision hidden)."""
        x = self.pre_layrnorm(self.embeddings(pixels))  # (B, T, hidden)
        x = self.encoder(x)  # (B, T, hidden)
        return x if self.keep_cls else x[:, 1:]  # (B, N, hidden)


class LlavaProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: vision hidden -> text hidden."""

    def __init__(
        self, vision: VisionConfig, text_hidden: int, group: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if text_hidden % group.world_size:
            group = TPGroup.single()  # replicated
        vision_hidden, bias = vision.encoder.hidden_size, vision.projector_bias
        self.linear_1 = ColumnParallelLinear(
            vision_hidden, text_hidden, bias=bias, group=group, dtype=dtype
        )
        self.act = activation(vision.projector_hidden_act)
        self.linear_2 = RowParallelLinear(
            text_hidden, text_hidden, bias=bias, group=group, dtype=dtype
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))  # (B, N, text hidden)
