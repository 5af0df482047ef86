"""Paged KV cache: per layer, K and V of shape (num_pages, page_size, kv_heads, head_dim).

Pages are allocated by the coordinator; this module only holds the memory,
writes new entries and copies whole pages (:meth:`PagedKVCache.copy_pages`,
copy-on-write of a shared prefix). A token's slot is ``page * page_size + offset``; slot -1 means
"write nothing" (padded tokens, inactive lanes). Such writes are routed to one
hidden scratch slot past the last page, so the write is a fixed-shape
``index_copy_`` (capturable in a CUDA graph) and no visible entry ever changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.reference.kv_write import kv_write_reference

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """K and V pages for every layer of one rank (its local KV heads)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_slots = num_pages * page_size
        # One extra slot per layer and K/V: the scratch target of slot -1.
        self._storage = torch.zeros(
            num_layers, 2, self.num_slots + 1, num_kv_heads, head_dim, dtype=dtype, device=device
        )  # (layers, 2, slots + 1, kv_heads, d)

    @property
    def dtype(self) -> torch.dtype:
        return self._storage.dtype

    @property
    def device(self) -> torch.device:
        return self._storage.device

    @property
    def nbytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    def key(self, layer: int) -> Tensor:
        """(num_pages, page_size, kv_heads, head_dim) view of layer's K pages."""
        flat = self._storage[layer, 0, : self.num_slots]  # (slots, kv_heads, d)
        return flat.view(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def value(self, layer: int) -> Tensor:
        """(num_pages, page_size, kv_heads, head_dim) view of layer's V pages."""
        flat = self._storage[layer, 1, : self.num_slots]  # (slots, kv_heads, d)
        return flat.view(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def write(self, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store k, v (N, kv_heads, d) at slot_mapping (N,); -1 writes nothing.

        CUDA: the Triton kernel (kernels/triton/kv_write.py); CPU: its torch reference
        (kernels/reference/kv_write.py).
        """
        k_slots, v_slots = self._storage[layer, 0], self._storage[layer, 1]
        if k_slots.is_cuda:
            from kernels.triton.kv_write import kv_write

            kv_write(k_slots, v_slots, k, v, slot_mapping)
        else:
            kv_write_reference(k_slots, v_slots, k, v, slot_mapping)

    def pages(self) -> Tensor:
        """(layers, 2, num_pages, page_size, kv_heads, head_dim) view of every page."""
        flat = self._storage[:, :, : self.num_slots]  # (layers, 2, slots, kv_heads, d)
        return flat.unflatten(2, (self.num_pages, self.page_size))

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, destination) page's K and V, every layer, in order.

        One device-to-device copy per pair on the current stream (no host
        transfer, no synchronization): issued before a frame's program, it is
        ordered after the frames already launched and before this one.
        """
        pages = self.pages()
        for src, dst in copies:
            pages[:, :, dst].copy_(pages[:, :, src])

    def zero_(self) -> None:
        self._storage.zero_()
