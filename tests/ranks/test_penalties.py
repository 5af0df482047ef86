"""Logit bias and penalties in sampling: exact logits against a reference and
transformers' processors, vLLM's order, batch invariance, the device state."""

from __future__ import annotations

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
    sample,
    suppress_eos,
)
from runtime.transport.sampling import MAX_LOGIT_BIAS, SamplingParams
from tests.support.penalty_reference import reference

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
