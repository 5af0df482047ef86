"""Torch reference of kernels/triton/paged_verify_attention.py, with no Triton import:
the prefill reference, which computes exactly what the verify kernel does."""

from __future__ import annotations

from torch import Tensor

from kernels.reference.paged_prefill_attention import paged_prefill_attention_reference


def paged_verify_attention_reference(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_tables: Tensor,
    query_start: Tensor,
    query_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    max_query_len: int,
) -> Tensor:
    """Torch reference of :func:`paged_verify_attention`; fp32 math, q's dtype out.

    The kernel takes the prefill kernel's arguments with their meaning (lane i's
    j-th new query at position ``context_lens[i] - query_lens[i] + j``, causal over
    the lane's whole paged context; zeros on rows of no lane), for a small bound W
    = max_query_len. :func:`paged_prefill_attention_reference` computes exactly
    that, so this delegates to it (its one-token lanes run as decode attention, its
    longer ones one SDPA each).
    """
    return paged_prefill_attention_reference(
        q,
        k_pages,
        v_pages,
        page_tables,
        query_start,
        query_lens,
        context_lens,
        scale,
        max_query_len,
    )
