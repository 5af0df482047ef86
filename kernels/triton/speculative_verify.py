"""Speculative verification (rejection sampling) as one Triton kernel.

Same contract as ``kernels.reference.speculative_verify.verify_reference`` (read its module
docstring for the rules): the target's probabilities p (R, K + 1, V) and the
draft's q (R, K, V), float32 with the vocabulary contiguous; the drafted tokens
(R, K) and their count per lane (R,); uniforms for the accept tests (R, K),
for the draw at a rejection at position j (R, K) and for the bonus draw (R,).
Outputs: accepted drafts (R,) int64, emitted tokens (R, K + 1) int64 (-1
padded) and survival (R, K) float32.

One program per lane.  The K accept tests are one vector step (a gather of
p_j(t_j) and q_j(t_j), tested as ``u * q < p`` as the reference does); greedy
mode instead takes each position's argmax over V in (K, BLOCK_V) tiles.  The
correction or bonus token is drawn by an inverse CDF over V in blocks: a first
pass sums the residual and p in float64, a second runs the float64 prefix sum
to the first entry above ``u * total``.  The grid (R,) depends on the shapes
only.

Not wired into the rank programs yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton.checks import INTS, check_device


@triton.jit
def _greedy_tests(
    tp_lane, stride_tpk, j, in_k, valid, t, V, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Greedy accept tests of all K positions: t_j is argmax p_j (ties to the lowest
    id), over V in (BLOCK_K, BLOCK_V) tiles; (ok, survival factor) (BLOCK_K,)."""
    best = tl.full((BLOCK_K,), float("-inf"), tl.float32)
    best_i = tl.zeros((BLOCK_K,), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        tile = in_k[:, None] & (v < V)[None, :]  # (BLOCK_K, BLOCK_V)
        p = tl.load(tp_lane + j[:, None] * stride_tpk + v[None, :], mask=tile, other=float("-inf"))
        top = tl.max(p, axis=1)  # (BLOCK_K,)
        top_i = tl.min(tl.where(p == top[:, None], v[None, :], V), axis=1).to(tl.int64)
        better = top > best  # strict: ties keep the earlier block's lower id
        best_i = tl.where(better, top_i, best_i)
        best = tl.where(better, top, best)
    ok = valid & (t == best_i)
    return ok, ok.to(tl.float32)


@triton.jit
def _sampled_tests(tp_lane, dp_lane, u_lane, stride_tpk, stride_dpk, stride_uk, j, in_k, valid, t):
    """The accept tests of all K positions (``u * q < p``) and their survival
    factors min(1, p / q) (0 where q = 0): (ok, factor) (BLOCK_K,)."""
    p_t = tl.load(tp_lane + j * stride_tpk + t, mask=valid, other=0.0)
    q_t = tl.load(dp_lane + j * stride_dpk + t, mask=valid, other=0.0)
    u = tl.load(u_lane + j * stride_uk, mask=in_k, other=1.0)
    ok = (q_t > 0) & (u * q_t < p_t)
    factor = tl.where(q_t > 0, tl.minimum(p_t / tl.where(q_t > 0, q_t, 1.0), 1.0), 0.0)
    return ok, factor


@triton.jit
def _greedy_token(p_row, V, BLOCK_V: tl.constexpr):
    """argmax of the row p_row (V,), ties to the lowest id, in BLOCK_V blocks."""
    best_s = float("-inf")
    token = 0
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        p = tl.load(p_row + v, mask=v < V, other=float("-inf"))
        top_s = tl.max(p, axis=0)
        top_si = tl.min(tl.where(p == top_s, v, V), axis=0)
        if top_s > best_s:
            token = top_si
            best_s = top_s
    return token


@triton.jit
def _sampled_token(p_row, q_row, rejected, threshold_u, V, BLOCK_V: tl.constexpr):
    """The correction token (``rejected``: from normalize(max(0, p - q)), from p when
    that has no mass) or the bonus token (from p), by the float64 inverse CDF at
    ``threshold_u`` (a uniform) over p_row, q_row (V,) in BLOCK_V blocks."""
    q_limit = tl.where(rejected, V, 0)  # q is read only after a rejection
    res_total = tl.zeros((), tl.float64)
    p_total = tl.zeros((), tl.float64)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        p = tl.load(p_row + v, mask=v < V, other=0.0)
        q = tl.load(q_row + v, mask=v < q_limit, other=0.0)
        res_total += tl.sum(tl.maximum(p - q, 0.0).to(tl.float64), axis=0)
        p_total += tl.sum(p.to(tl.float64), axis=0)
    use_res = rejected & (res_total > 0)
    total = tl.where(use_res, res_total, p_total)
    q_limit = tl.where(use_res, V, 0)
    threshold = threshold_u.to(tl.float64) * total
    carry = tl.zeros((), tl.float64)
    first = V
    last_positive = 0
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        in_v = v < V
        p = tl.load(p_row + v, mask=in_v, other=0.0)
        q = tl.load(q_row + v, mask=v < q_limit, other=0.0)
        w = tl.where(use_res, tl.maximum(p - q, 0.0), p)
        w64 = w.to(tl.float64)
        cum = carry + tl.cumsum(w64, axis=0)
        first = tl.minimum(first, tl.min(tl.where(in_v & (cum > threshold), v, V), axis=0))
        last_positive = tl.maximum(last_positive, tl.max(tl.where(in_v & (w > 0), v, 0), axis=0))
        carry += tl.sum(w64, axis=0)
    return tl.where(first < V, first, last_positive)


@triton.jit
def _verify_kernel(
    tp_ptr,
    dp_ptr,
    tok_ptr,
    n_ptr,
    u_ptr,
    ru_ptr,
    bu_ptr,
    acc_ptr,
    out_ptr,
    surv_ptr,
    K,
    V,
    stride_tpr,
    stride_tpk,
    stride_dpr,
    stride_dpk,
    stride_tokr,
    stride_tokk,
    stride_n,
    stride_ur,
    stride_uk,
    stride_rur,
    stride_ruk,
    stride_bu,
    GREEDY: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    lane = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + lane * stride_n).to(tl.int32)
    n = tl.minimum(tl.maximum(n, 0), K)
    j = tl.arange(0, BLOCK_K)  # (BLOCK_K,) draft positions
    in_k = j < K
    offered = j < n
    t = tl.load(tok_ptr + lane * stride_tokr + j * stride_tokk, mask=in_k, other=-1).to(tl.int64)
    valid = in_k & (t >= 0) & (t < V)
    tp_lane = tp_ptr + lane * stride_tpr
    dp_lane = dp_ptr + lane * stride_dpr

    # The accept tests and survival factors of all K positions at once.
    if GREEDY:
        ok, factor = _greedy_tests(tp_lane, stride_tpk, j, in_k, valid, t, V, BLOCK_K, BLOCK_V)
    else:
        u_lane = u_ptr + lane * stride_ur
        ok, factor = _sampled_tests(
            tp_lane, dp_lane, u_lane, stride_tpk, stride_dpk, stride_uk, j, in_k, valid, t
        )
    survival = tl.cumprod(tl.where(offered, factor, 1.0), axis=0)
    survival = tl.where(offered, survival, 0.0)
    tl.store(surv_ptr + lane * K + j, survival, mask=in_k)
    accepted = tl.min(tl.where(offered & (ok == 0), j, n), axis=0)  # first rejection, or n

    # The correction token (after a rejection) or the bonus token.
    p_row = tp_lane + accepted.to(tl.int64) * stride_tpk
    if GREEDY:
        token = _greedy_token(p_row, V, BLOCK_V)
    else:
        rejected = accepted < n
        at = tl.minimum(accepted, tl.maximum(K - 1, 0)).to(tl.int64)
        q_row = dp_lane + at * stride_dpk
        u_res = tl.load(ru_ptr + lane * stride_rur + at * stride_ruk, mask=rejected, other=0.0)
        u_bonus = tl.load(bu_ptr + lane * stride_bu)
        u = tl.where(rejected, u_res, u_bonus)
        token = _sampled_token(p_row, q_row, rejected, u, V, BLOCK_V)

    tl.store(acc_ptr + lane, accepted.to(tl.int64))
    jj = tl.arange(0, BLOCK_K1)  # (BLOCK_K1,) output positions
    drafted = tl.load(tok_ptr + lane * stride_tokr + jj * stride_tokk, mask=jj < K, other=-1).to(
        tl.int64
    )
    out = tl.where(jj < accepted, drafted, tl.where(jj == accepted, token.to(tl.int64), -1))
    tl.store(out_ptr + lane * (K + 1) + jj, out, mask=jj < K + 1)


def _check_tensor(
    name: str, tensor: Tensor | None, shape: tuple[int, ...], dtypes: tuple, device: torch.device
) -> None:
    """Shape, dtype and device of one argument."""
    if tensor is None:
        raise ValueError(f"{name}: required in sampling mode (greedy=False)")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: dtype {tensor.dtype} is not {names}")
    if tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, target_probs on {device}")


def _check(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_tokens: Tensor,
    num_draft: Tensor,
    uniforms: Tensor | None,
    residual_uniforms: Tensor | None,
    bonus_uniforms: Tensor | None,
    greedy: bool,
) -> None:
    """Raise ValueError naming the first bad argument."""
    if target_probs.dim() != 3 or target_probs.shape[1] < 1:
        raise ValueError(
            f"target_probs: expected (R, K + 1, V), got shape {tuple(target_probs.shape)}"
        )
    lanes, k1, vocab = target_probs.shape
    k, device = k1 - 1, target_probs.device
    f32 = (torch.float32,)
    _check_tensor("target_probs", target_probs, (lanes, k1, vocab), f32, device)
    if target_probs.stride(-1) != 1:
        raise ValueError("target_probs: the vocabulary must be contiguous")
    _check_tensor("draft_tokens", draft_tokens, (lanes, k), INTS, device)
    _check_tensor("num_draft", num_draft, (lanes,), INTS, device)
    if not greedy:
        _check_tensor("draft_probs", draft_probs, (lanes, k, vocab), f32, device)
        if draft_probs.stride(-1) != 1:
            raise ValueError("draft_probs: the vocabulary must be contiguous")
        _check_tensor("uniforms", uniforms, (lanes, k), f32, device)
        _check_tensor("residual_uniforms", residual_uniforms, (lanes, k), f32, device)
        _check_tensor("bonus_uniforms", bonus_uniforms, (lanes,), f32, device)
    check_device("target_probs", target_probs, _verify_kernel)


def speculative_verify(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_tokens: Tensor,
    num_draft: Tensor,
    uniforms: Tensor | None = None,
    residual_uniforms: Tensor | None = None,
    bonus_uniforms: Tensor | None = None,
    greedy: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Verify each lane's drafts; the arguments and outputs of
    ``kernels.reference.speculative_verify.verify_reference``: returns accepted (R,) int64,
    output_tokens (R, K + 1) int64 and survival (R, K) float32.  In greedy
    mode draft_probs and the uniforms are not read (they may be None)."""
    _check(
        target_probs,
        draft_probs,
        draft_tokens,
        num_draft,
        uniforms,
        residual_uniforms,
        bonus_uniforms,
        greedy,
    )
    lanes, k1, vocab = target_probs.shape
    k, device = k1 - 1, target_probs.device
    accepted = torch.zeros(lanes, dtype=torch.int64, device=device)
    out = torch.full((lanes, k1), -1, dtype=torch.int64, device=device)
    survival = torch.zeros(lanes, k, dtype=torch.float32, device=device)
    if lanes == 0 or vocab == 0:
        return accepted, out, survival
    if greedy:  # unread: any float32 tensors of the right rank give the strides
        draft_probs = uniforms = residual_uniforms = target_probs[:, :1]
        bonus_uniforms = target_probs[:, 0, 0]
    _verify_kernel[(lanes,)](
        target_probs,
        draft_probs,
        draft_tokens,
        num_draft,
        uniforms,
        residual_uniforms,
        bonus_uniforms,
        accepted,
        out,
        survival,
        k,
        vocab,
        *target_probs.stride()[:2],
        *draft_probs.stride()[:2],
        *draft_tokens.stride()[:2],
        num_draft.stride(0),
        *uniforms.stride()[:2],
        *residual_uniforms.stride()[:2],
        bonus_uniforms.stride(0),
        GREEDY=greedy,
        BLOCK_K=triton.next_power_of_2(max(k, 1)),
        BLOCK_K1=triton.next_power_of_2(k1),
        BLOCK_V=min(triton.next_power_of_2(vocab), 1024),
        num_warps=4,
    )
    return accepted, out, survival
