"""top-p is taken over the temperature-scaled distribution, as vLLM does.

The kept set at temperature 3.0, top_p 0.5 is three tokens; over the raw logits
it would be two, so a sampler that filters before scaling fails here.
"""

from __future__ import annotations

import torch

from runtime.ranks.sampling import SamplingBatch, sample

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])
T, P = 3.0, 0.5


def nucleus(probs: torch.Tensor, p: float) -> torch.Tensor:
    """``probs`` cut to the smallest best-first prefix whose mass reaches ``p``, renormalised."""
    order = probs.argsort(descending=True)
    sorted_probs = probs[order]
    keep = (sorted_probs.cumsum(0) - sorted_probs) < p
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out / out.sum()


def test_the_two_nuclei_differ_so_the_test_can_tell_them_apart():
    scaled = nucleus(torch.softmax(LOGITS / T, dim=0), P)
    raw = nucleus(torch.softmax(LOGITS, dim=0), P)
    assert (scaled > 0).sum() == 3 and (raw > 0).sum() == 2


def test_top_p_frequencies_follow_the_scaled_softmax_cut_to_its_nucleus():
    n = 30_000
    rows = SamplingBatch.from_rows([(T, P, -1, 2024, step) for step in range(n)])
    tokens = sample(LOGITS.expand(n, -1), rows)
    observed = torch.bincount(tokens, minlength=len(LOGITS)).double()
    expected = nucleus(torch.softmax(LOGITS.double() / T, dim=0), P) * n
    assert observed[expected == 0].sum() == 0  # nothing outside the nucleus
    kept = expected > 0
    chi2 = float(((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    # 2 degrees of freedom: P(chi2 > 13.8) = 0.001.  The raw-logits nucleus gives
    # chi2 in the thousands (a third of the mass on a token it never samples).
    assert chi2 < 13.8, (observed.tolist(), expected.tolist())
    # And against the raw-logits alternative, for the record: far off.
    raw = nucleus(torch.softmax(LOGITS.double(), dim=0), P)
    assert float((observed / n - raw).abs().max()) > 0.2
