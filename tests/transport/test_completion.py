"""Completion diagnostics (protocol version 3): launch wait, host timestamps,
stage times and the token CRC round-trip and are validated, naming the field."""

from __future__ import annotations

import pytest

from runtime.transport.codec import decode, encode
from runtime.transport.completion import STAGE_NAMES, Completion
from runtime.transport.fields import ProtocolError


def completion(**changes) -> Completion:
    fields = dict(fence=7, rank=1, world_size=2, device_ns=5_000)
    fields.update(changes)
    return Completion(**fields)


def test_diagnostics_round_trip():
    sent = completion(
        launch_wait_ns=1_200,
        host_times=(10, 20, 30, 40),
        stage_ns=(1, 2, 3, 4, 5, 6),
        token_crc=0xDEADBEEF,
    )
    got = decode(encode(sent))
    assert got == sent
    assert (got.launch_wait_ns, got.host_times, got.token_crc) == (
        1_200,
        (10, 20, 30, 40),
        0xDEADBEEF,
    )
    assert len(got.stage_ns) == len(STAGE_NAMES) == 6
    plain = decode(encode(completion()))
    assert (plain.launch_wait_ns, plain.host_times, plain.stage_ns, plain.token_crc) == (
        0,
        (),
        (),
        -1,
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"launch_wait_ns": 5_001}, "launch_wait_ns"),  # more than the interval
        ({"launch_wait_ns": -1}, "launch_wait_ns"),
        ({"host_times": (1, 2, 3)}, "host_times"),
        ({"host_times": (4, 3, 5, 6)}, "host_times"),  # not in order
        ({"host_times": (1, 2, 3, -4)}, "host_times[3]"),
        ({"stage_ns": (1, 2)}, "stage_ns"),
        ({"stage_ns": (1, 2, 3, 4, 5, -6)}, "stage_ns[5]"),
        ({"token_crc": 1 << 32}, "token_crc"),
        ({"token_crc": -2}, "token_crc"),
    ],
)
def test_bad_diagnostics_are_refused_naming_the_field(changes, field):
    with pytest.raises(ProtocolError) as raised:
        completion(**changes)
    assert raised.value.field == field
