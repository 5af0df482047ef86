"""The engine's per-lane slicing of rank 0's log-probability sidecars.

Every lane's row is distinct, and lanes ask for fewer entries than the sidecar
width, so a slice with a wrong stride (a lane's own ``k`` or the largest ask
instead of the sidecar's width) lands in another lane's row and fails here.
"""

from __future__ import annotations

import pytest
import torch

from runtime.coordinator.engine.answers import lane_logprobs
from runtime.coordinator.engine.config import EngineError
from runtime.ranks.sampling import token_logprobs
from runtime.transport.completion import Completion
from runtime.transport.tensor import tensor_from_torch


def completion(lanes: int, width: int, vocab: int, seed: int = 0):
    """Rank 0's sidecars as the worker builds them, from random logits per lane."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(lanes, vocab, generator=gen) * 2
    tokens = torch.randint(0, vocab, (lanes,), generator=gen)
    chosen, top_values, top_ids = token_logprobs(logits, tokens, width)
    values = torch.cat([chosen[:, None], top_values], dim=1)  # (R, 1 + K)
    sidecars = {
        "logprobs": tensor_from_torch(values),
        "logprob_token_ids": tensor_from_torch(top_ids.to(torch.int32)),
    }
    return Completion(7, 0, 1, device_ns=1, sidecars=sidecars), logits, tokens


@pytest.mark.parametrize(
    "asked",
    [
        [3, 2, 5, 1],  # the widest lane sets K = 5; the others ask fewer
        [0, 4, -1, 2, 5],  # a lane asking none between lanes that ask
        [1, 1, 5],  # two narrow lanes before the widest
    ],
)
def test_each_lane_gets_its_own_row(asked):
    width = max(asked)
    answer, logits, tokens = completion(len(asked), width, vocab=40, seed=len(asked))
    logp = torch.log_softmax(logits, dim=-1)
    out = lane_logprobs(answer, asked)
    assert len(out) == len(asked)
    for lane, k in enumerate(asked):
        entry = out[lane]
        if k < 0:
            assert entry is None
            continue
        top = logp[lane].topk(k)
        assert entry.top_token_ids == tuple(top.indices.tolist()), lane
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6), lane
        assert entry.logprob == pytest.approx(float(logp[lane, tokens[lane]]), abs=1e-6)
    # The rows are distinct, so no lane's entries could have come from another row.
    firsts = [out[lane].top_token_ids[:1] for lane, k in enumerate(asked) if k > 0]
    assert len(set(firsts)) > 1


def test_lanes_asking_more_than_the_sidecar_holds_get_its_width():
    # A 10-token vocabulary holds 10 alternatives: K is 10 while a lane asked 20.
    asked = [20, 3, 20, 7]
    answer, logits, _ = completion(len(asked), 10, vocab=10, seed=3)
    logp = torch.log_softmax(logits, dim=-1)
    out = lane_logprobs(answer, asked)
    for lane, k in enumerate(asked):
        k = min(k, 10)
        assert out[lane].top_token_ids == tuple(logp[lane].topk(k).indices.tolist()), lane
        assert len(out[lane].top_logprobs) == k


def test_missing_or_unasked_sidecars_give_none_and_a_short_sidecar_is_an_error():
    answer, _, _ = completion(2, 3, vocab=20)
    assert lane_logprobs(answer, [-1, -1]) == [None, None]
    assert lane_logprobs(Completion(7, 0, 1, device_ns=1), [2, 3]) == [None, None]
    with pytest.raises(EngineError, match="do not fit 3 lanes"):
        lane_logprobs(answer, [1, 1, 1])
