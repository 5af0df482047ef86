"""Sampling: exact distributions, filters, seeds, and batch invariance; logit
bias and penalties against transformers' processors, vLLM's order, batch
invariance, the device state; top-p over the temperature-scaled distribution.

top-p is taken over the temperature-scaled distribution, as vLLM does: the kept
set at temperature 3.0, top_p 0.5 is three tokens; over the raw logits it would
be two, so a sampler that filters before scaling fails there.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from runtime.ranks.sampling import (
    LogitAdjustments,
    PenaltyState,
    SamplingBatch,
    adjust_logits,
    bias_table,
    eos_index,
    hash32,
    sample,
    suppress_eos,
    token_logprobs,
    uniform_noise,
)
from runtime.transport.sampling import MAX_LOGIT_BIAS, SamplingParams
from tests.support.penalty_reference import reference


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


# -- logit bias and penalties --------------------------------------------------

VOCAB = 97


def random_case(seed: int, rows: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    prompts = [torch.randint(0, VOCAB, (5 + 3 * r,), generator=gen).tolist() for r in range(rows)]
    outputs = [torch.randint(0, 20, (4 * r,), generator=gen).tolist() for r in range(rows)]
    return logits, prompts, outputs


SETTINGS = [
    SamplingParams(),  # nothing: the raw logits
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),  # < 1 favours repeats
    SamplingParams(frequency_penalty=0.9),
    SamplingParams(presence_penalty=1.3),
    SamplingParams(presence_penalty=-0.7, frequency_penalty=-0.4),
    SamplingParams(logit_bias=((3, 5.0), (11, -100.0), (96, 0.25))),
    SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.8,
        logit_bias=((0, 2.5), (7, -3.0), (19, 1.0)),
    ),
]


@pytest.mark.parametrize("index", range(len(SETTINGS)))
def test_each_setting_gives_the_reference_logits_exactly(index):
    p = SETTINGS[index]
    logits, prompts, outputs = random_case(index, 3)
    adj = LogitAdjustments.from_params([p] * 3, prompts, outputs, VOCAB)
    got = adjust_logits(logits, adj)
    for r in range(3):
        assert torch.equal(got[r], reference(logits[r], p, prompts[r], outputs[r])), r
    if not p.adjusts_logits:
        assert torch.equal(got, logits)
    else:
        assert not torch.equal(got, logits)


def test_lanes_with_different_settings_in_one_batch_are_batch_invariant():
    rows = len(SETTINGS) * 2
    logits, prompts, outputs = random_case(99, rows)
    params = SETTINGS * 2
    adj = LogitAdjustments.from_params(params, prompts, outputs, VOCAB)
    together = adjust_logits(logits, adj)
    for r in range(rows):
        alone = LogitAdjustments.from_params([params[r]], [prompts[r]], [outputs[r]], VOCAB)
        assert torch.equal(adjust_logits(logits[r : r + 1], alone)[0], together[r]), r
        assert torch.equal(together[r], reference(logits[r], params[r], prompts[r], outputs[r]))
    # Sampled tokens too, greedy and seeded rows mixed.
    temps = [0.0 if r % 3 == 0 else 0.9 for r in range(rows)]
    sampling = [(temps[r], 0.95, [-1, 30][r % 2], 40 + r, len(outputs[r])) for r in range(rows)]
    batch = SamplingBatch.from_rows(sampling)
    tokens = sample(logits, _with(batch, adj))
    for r in range(rows):
        one = LogitAdjustments.from_params([params[r]], [prompts[r]], [outputs[r]], VOCAB)
        alone = sample(logits[r : r + 1], _with(SamplingBatch.from_rows([sampling[r]]), one))
        assert int(alone) == int(tokens[r]), r


def _with(batch: SamplingBatch, adj: LogitAdjustments) -> SamplingBatch:
    return SamplingBatch(
        batch.temperature, batch.top_p, batch.top_k, batch.seed, batch.step, batch.min_tokens, adj
    )


def test_repetition_penalty_equals_transformers_over_prompt_and_output():
    logits, prompts, outputs = random_case(5, 4)
    for penalty in (1.2, 2.0, 0.5):
        p = SamplingParams(repetition_penalty=penalty)
        adj = LogitAdjustments.from_params([p] * 4, prompts, outputs, VOCAB)
        got = adjust_logits(logits, adj)
        for r in range(4):
            ids = torch.tensor([prompts[r] + outputs[r]])  # HF: the whole input ids
            expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[r : r + 1].clone())
            assert torch.equal(got[r], expected[0]), (penalty, r)


def test_logit_bias_equals_transformers_sequence_bias():
    logits, _, _ = random_case(6, 2)
    pairs = ((2, 4.5), (40, -7.25), (96, 100.0), (0, -100.0))
    p = SamplingParams(logit_bias=pairs)
    adj = LogitAdjustments.from_params([p, p], [[1], [1]], [[], []], VOCAB)
    hf = SequenceBiasLogitsProcessor([[[token], bias] for token, bias in pairs])
    expected = hf(torch.tensor([[1], [1]]), logits.clone())
    assert torch.equal(adjust_logits(logits, adj), expected)


def test_vllm_order_bias_before_repetition_before_frequency_and_presence():
    logits = torch.zeros(1, 4)
    logits[0, 1] = 1.0
    p = SamplingParams(
        logit_bias=((1, 1.0),), repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5
    )
    adj = LogitAdjustments.from_params([p], [[1]], [[1, 1]], 4)
    # (1 + 1) / 2 - 0.25 * 2 - 0.5 = 0: the bias is penalised with the logit (vLLM);
    # a bias after the penalties would give 1 / 2 - 0.5 - 0.5 + 1 = 0.5.
    assert adjust_logits(logits, adj)[0, 1].item() == 0.0
    # Frequency and presence count generated tokens only; prompt tokens only repeat.
    q = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0, repetition_penalty=2.0)
    adj = LogitAdjustments.from_params([q], [[2]], [[3]], 4)
    row = adjust_logits(torch.tensor([[0.0, 0.0, 3.0, 3.0]]), adj)[0]
    assert row.tolist() == [0.0, 0.0, 1.5, 1.5 - 1.0 - 1.0]


def test_greedy_takes_the_argmax_of_the_adjusted_logits():
    logits, prompts, outputs = random_case(7, 6)
    best = logits.argmax(dim=-1)
    params = [SamplingParams(logit_bias=((int(best[r]), -100.0),)) for r in range(6)]
    adj = LogitAdjustments.from_params(params, prompts, outputs, VOCAB)
    greedy = SamplingBatch.from_rows([(0.0, 1.0, -1, 0, 0)] * 6)
    tokens = sample(logits, _with(greedy, adj))
    assert (tokens != best).all()
    assert torch.equal(tokens, adjust_logits(logits, adj).argmax(dim=-1))
    # A penalty alone moves it too: the greedy token was generated 30 times.
    freq = [SamplingParams(frequency_penalty=2.0)] * 6
    adj = LogitAdjustments.from_params(freq, prompts, [[int(b)] * 30 for b in best], VOCAB)
    assert (sample(logits, _with(greedy, adj)) != best).all()


def test_min_tokens_bars_eos_even_with_a_large_bias_and_rows_without_adjustments_are_bitwise():
    logits, prompts, outputs = random_case(8, 4)
    eos = 5
    params = [SamplingParams(logit_bias=((eos, 100.0),)), SamplingParams()] * 2
    adj = LogitAdjustments.from_params(params, prompts, outputs, VOCAB)
    rows = [(0.0, 1.0, -1, 1, 0, 3), (0.0, 1.0, -1, 1, 0, 3), (0.7, 0.9, 10, 2, 4, 3)] * 2
    rows = rows[:4]  # step 0 < min_tokens 3 for rows 0, 1; row 2 past it
    tokens = sample(logits, _with(SamplingBatch.from_rows(rows), adj), eos_index([eos]))
    assert int(tokens[0]) != eos and int(tokens[2]) == eos  # barred, then allowed
    plain = sample(logits, SamplingBatch.from_rows(rows), eos_index([eos]))
    assert int(tokens[1]) == int(plain[1]) and int(tokens[3]) == int(plain[3])
    # Adjusted then masked: the EOS column is -inf, every other column the adjustment.
    step, mins = torch.zeros(4, dtype=torch.long), torch.full((4,), 3)
    masked = suppress_eos(adjust_logits(logits, adj), step, mins, eos_index([eos]))
    assert masked[:, eos].isneginf().all()


def test_unadjusted_rows_sample_bitwise_the_same_with_or_without_adjustments():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(32, VOCAB, generator=gen)
    rows = [
        (0.0 if r % 4 == 0 else 1.1, 0.8, [-1, 12][r % 2], 100 + r, r, r % 3) for r in range(32)
    ]
    neutral = LogitAdjustments.from_params(
        [SamplingParams()] * 32, [[r % VOCAB] for r in range(32)], [[1, 2]] * 32, VOCAB
    )
    batch = SamplingBatch.from_rows(rows)
    assert torch.equal(adjust_logits(logits, neutral), logits)
    eos = eos_index([3, 4])
    assert torch.equal(sample(logits, _with(batch, neutral), eos), sample(logits, batch, eos))


def test_penalised_sampling_follows_the_adjusted_softmax():
    n = 30_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = SamplingParams(
        temperature=1.5, repetition_penalty=1.5, presence_penalty=0.4, logit_bias=((4, 2.0),)
    )
    adj = LogitAdjustments.from_params([p] * n, [[0]] * n, [[1, 1]] * n, 5)
    rows = [(1.5, 1.0, -1, 777, s) for s in range(n)]
    out = sample(base.expand(n, -1), _with(SamplingBatch.from_rows(rows), adj))
    expected = torch.softmax(reference(base, p, [0], [1, 1]) / 1.5, dim=-1)
    freq = torch.bincount(out, minlength=5).float() / n
    assert float((freq - expected).abs().max()) < 0.012


def test_bias_table_pads_with_minus_one_and_refuses_too_many():
    params = [SamplingParams(logit_bias=((4, 1.0), (2, -2.0))), SamplingParams()]
    ids, values = bias_table(params, 3, 4)
    assert ids.tolist() == [[4, 2, -1, -1], [-1] * 4, [-1] * 4]
    assert values.tolist() == [[1.0, -2.0, 0, 0], [0] * 4, [0] * 4]
    assert bias_table([], 1)[0].shape == (1, MAX_LOGIT_BIAS)
    with pytest.raises(ValueError, match="at most 1"):
        bias_table(params, 2, 1)


def test_penalty_state_updates_with_fixed_shapes_and_a_scratch_row():
    state = PenaltyState(4, 10)
    assert state.counts.shape == state.prompt_mask.shape == (5, 10)
    scratch = state.scratch
    state.mark_prompt(torch.tensor([1, 1, 1, scratch]), torch.tensor([3, 3, 7, 0]))
    state.count(torch.tensor([1, 2, scratch]), torch.tensor([3, 9, 9]))
    state.count(torch.tensor([1, 2, scratch]), torch.tensor([3, 5, 9]))
    counts, mask = state.gather(torch.tensor([1, 2, 0]))
    assert counts[0].tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0, 0]
    assert counts[1].tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert mask[0].nonzero().flatten().tolist() == [3, 7] and not mask[1:].any()
    assert counts[2].sum() == 0
    state.reset(torch.tensor([1]))
    counts, mask = state.gather(torch.tensor([1, 2]))
    assert counts[0].sum() == 0 and not mask[0].any() and counts[1].sum() == 2
    state.reset(torch.tensor([scratch]))  # no new generation: only scratch changes
    assert state.counts[2].sum() == 2


# -- top-p after temperature --------------------------------------------------

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
