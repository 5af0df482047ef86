"""Argument checks shared by the kernel launchers: each raises ValueError naming
the first bad argument."""

from __future__ import annotations

import torch
from torch import Tensor

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was decorated under TRITON_INTERPRET=1 (it runs on CPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_device(name: str, tensor: Tensor, kernel: object) -> None:
    """The kernel needs CUDA unless it runs under the interpreter."""
    if tensor.device.type != "cuda" and not interpreted(kernel):
        raise ValueError(
            f"{name}: on {tensor.device}; the kernel needs CUDA (or TRITON_INTERPRET=1)"
        )


def check_index(name: str, tensor: Tensor, device: torch.device) -> None:
    """An index tensor's dtype and device."""
    if tensor.dtype not in INTS:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not int32/int64")
    if tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, q on {device}")


def check_query_and_pages(q: Tensor, k_pages: Tensor, v_pages: Tensor, rows: str) -> int:
    """q (``rows``, H, d) and the K/V pages (num_pages, page_size, kv_heads, d): dims,
    dtypes, devices, contiguous head_dim, matching shapes, GQA grouping.  Returns
    the page size (each launcher checks what it needs of it)."""
    if q.dim() != 3:
        raise ValueError(f"q: expected ({rows}, H, d), got shape {tuple(q.shape)}")
    if q.dtype not in FLOATS:
        raise ValueError(f"q: dtype {q.dtype} is not one of fp32/fp16/bf16")
    if q.stride(-1) != 1:
        raise ValueError(f"q: head_dim must be contiguous (stride {q.stride(-1)})")
    _, heads, head_dim = q.shape
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dim() != 4:
            raise ValueError(
                f"{name}: expected (num_pages, page_size, kv_heads, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: head_dim must be contiguous (stride {t.stride(-1)})")
    if v_pages.shape != k_pages.shape:
        raise ValueError(
            f"v_pages: shape {tuple(v_pages.shape)} differs from k_pages' {tuple(k_pages.shape)}"
        )
    _, page_size, kv_heads, k_dim = k_pages.shape
    if k_dim != head_dim:
        raise ValueError(f"k_pages: head_dim {k_dim} differs from q's {head_dim}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"k_pages: kv_heads {kv_heads} does not divide q's {heads} heads")
    return page_size


def check_packed_lanes(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    context_lens: Tensor,
) -> None:
    """A packed varlen step (the prefill and verify kernels): q (N, H, d) and the
    pages as :func:`check_query_and_pages`, a positive page size, page tables
    (L, P) and the (L,) index vectors ``query_start``, ``query_lens`` and
    ``context_lens`` on q's device."""
    page_size = check_query_and_pages(q, k_pages, v_pages, "N")
    if page_size <= 0:
        raise ValueError(f"k_pages: page_size {page_size} must be positive")
    if page_tables.dim() != 2:
        raise ValueError(f"page_tables: expected (L, P), got shape {tuple(page_tables.shape)}")
    check_index("page_tables", page_tables, q.device)
    lanes = page_tables.shape[0]
    for name, t in (
        ("query_start", query_start),
        ("query_lens", query_lens),
        ("context_lens", context_lens),
    ):
        if t.shape != (lanes,):
            raise ValueError(f"{name}: expected ({lanes},), got shape {tuple(t.shape)}")
        check_index(name, t, q.device)


def check_blocks(name: str, block: int, block_n: int, group_p: int, min_dot: int) -> None:
    """A query block (``name``: rows of queries) and a key block: powers of two,
    block_n >= ``min_dot`` and ``block`` x ``group_p`` >= ``min_dot`` rows (the
    smallest tl.dot on the GPU)."""
    for label, value, least in ((name, block, 1), ("block_n", block_n, min_dot)):
        if not isinstance(value, int) or value < least or value & (value - 1):
            raise ValueError(f"{label}: expected a power of two >= {least}, got {value!r}")
    if block * group_p < min_dot:
        raise ValueError(f"{name}: {block} x group {group_p} is under {min_dot} rows")
