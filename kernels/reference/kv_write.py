"""Torch reference of kernels/triton/kv_write.py, with no Triton import: the KV
store of the paged cache (runtime/ranks/model/kv_cache.py) on CPU and the
kernel's test oracle."""

from __future__ import annotations

import torch
from torch import Tensor


def kv_write_reference(
    k_slots: Tensor, v_slots: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor
) -> None:
    """Reference store: k_slots/v_slots (slots + 1, kv_heads, d) whose last row is
    scratch; k, v (N, kv_heads, d); slot_mapping (N,) int, -1 = skip."""
    scratch = k_slots.shape[0] - 1
    slots = torch.where(slot_mapping < 0, scratch, slot_mapping).long()  # (N,)
    k_slots.index_copy_(0, slots, k.to(k_slots.dtype))
    v_slots.index_copy_(0, slots, v.to(v_slots.dtype))
