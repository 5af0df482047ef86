"""Single-device building blocks: RMSNorm, rotary position embedding, SwiGLU MLP.

Numerics follow the Hugging Face Llama/Qwen implementations (normalization and
RoPE frequencies in float32), so logits match transformers to float rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.ranks.model.config import RopeScaling
from runtime.ranks.model.parallel import MergedColumnParallelLinear, RowParallelLinear, TPGroup

__all__ = ["RMSNorm", "RotaryEmbedding", "SwiGLUMLP", "apply_rotary", "rope_inv_freq"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in float32."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)  # (dim,)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()  # (..., dim)
        variance = x32.pow(2).mean(-1, keepdim=True)  # (..., 1)
        x32 = x32 * torch.rsqrt(variance + self.eps)  # (..., dim)
        return self.weight * x32.to(dtype)  # (..., dim)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Inverse frequencies (head_dim / 2,) in float32, with linear or llama3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # (d/2,)
    inv_freq = 1.0 / (theta**exponents)  # (d/2,)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # (d/2,)
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )  # (d/2,)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled  # (d/2,)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)  # (d/2,)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) as in Llama and Qwen; cos/sin from position ids."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)  # (d/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin), each (N, head_dim) in ``dtype``, for positions (N,)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # (N, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (N, d)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (..., d/2) each
    return torch.cat((-x2, x1), dim=-1)  # (..., d)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (N, heads, d) by cos/sin (N, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, d)
    return x * cos + _rotate_half(x) * sin  # (N, heads, d)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up are one column-parallel matmul,
    down is row-parallel (its all-reduce ends the MLP half of the block)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        group: TPGroup,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, group=group, dtype=dtype
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, group=group, dtype=dtype
        )

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # (N, 2 * inter_local)
        gate, up = gate_up.chunk(2, dim=-1)  # (N, inter_local) each
        return self.down_proj(F.silu(gate) * up)  # (N, hidden)
