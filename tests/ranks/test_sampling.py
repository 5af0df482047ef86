"""Sampling: exact distributions, filters, seeds, and batch invariance."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.ranks.sampling import (
    SamplingBatch,
    eos_index,
    hash32,
    sample,
    suppress_eos,
    token_logprobs,
    uniform_noise,
)


def lowbias32(x: int) -> int:
    """Pure-Python reference of the hash (unsigned 32-bit arithmetic)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_matches_the_unsigned_reference():
    rng = random.Random(0)
    values = [0, 1, 0xFFFFFFFF, 0x80000000] + [rng.getrandbits(32) for _ in range(2000)]
    got = hash32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [lowbias32(v) for v in values]


def test_noise_is_strictly_inside_unit_interval_and_uniform():
    u = uniform_noise(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 4096)
    assert u.shape == (64, 4096)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    # Ten equal bins hold about a tenth each.
    counts = torch.histc(u, bins=10, min=0.0, max=1.0) / u.numel()
    assert float((counts - 0.1).abs().max()) < 0.005


def batch(n: int, temperature=1.0, top_p=1.0, top_k=-1, seed=0, steps=None) -> SamplingBatch:
    steps = range(n) if steps is None else steps
    return SamplingBatch.from_rows([(temperature, top_p, top_k, seed, s) for s in steps])


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def test_temperature_zero_is_greedy():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, batch(8, temperature=0.0))
    assert torch.equal(out, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_samples_follow_the_tempered_softmax(temperature):
    n = 40_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    out = sample(base.expand(n, -1), batch(n, temperature=temperature, seed=12345))
    expected = torch.softmax(base / temperature, dim=-1)
    # Standard error of a frequency is at most 0.0025 here; allow four of them.
    assert float((frequencies(out, 5) - expected).abs().max()) < 0.01


def test_top_k_keeps_only_the_k_best():
    n = 20_000
    base = torch.tensor([0.3, 2.0, 1.0, 1.5, -1.0])
    out = sample(base.expand(n, -1), batch(n, top_k=2, seed=7))
    freq = frequencies(out, 5)
    assert set(torch.nonzero(freq).flatten().tolist()) == {1, 3}
    expected = torch.softmax(torch.tensor([2.0, 1.5]), dim=-1)
    assert abs(float(freq[1]) - float(expected[0])) < 0.015
    assert torch.equal(sample(base.expand(50, -1), batch(50, top_k=1)), torch.full((50,), 1))


def test_top_p_keeps_the_nucleus():
    n = 20_000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(n, -1)
    # p = 0.7: 0.5 alone is short of 0.7, 0.5 + 0.3 reaches it: keep tokens 0 and 1.
    freq = frequencies(sample(logits, batch(n, top_p=0.7, seed=3)), 4)
    assert float(freq[2] + freq[3]) == 0.0
    assert abs(float(freq[0]) - 0.5 / 0.8) < 0.015
    # A tiny p keeps the best token only.
    assert torch.equal(
        sample(logits[:100], batch(100, top_p=1e-6)), torch.zeros(100, dtype=torch.long)
    )


def test_same_seed_and_step_same_token_new_step_new_noise():
    logits = torch.zeros(1, 1000)
    a = sample(logits, batch(1, seed=99, steps=[5]))
    b = sample(logits, batch(1, seed=99, steps=[5]))
    assert torch.equal(a, b)
    draws = {int(sample(logits, batch(1, seed=99, steps=[s]))) for s in range(20)}
    assert len(draws) > 15  # uniform over 1000 tokens: repeats are rare
    other = {int(sample(logits, batch(1, seed=100, steps=[s]))) for s in range(20)}
    assert draws != other


def test_rows_are_batch_invariant():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 300, generator=gen)
    rows = [(0.0 if i % 4 == 0 else 0.8, 0.9, [-1, 20][i % 2], 1000 + i, 3 * i) for i in range(16)]
    together = sample(logits, SamplingBatch.from_rows(rows))
    alone = torch.cat(
        [sample(logits[i : i + 1], SamplingBatch.from_rows([rows[i]])) for i in range(16)]
    )
    assert torch.equal(together, alone)
    # A different batch around row 3 does not change row 3.
    shuffled = [rows[3], rows[7], rows[0]]
    picked = sample(logits[[3, 7, 0]], SamplingBatch.from_rows(shuffled))
    assert int(picked[0]) == int(together[3])


def test_eos_index_holds_the_distinct_ids_and_may_be_empty():
    ids = eos_index([7, 2, 7])
    assert ids.dtype == torch.int64 and ids.tolist() == [2, 7]
    logits = torch.randn(3, 10)
    rows = SamplingBatch.from_rows([(0.0, 1.0, -1, 0, 0, 5)] * 3)
    assert torch.equal(sample(logits, rows, eos_index([])), logits.argmax(dim=-1))
    masked = suppress_eos(logits, rows.step, rows.min_tokens, eos_index([]))
    assert torch.equal(masked, logits)


def test_min_tokens_bars_eos_only_below_the_count_and_changes_nothing_else():
    gen = torch.Generator().manual_seed(8)
    n, vocab, eos = 400, 60, [3, 59]
    logits = torch.randn(n, vocab, generator=gen)
    logits[::2, 3] += 6.0  # EOS would win in half the rows
    rows = [  # (temperature, top_p, top_k, seed, step, min_tokens)
        (0.0 if i % 3 == 0 else 1.0, [1.0, 0.8][i % 2], [-1, 10][i % 5 == 0], 50 + i, i % 7,
         [0, 4, 9][i % 3])
        for i in range(n)
    ]  # fmt: skip
    params = SamplingBatch.from_rows(rows)
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[eos] = True
    free = sample(logits, params)  # no EOS ids given: nothing barred
    barred = sample(logits, params, eos_index(eos))
    below = params.step < params.min_tokens
    assert below.any() and (~below).any()
    assert torch.equal(barred[~below], free[~below])  # min_tokens reached: bitwise the same
    assert not mask[barred[below]].any()  # never EOS below the count
    won_by_eos = mask[free]
    assert (below & won_by_eos).any()
    # Without top-k/top-p (whose kept set EOS's mass shapes), only rows EOS won change.
    unfiltered = below & ~won_by_eos & (params.top_p == 1.0) & (params.top_k < 0)
    assert unfiltered.sum() > 10
    assert torch.equal(barred[unfiltered], free[unfiltered])
    # Zero min_tokens everywhere is bitwise the unmasked sampler.
    zero = SamplingBatch.from_rows([r[:5] for r in rows])
    assert torch.equal(sample(logits, zero, eos_index(eos)), free)
    # Greedy rows below the count take the best non-EOS token.
    masked = suppress_eos(logits, params.step, params.min_tokens, eos_index(eos))
    assert masked[below][:, eos].isneginf().all() and torch.equal(masked[~below], logits[~below])
    assert torch.equal(masked[:, ~mask], logits[:, ~mask])
    greedy_rows = below & (params.temperature == 0)
    assert torch.equal(barred[greedy_rows], masked[greedy_rows].argmax(dim=-1))


def test_token_logprobs_are_the_raw_log_softmax():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 300, generator=gen) * 3).to(torch.bfloat16)
    tokens = torch.tensor([0, 5, 299, 17, 17, 100])
    chosen, values, ids = token_logprobs(logits, tokens, 20)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert chosen.dtype == values.dtype == torch.float32 and ids.dtype == torch.int64
    assert values.shape == ids.shape == (6, 20)
    assert torch.equal(chosen, reference[torch.arange(6), tokens])
    top = reference.topk(20, dim=-1)
    assert torch.equal(values, top.values) and torch.equal(ids, top.indices)
    assert (values[:, :-1] >= values[:, 1:]).all()
    assert torch.equal(reference.gather(1, ids), values)
    # Rows are independent of their batch.
    alone = token_logprobs(logits[2:3], tokens[2:3], 20)
    assert torch.equal(alone[0], chosen[2:3]) and torch.equal(alone[2], ids[2:3])


def test_a_temperature_beyond_float32_never_picks_a_barred_eos():
    import torch

    from runtime.ranks.sampling import SamplingBatch, eos_index, sample

    logits = torch.randn(4, 50)
    logits[:, 7] = 100.0  # EOS would win
    huge = torch.full((4,), float("inf"))  # 1e39 in float32
    steps = torch.zeros(4, dtype=torch.long)
    params = SamplingBatch(
        huge, torch.ones(4), torch.full((4,), -1), torch.arange(4), steps, torch.full((4,), 5)
    )
    tokens = sample(logits, params, eos_index([7], "cpu"))
    assert (tokens != 7).all() and (tokens >= 0).all() and (tokens < 50).all()
