"""SamplingParams' logit adjustments on the wire: bounds named, pairs round-trip."""

from __future__ import annotations

import pytest

from runtime.transport.codec import decode, encode
from runtime.transport.fields import ProtocolError
from runtime.transport.sampling import MAX_LOGIT_BIAS, SamplingParams


def test_defaults_adjust_nothing():
    params = SamplingParams()
    assert not params.adjusts_logits
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert params.repetition_penalty == 1.0 and params.logit_bias == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 0.5},
        {"frequency_penalty": -2},
        {"repetition_penalty": 1.3},
        {"logit_bias": ((5, -100.0), (7, 2.5))},
    ],
)
def test_adjustments_round_trip_and_count(kwargs):
    params = SamplingParams(**kwargs)
    assert params.adjusts_logits
    assert decode(encode(params)) == params


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"logit_bias": ((1, 100.5),)}, r"logit_bias\[0\]\[1\]"),
        ({"logit_bias": ((-1, 1.0),)}, r"logit_bias\[0\]\[0\]"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
        ({"logit_bias": ((1,),)}, r"logit_bias\[0\]"),
        ({"logit_bias": tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))}, "logit_bias"),
    ],
)
def test_bad_adjustments_name_the_field(kwargs, field):
    with pytest.raises(ProtocolError, match=field):
        SamplingParams(**kwargs)
