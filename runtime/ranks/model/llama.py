"""Llama / Qwen2 / Qwen3 decoder over a paged KV cache, tensor parallel by layers.

Module names mirror the Hugging Face checkpoints (``model.layers.N.self_attn...``)
except for the merged projections (``qkv_proj``, ``gate_up_proj``), which the
loader fills part by part.

The forward optionally substitutes image features for token embeddings
(:func:`substitute_features`; the LLaVA composite, :mod:`.llava`, makes them).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from runtime.ranks.model.attention import AttentionMetadata, PagedAttention
from runtime.ranks.model.config import ModelConfig
from runtime.ranks.model.kv_cache import PagedKVCache
from runtime.ranks.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary
from runtime.ranks.model.parallel import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)

__all__ = ["PACKED_MODULES", "LlamaForCausalLM", "substitute_features"]

# Checkpoint projection name -> (merged module name, shard id).
PACKED_MODULES: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, group: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            group=group,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            config.q_size, config.hidden_size, bias=False, group=group, dtype=dtype
        )
        self.num_heads = self.qkv_proj.num_heads  # local
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # local
        self.head_dim = config.head_dim
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype)
            self.k_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = PagedAttention(
            layer_index, self.num_heads, self.num_kv_heads, config.head_dim, config.head_dim**-0.5
        )

    def forward(
        self,
        hidden: Tensor,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> Tensor:
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # (N, (H + 2 KV) * d) local heads
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)  # (N, H, d)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)  # (N, KV, d)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)  # (N, KV, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per-head norm over d
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q, k, v, positions, kv_cache, metadata)  # (N, H, d)
        return self.o_proj(out.reshape(n, q_size))  # (N, hidden) all-reduced


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, group: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(config, layer_index, group, dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, group=group, dtype=dtype)

    def forward(
        self,
        hidden: Tensor,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> Tensor:
        attn_in = self.input_layernorm(hidden)  # (N, hidden)
        hidden = hidden + self.self_attn(attn_in, positions, cos, sin, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))  # (N, hidden)


def substitute_features(hidden: Tensor, image_rows: Tensor, features: Tensor) -> Tensor:
    """hidden (N, hidden) token embeddings with row ``image_rows[i]`` of the feature
    store ``features`` (R, hidden), R >= 1, in place of token i's where
    ``image_rows[i] >= 0``; -1 keeps the embedding. Tensor ops only (no
    data-dependent branch or shape): CUDA-graph capturable."""
    use = (image_rows >= 0).unsqueeze(1)  # (N, 1)
    picked = features.index_select(0, image_rows.clamp(min=0))  # (N, hidden)
    return torch.where(use, picked.to(hidden.dtype), hidden)  # (N, hidden)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, group: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, group=group, dtype=dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, group, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
        image_rows: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor:
        hidden = self.embed_tokens(input_ids)  # (N, hidden)
        if image_rows is not None and features is not None:
            hidden = substitute_features(hidden, image_rows, features)  # (N, hidden)
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # (N, d) each
        for layer in self.layers:
            hidden = layer(hidden, positions, cos, sin, kv_cache, metadata)  # (N, hidden)
        return self.norm(hidden)  # (N, hidden)


class LlamaForCausalLM(nn.Module):
    """The decoder on one rank of a tensor-parallel group.

    Bind a KV cache (:meth:`bind_kv_cache` or :meth:`allocate_kv_cache`) before
    :meth:`forward`. Every rank of the group runs the same forward with the same
    inputs and receives the same full-vocabulary logits.
    """

    def __init__(
        self,
        config: ModelConfig,
        group: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        group = TPGroup.single() if group is None else group
        config.check_tensor_parallel(group.world_size)
        self.config = config
        self.group = group
        self.dtype = dtype
        self.model = LlamaModel(config, group, dtype)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, group=group, dtype=dtype
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_cache: PagedKVCache | None = None

    @property
    def num_local_kv_heads(self) -> int:
        return self.config.local_kv_heads(self.group.world_size)

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        """Allocate and bind a cache for this rank's KV heads, on the model's device."""
        weight = self.model.embed_tokens.weight
        cache = PagedKVCache(
            num_layers=self.config.num_hidden_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=self.num_local_kv_heads,
            head_dim=self.config.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )
        self.bind_kv_cache(cache)
        return cache

    def bind_kv_cache(self, cache: PagedKVCache) -> None:
        expected = (self.config.num_hidden_layers, self.num_local_kv_heads, self.config.head_dim)
        got = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
        if got != expected:
            raise ValueError(f"cache (layers, kv_heads, head_dim) {got} != model's {expected}")
        self.kv_cache = cache

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn_metadata: AttentionMetadata,
        logits_indices: Tensor,
        *,
        image_rows: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor:
        """input_ids (N,) int64, positions (N,) int64, logits_indices (M,) int64 into
        the N tokens -> logits (M, vocab_size) in the model dtype.

        Image features (optional, both or neither): ``features`` (R, hidden) a
        feature store in the model dtype (rows of :meth:`encode_images` outputs),
        ``image_rows`` (N,) int64 the store row whose feature replaces each
        token's embedding, -1 for none (:func:`substitute_features`)."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound: call allocate_kv_cache or bind_kv_cache")
        if (image_rows is None) != (features is None):
            raise ValueError("image_rows and features go together: pass both or neither")
        hidden = self.model(
            input_ids, positions, self.kv_cache, attn_metadata, image_rows, features
        )  # (N, hidden)
        return self.lm_head(hidden[logits_indices])  # (M, vocab)
