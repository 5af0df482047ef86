"""Speculative verification: the Triton kernel against the torch reference, and
the reference's output distribution against the target's.

The kernel runs under the Triton interpreter on CPU: conftest.py imports it with
TRITON_INTERPRET=1 before this module does.
"""

import pytest
import torch

from kernels.reference.speculative_verify import sample_inverse_cdf, verify_reference
from kernels.triton.speculative_verify import speculative_verify

# Chi-square critical value at significance 1e-3 for 7 degrees of freedom (8
# categories), used when scipy is missing: scipy.stats.chi2.ppf(0.999, 7).
CHI2_CRITICAL_DF7 = 24.322


def _inputs(seed, lanes, k, vocab, num_draft, closeness=0.8):
    """Random p (R, K + 1, V), a q near p (R, K, V), drafts sampled from q, uniforms."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(2 * torch.randn(lanes, k + 1, vocab, generator=gen), dim=-1)
    noise = torch.softmax(2 * torch.randn(lanes, k, vocab, generator=gen), dim=-1)
    draft = closeness * target[:, :k] + (1 - closeness) * noise
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).view(lanes, k)
    return {
        "target_probs": target,
        "draft_probs": draft,
        "draft_tokens": tokens,
        "num_draft": torch.tensor(num_draft),
        "uniforms": torch.rand(lanes, k, generator=gen),
        "residual_uniforms": torch.rand(lanes, k, generator=gen),
        "bonus_uniforms": torch.rand(lanes, generator=gen),
    }


def _assert_same(args, greedy=False):
    ref = verify_reference(**args, greedy=greedy)
    out = speculative_verify(**args, greedy=greedy)
    assert torch.equal(out[0], ref[0]), (out[0], ref[0])
    assert torch.equal(out[1], ref[1]), (out[1], ref[1])
    torch.testing.assert_close(out[2], ref[2], rtol=1e-5, atol=1e-7)
    return ref


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("greedy", [False, True])
def test_kernel_matches_reference(seed, greedy):
    # closeness 0.5: the seeds give a mix of rejections at each position and bonuses
    args = _inputs(seed, 4, 4, 37, [0, 2, 4, 3], closeness=0.5)
    _assert_same(args, greedy)


def test_all_accepted_bonus_and_no_drafts():
    """q = p at the draft positions: every offered draft passes, then a bonus."""
    args = _inputs(5, 4, 3, 40, [3, 0, 1, 3])
    args["draft_probs"] = args["target_probs"][:, :3].clone()
    accepted, tokens, survival = _assert_same(args)
    assert accepted.tolist() == [3, 0, 1, 3]
    assert torch.equal(tokens[0, :3], args["draft_tokens"][0])
    assert (tokens[1, 1:] == -1).all() and tokens[1, 0] >= 0
    assert torch.equal(survival, (torch.arange(3) < args["num_draft"][:, None]).float())


def test_point_mass_copy_proposals():
    """One-hot q: accept t iff u < p(t); the residual is p with t removed."""
    args = _inputs(6, 4, 4, 32, [4, 4, 2, 1])
    args["draft_probs"] = torch.nn.functional.one_hot(args["draft_tokens"], 32).float()
    args["uniforms"] = torch.full((4, 4), 0.02)  # accept some, reject others
    accepted, tokens, survival = _assert_same(args)
    for lane in range(4):
        a = int(accepted[lane])
        if a < int(args["num_draft"][lane]):  # the correction is never the rejected token
            assert tokens[lane, a] != args["draft_tokens"][lane, a]
    # min(1, p/q) with q = 1 is p(t): survival is the running product of p(t).
    p_t = args["target_probs"][:, :4].gather(2, args["draft_tokens"][..., None])[..., 0]
    offered = torch.arange(4) < args["num_draft"][:, None]
    torch.testing.assert_close(survival, torch.cumprod(p_t, dim=1) * offered)


def test_zero_residual_samples_from_p():
    """Rejections whose residual max(0, p - q) is all zero (q = p): a draft token
    out of range, and one where q = 0; the token is drawn from p instead."""
    args = _inputs(7, 3, 2, 24, [2, 2, 1])
    args["draft_probs"] = args["target_probs"][:, :2].clone()
    args["draft_tokens"][0, 0] = 24  # out of range: rejected
    args["draft_tokens"][1, 1] = -1
    args["target_probs"][2, 0, 5] = 0.0
    args["draft_probs"][2, 0, 5] = 0.0  # q = 0 at the draft: rejected
    args["draft_tokens"][2, 0] = 5
    accepted, tokens, _ = _assert_same(args)
    assert accepted.tolist() == [0, 1, 0]
    expect = sample_inverse_cdf(
        args["target_probs"][[0, 1, 2], [0, 1, 0]],
        torch.stack(
            [
                args["residual_uniforms"][0, 0],
                args["residual_uniforms"][1, 1],
                args["residual_uniforms"][2, 0],
            ]
        ),
    )
    assert torch.equal(tokens[[0, 1, 2], [0, 1, 0]], expect)


def test_greedy_ties_and_matches():
    """Greedy: exact argmax matches, ties to the lowest token id."""
    args = _inputs(8, 4, 3, 16, [3, 3, 2, 0])
    target = torch.round(args["target_probs"] * 4) / 4  # coarse: many ties
    target[:, :, 3] = target.amax(dim=-1)  # token 3 ties the max everywhere
    args["target_probs"] = target.contiguous()
    args["draft_tokens"] = target[:, :3].argmax(dim=-1)  # the lowest-id argmax: all match
    args["draft_tokens"][1, 1] = 15
    accepted, tokens, survival = _assert_same(args, greedy=True)
    assert accepted.tolist() == [3, 1, 2, 0]
    assert tokens[1, 1] == target[1, 1].argmax()
    assert survival.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]]


def test_vocab_over_one_block_and_strided_inputs():
    """V past the kernel's 1024-wide block; probabilities sliced from a wider
    buffer; int32 tokens and counts."""
    args = _inputs(9, 2, 2, 1500, [2, 1], closeness=0.9)
    wide = torch.zeros(2, 3, 1600)
    wide[:, :, :1500] = args["target_probs"]
    args["target_probs"] = wide[:, :, :1500]
    args["draft_tokens"] = args["draft_tokens"].int()
    args["num_draft"] = args["num_draft"].int()
    _assert_same(args)
    wide[:, :, [100, 1200]] = 1.0  # a tie across blocks: the lower id wins
    args["draft_tokens"][0] = torch.tensor([100, 1200])
    accepted, tokens, _ = _assert_same(args, greedy=True)
    assert accepted.tolist() == [1, 0] and tokens[:, :2].tolist() == [[100, 100], [100, -1]]


def _chi_square(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def _critical(df):
    try:
        from scipy.stats import chi2
    except ImportError:
        assert df == 7
        return CHI2_CRITICAL_DF7
    return float(chi2.ppf(0.999, df))


@pytest.mark.parametrize("copy", [False, True])
def test_reference_emits_the_target_distribution(copy):
    """One draft position, drafts drawn from q: the first emitted token follows
    p (chi-square at a fixed seed), while drawing the correction from p instead
    of the residual max(0, p - q) is rejected by the same test."""
    lanes, vocab = 200_000, 8
    gen = torch.Generator().manual_seed(10)
    p = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.05, 0.05, 0.05])
    if copy:  # a copy proposal: q is a point mass at token 2
        q = torch.nn.functional.one_hot(torch.tensor(2), vocab).float()
    else:
        q = torch.tensor([0.05, 0.05, 0.10, 0.10, 0.15, 0.15, 0.20, 0.20])
    drafts = sample_inverse_cdf(q.expand(lanes, vocab), torch.rand(lanes, generator=gen))
    args = {
        "target_probs": p.expand(lanes, 2, vocab),
        "draft_probs": q.expand(lanes, 1, vocab),
        "draft_tokens": drafts.view(lanes, 1),
        "num_draft": torch.ones(lanes, dtype=torch.int64),
        "uniforms": torch.rand(lanes, 1, generator=gen),
        "residual_uniforms": torch.rand(lanes, 1, generator=gen),
        "bonus_uniforms": torch.rand(lanes, generator=gen),
    }
    accepted, tokens, survival = verify_reference(**args)
    critical = _critical(vocab - 1)
    assert _chi_square(tokens[:, 0], p) < critical
    # The acceptance rate is sum(min(p, q)); survival is its per-lane expectation.
    rate = float(torch.minimum(p, q).sum())
    assert abs(accepted.double().mean().item() - rate) < 0.01
    assert abs(survival.double().mean().item() - rate) < 0.01
    # Power: a wrong correction (drawn from p, not the residual) fails the test.
    wrong = torch.where(
        accepted == 1,
        drafts,
        sample_inverse_cdf(p.expand(lanes, vocab), args["residual_uniforms"][:, 0]),
    )
    assert _chi_square(wrong, p) > critical


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("target_probs", lambda a: a.update(target_probs=a["target_probs"].half())),
        ("target_probs", lambda a: a.update(target_probs=a["target_probs"][0])),
        (
            "target_probs",
            lambda a: a.update(
                target_probs=a["target_probs"].transpose(1, 2).contiguous().transpose(1, 2)
            ),
        ),
        ("draft_probs", lambda a: a.update(draft_probs=a["draft_probs"][:, :1])),
        ("draft_probs", lambda a: a.update(draft_probs=a["draft_probs"].double())),
        ("draft_tokens", lambda a: a.update(draft_tokens=a["draft_tokens"].float())),
        ("draft_tokens", lambda a: a.update(draft_tokens=a["draft_tokens"][:, :1])),
        ("num_draft", lambda a: a.update(num_draft=a["num_draft"][:1])),
        ("num_draft", lambda a: a.update(num_draft=a["num_draft"].float())),
        ("uniforms", lambda a: a.update(uniforms=a["uniforms"].double())),
        ("uniforms", lambda a: a.update(uniforms=None)),
        ("residual_uniforms", lambda a: a.update(residual_uniforms=a["residual_uniforms"].T)),
        ("bonus_uniforms", lambda a: a.update(bonus_uniforms=a["bonus_uniforms"][:, None])),
    ],
)
def test_launcher_rejects_bad_arguments(name, change):
    args = _inputs(11, 2, 3, 16, [1, 3])
    change(args)
    with pytest.raises(ValueError, match=f"^{name}:"):
        speculative_verify(**args)


def test_greedy_needs_no_draft_probs_or_uniforms():
    args = _inputs(12, 2, 3, 16, [3, 2])
    ref = verify_reference(**args, greedy=True)
    for key in ("draft_probs", "uniforms", "residual_uniforms", "bonus_uniforms"):
        args[key] = None
    out = speculative_verify(**args, greedy=True)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
