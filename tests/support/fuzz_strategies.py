"""Hypothesis strategies for frame fuzzing: valid messages of every type, and
ways to break them at the byte level and at the field level.

``valid_messages()``: one valid example of every message type the codec knows
(rank and frontend messages), with variants that exercise the optional parts
(a frame with copies and restores, a state frame, an error completion).
``byte_mutations(data)``: bit flips, truncation, extension, insertion,
overwrites and duplicated runs of an encoded message.  ``field_mutations(wire)``:
the decoded msgpack tree with one node replaced by junk (wrong types, NaN,
infinities, negative and out-of-range numbers, huge strings), a key deleted or
added, or a value wrapped in a list.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import msgpack
from hypothesis import strategies as st

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.transport.api import (
    Cancel,
    Output,
    Publish,
    Status,
    StatusQuery,
    Submit,
    TokenLogprobs,
)
from runtime.transport.codec import MESSAGE_TYPES, encode
from runtime.transport.columns import column
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams
from runtime.transport.schema import PROTOCOL_VERSION, Message
from runtime.transport.tensor import Tensor
from tests.support import transport_examples as examples

# --------------------------------------------------------------- valid messages


def restoring_frame() -> Frame:
    """A prefill lane resuming a known sequence, with page copies."""
    lane = FrameLane(
        slot=2,
        generation=5,
        phase="prefill",
        prompt_start=4,
        prompt_tokens=(9, 8),
        position=4,
        pages=(10, 11),
        commits=1,
        sampling=SamplingParams(),
        restore=Restore((1, 2, 3, 4, 9, 8), 6),
    )
    prefill = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
    return Frame.from_lanes(21, prefill, [lane], copies=((3, 10),), expected_ns=7)


def state_frame() -> Frame:
    """A RESTORE program: one restore row (record and settings) and one terminal row."""
    restore = GraphDescriptor(GraphKind.RESTORE, 4)
    lanes = [
        FrameLane(1, 3, "state", 2, (), 2, (4,), 0, SamplingParams(), Restore((5, 6, 7), 3)),
        FrameLane(2, 1, "state", 0, (), 0, (), 0),
    ]
    return Frame.from_lanes(22, restore, lanes)


def error_completion() -> Completion:
    return Completion(23, 1, 2, device_ns=0, error="rejected: slot 4 has no state")


def logprob_completion() -> Completion:
    """Rank 0 of one lane asking for two log probabilities: (1, 3) and (1, 2) sidecars."""
    return Completion(
        24,
        0,
        1,
        device_ns=900,
        launch_wait_ns=100,
        slot=column([0]),
        generation=column([1]),
        token_count=column([1]),
        tokens=column([17]),
        finished=column([0]),
        sidecars={
            "logprobs": Tensor.from_values("float32", (1, 3), [-0.5, -0.5, -1.5]),
            "logprob_token_ids": Tensor.from_values("int32", (1, 2), [17, 4]),
        },
        host_times=(1, 2, 3, 4),
        stage_ns=(1, 2, 3, 4, 5, 6),
        token_crc=0x1234,
    )


def api_messages() -> list[Message]:
    top = TokenLogprobs(-0.25, (3, 4), (-0.25, -2.0))
    return [
        Submit(
            7, (1, 2, 3), 16, examples.sampling(), group=2, cache_salt="t", message_endpoints=(2,)
        ),
        Cancel(7),
        Publish(7, 3, 123_456),
        StatusQuery(5),
        top,
        Output(7, 3, (3,), "stop", logprobs=(top,), cached_tokens=1),
        Status(5, True, "m", 100, 4096, 2, 8, 1024, {"a": 1.5}, {"decode B=1": 10}),
        *(MESSAGE_TYPES[name](3, True) for name in ("Heartbeat",) if name in MESSAGE_TYPES),
    ]


def valid_messages() -> list[Message]:
    """One valid message of every type the codec knows, and variants."""
    out: list[Message] = [make() for make in examples.ALL.values()]
    out += [examples.decode_frame(8), restoring_frame(), state_frame()]
    out += [error_completion(), logprob_completion()]
    out += [Control("error", 0, reason="undecodable: malformed msgpack"), Control("heartbeat")]
    out += api_messages()
    return out


VALID = valid_messages()
ENCODED = [encode(m) for m in VALID]

# --------------------------------------------------------------- junk values

INTERESTING_INTS = (
    -(2**63),
    -(2**31) - 1,
    -1,
    0,
    1,
    2,
    63,
    64,
    2**31 - 1,
    2**31,
    2**32,
    2**63 - 1,
    2**64 - 1,
)
INTERESTING_FLOATS = (math.nan, -math.nan, math.inf, -math.inf, -1.0, -0.0, 0.5, 1e308, -1e-300)

junk_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(INTERESTING_INTS),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from(INTERESTING_FLOATS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=24),
    st.sampled_from(["", "x" * 300, "prefill", "decode", "stop", "float32", "bfloat16"]),
)
junk_values = st.recursive(
    junk_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=6), inner, max_size=3),
    ),
    max_leaves=8,
)


# --------------------------------------------------------------- byte mutations


def _flip(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(out))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def _truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def _extend(data: bytes, rng: random.Random) -> bytes:
    return data + rng.randbytes(rng.randint(1, 16))


def _insert(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + rng.randbytes(rng.randint(1, 8)) + data[i:]


def _overwrite(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data))
    chunk = rng.randbytes(rng.randint(1, 8))
    return data[:i] + chunk + data[i + len(chunk) :]


def _duplicate(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data))
    j = rng.randint(i, min(len(data), i + 32))
    return data[:j] + data[i:j] + data[j:]


def _delete(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data))
    return data[:i] + data[i + rng.randint(1, 8) :]


BYTE_MUTATIONS: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "flip": _flip,
    "truncate": _truncate,
    "extend": _extend,
    "insert": _insert,
    "overwrite": _overwrite,
    "duplicate": _duplicate,
    "delete": _delete,
}


def mutate_bytes(data: bytes, rng: random.Random, rounds: int = 1) -> bytes:
    for _ in range(rounds):
        if not data:
            return rng.randbytes(rng.randint(0, 8))
        data = BYTE_MUTATIONS[rng.choice(sorted(BYTE_MUTATIONS))](data, rng)
    return data


@st.composite
def mutated_bytes(draw: st.DrawFn) -> tuple[str, bytes]:
    """(the original's type, an encoded valid message broken at the byte level)."""
    index = draw(st.integers(0, len(ENCODED) - 1))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    rounds = draw(st.integers(1, 3))
    return type(VALID[index]).__name__, mutate_bytes(ENCODED[index], rng, rounds)


# --------------------------------------------------------------- field mutations


def envelope_of(message: Message) -> dict[str, Any]:
    """The message's envelope as the msgpack tree the receiver unpacks."""
    return msgpack.unpackb(encode(message), raw=False)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) into ``node``, the root included."""
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _get(node: Any, path: tuple) -> Any:
    for key in path:
        node = node[key]
    return node


def _set(node: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(node, path[:-1])[path[-1]] = value
    return node


@st.composite
def field_mutations(draw: st.DrawFn, tree: Any | None = None) -> tuple[str, Any, Any]:
    """(a description, the envelope tree of a valid message with one node broken,
    the original message)."""
    if tree is None:
        index = draw(st.integers(0, len(VALID) - 1))
        original = VALID[index]
        tree = envelope_of(original)
    else:
        original = None
    paths = _paths(tree)
    path = draw(st.sampled_from(paths))
    target = _get(tree, path)
    ops = ["replace", "wrap"]
    if isinstance(target, dict):
        ops += ["add_key"]
        if target:
            ops += ["delete_key"]
    if isinstance(target, list) and target:
        ops += ["drop_item", "repeat_item"]
    op = draw(st.sampled_from(ops))
    if op == "replace":
        tree = _set(tree, path, draw(junk_values))
    elif op == "wrap":
        tree = _set(tree, path, [target])
    elif op == "add_key":
        target[draw(st.text(min_size=1, max_size=12))] = draw(junk_values)
    elif op == "delete_key":
        del target[draw(st.sampled_from(sorted(target)))]
    elif op == "drop_item":
        del target[draw(st.integers(0, len(target) - 1))]
    else:
        target.append(target[draw(st.integers(0, len(target) - 1))])
    return f"{op} at {list(path)}", tree, original


def pack(tree: Any) -> bytes | None:
    """The tree as msgpack bytes; None when msgpack cannot pack it (ints beyond 64 bits)."""
    try:
        return msgpack.packb(tree, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return None


def envelope(type_name: str, body: Any, version: Any = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"v": version, "t": type_name, "b": body}, use_bin_type=True)
