"""KV write: store this step's K and V rows into the paged cache's slots.

k, v (N, kv_heads, d) are the new tokens' keys and values; k_slots, v_slots
(slots + 1, kv_heads, d) are one layer's K and V storage as in
runtime/ranks/model/kv_cache.py, whose last row is the scratch slot. Token t goes
to row ``slot_mapping[t]`` (a slot is ``page * page_size + offset``); -1 writes
nothing. The reference is ``kv_write_reference`` (kernels/reference/kv_write.py),
which routes -1 to the
scratch row so that its index_copy_ has a fixed shape; this kernel skips such
tokens instead (and any slot past the last visible row), so the scratch row is
left as it was. Values are cast to the cache's dtype on store.

The grid (N,) depends on the shapes only, so the write can be captured in a graph.

Not wired into the rank programs yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton.checks import FLOATS, INTS, check_device


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    slot_ptr,
    num_slots,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ksn,
    stride_ksh,
    stride_vsn,
    stride_vsh,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):  # -1 (padding) or the scratch row: write nothing
        return
    h = tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    ok = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]  # (BLOCK_H, BLOCK_D)
    k = tl.load(k_ptr + token * stride_kn + h[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + token * stride_vn + h[:, None] * stride_vh + d[None, :], mask=ok)
    k_dst = ks_ptr + slot * stride_ksn + h[:, None] * stride_ksh + d[None, :]
    v_dst = vs_ptr + slot * stride_vsn + h[:, None] * stride_vsh + d[None, :]
    tl.store(k_dst, k.to(ks_ptr.dtype.element_ty), mask=ok)
    tl.store(v_dst, v.to(vs_ptr.dtype.element_ty), mask=ok)


def _check_float(name: str, tensor: Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """A float (rows, kv_heads, d) tensor's dtype, trailing shape, device and last stride."""
    if tensor.dim() != 3 or tuple(tensor.shape[1:]) != shape:
        raise ValueError(
            f"{name}: expected (rows, {shape[0]}, {shape[1]}), got shape {tuple(tensor.shape)}"
        )
    if tensor.dtype not in FLOATS:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not one of fp32/fp16/bf16")
    if tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, k on {device}")
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name}: head_dim must be contiguous (stride {tensor.stride(-1)})")


def _check(k_slots: Tensor, v_slots: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Raise ValueError naming the first bad argument."""
    if k.dim() != 3:
        raise ValueError(f"k: expected (N, kv_heads, d), got shape {tuple(k.shape)}")
    tokens, kv_heads, head_dim = k.shape
    _check_float("k", k, (kv_heads, head_dim), k.device)
    _check_float("v", v, (kv_heads, head_dim), k.device)
    if v.shape[0] != tokens:
        raise ValueError(f"v: {v.shape[0]} rows, k has {tokens}")
    _check_float("k_slots", k_slots, (kv_heads, head_dim), k.device)
    _check_float("v_slots", v_slots, (kv_heads, head_dim), k.device)
    if k_slots.shape[0] < 1:
        raise ValueError("k_slots: needs at least the scratch row")
    if v_slots.shape != k_slots.shape:
        raise ValueError(
            f"v_slots: shape {tuple(v_slots.shape)} differs from k_slots' {tuple(k_slots.shape)}"
        )
    if slot_mapping.shape != (tokens,):
        raise ValueError(
            f"slot_mapping: expected ({tokens},), got shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in INTS:
        raise ValueError(f"slot_mapping: dtype {slot_mapping.dtype} is not int32/int64")
    if slot_mapping.device != k.device:
        raise ValueError(f"slot_mapping: on {slot_mapping.device}, k on {k.device}")
    check_device("k", k, _kv_write_kernel)


def kv_write(k_slots: Tensor, v_slots: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store k, v (N, kv_heads, d) at rows slot_mapping (N,) of k_slots, v_slots
    (slots + 1, kv_heads, d), cast to their dtype; -1 (or the scratch row's index)
    writes nothing. Same arguments as ``kernels.reference.kv_write.kv_write_reference``.
    """
    _check(k_slots, v_slots, k, v, slot_mapping)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0 or kv_heads == 0 or head_dim == 0:
        return
    block_h = triton.next_power_of_2(kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _kv_write_kernel[(tokens,)](
        k,
        v,
        k_slots,
        v_slots,
        slot_mapping,
        k_slots.shape[0] - 1,
        *k.stride()[:2],
        *v.stride()[:2],
        *k_slots.stride()[:2],
        *v_slots.stride()[:2],
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )
