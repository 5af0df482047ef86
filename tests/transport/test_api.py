"""The frontend's Submit message: the admission group travels and is validated on
receipt like every other field."""

from __future__ import annotations

import msgpack
import pytest

from runtime.transport.api import Submit
from runtime.transport.codec import decode, encode
from runtime.transport.fields import ProtocolError
from runtime.transport.sampling import SamplingParams
from runtime.transport.schema import PROTOCOL_VERSION


def raw(body: dict) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": "Submit", "b": body}, use_bin_type=True)


@pytest.mark.parametrize("group", [None, 0, 7, 2**63 - 1])
def test_submit_carries_its_group(group):
    message = Submit(3, (1, 2, 3), 8, SamplingParams(seed=5), True, group)
    assert decode(encode(message)) == message
    assert message.to_wire()["group"] == group


@pytest.mark.parametrize("group", [-1, True, 1.5, "a", [1], 2**63])
def test_a_bad_group_is_refused_on_receipt_naming_the_field(group):
    body = Submit(3, (1, 2, 3), 8).to_wire()
    with pytest.raises(ProtocolError) as info:
        decode(raw({**body, "group": group}))
    assert info.value.field == "Submit.group"
    with pytest.raises(ProtocolError, match="group"):
        Submit(3, (1, 2, 3), 8, group=group)


def test_a_submit_without_the_group_field_is_refused():
    body = Submit(3, (1, 2, 3), 8).to_wire()
    del body["group"]
    with pytest.raises(ProtocolError, match="group"):
        decode(raw(body))
