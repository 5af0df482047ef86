"""Columnar messages (protocol version 2): int64 columns, their checks, Frame and Completion."""

from __future__ import annotations

import dataclasses
import random
import struct
from array import array

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.transport import columns
from runtime.transport.codec import decode, encode
from runtime.transport.columns import (
    all_equal,
    as_column,
    check_range,
    column,
    column_from_wire,
    column_to_wire,
    first_not,
    offsets,
)
from runtime.transport.completion import Completion, LaneResult
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams
from tests.support import transport_examples as examples

INT64_MAX = 2**63 - 1
MIXED_8 = GraphDescriptor(GraphKind.MIXED, 8, token_capacity=1, prompt_capacity=128)
PREFILL = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)


def refused(build, field: str) -> str:
    with pytest.raises(ProtocolError) as raised:
        build()
    assert raised.value.field == field, raised.value
    return raised.value.reason


# ---------------------------------------------------------------- column helpers


@pytest.mark.parametrize("values", [[], [0], [1, -1, 2**31, -(2**63), INT64_MAX], list(range(64))])
def test_columns_round_trip_as_little_endian_int64(values: list[int]) -> None:
    col = column(values)
    data = column_to_wire(col)
    assert data == struct.pack(f"<{len(values)}q", *values)
    assert column_from_wire("c", data) == col
    assert column_from_wire("c", bytearray(data)) == col


def test_big_endian_hosts_byteswap_on_the_way_out_and_in() -> None:
    """``native_little=False`` plays a big-endian host on this machine."""
    values = [1, 258, -2, 2**40 + 7]
    col = column(values)
    swapped = column_to_wire(col, native_little=False)
    assert swapped == struct.pack(f">{len(values)}q", *values)  # native bytes reversed per value
    assert col == column(values)  # the column itself is left alone
    assert column_from_wire("c", swapped, native_little=False) == col
    # A big-endian host reading little-endian wire bytes swaps them into its own order.
    wire = column_to_wire(col)
    on_big_host = column_from_wire("c", wire, native_little=False)
    assert on_big_host.tobytes() == struct.pack(f">{len(values)}q", *values)


@pytest.mark.parametrize(
    ("data", "reason"),
    [("abc", "must be int64 bytes"), ([1, 2], "must be int64 bytes"), (b"\x00" * 9, "whole")],
)
def test_column_from_wire_refuses_what_is_not_int64_bytes(data: object, reason: str) -> None:
    assert reason in refused(lambda: column_from_wire("pages", data), "pages")


def test_column_from_wire_caps_the_length() -> None:
    refused(lambda: column_from_wire("pages", b"\x00" * 24, max_len=2), "pages")


def test_as_column_takes_int64_arrays_as_they_are_and_copies_int_lists() -> None:
    col = column([1, 2])
    assert as_column("c", col) is col
    assert as_column("c", [1, 2]) == col and as_column("c", (1, 2)) == col
    assert as_column("c", range(3)) == column([0, 1, 2])
    refused(lambda: as_column("c", array("i", [1])), "c")
    refused(lambda: as_column("c", [1, True]), "c[1]")
    refused(lambda: as_column("c", [2**63]), "c[0]")
    refused(lambda: as_column("c", b"\x00" * 8), "c")
    refused(lambda: as_column("c", column([1, 2, 3]), max_len=2), "c")


@pytest.mark.parametrize(
    ("lo", "hi"),
    [
        *[(0, 63), (1, INT64_MAX), (0, 1), (0, 2**31 - 1), (3, 7), (0, INT64_MAX), (0, 0)],
        *[(0, 100), (2, 2**16), (5, INT64_MAX - 1), (-5, 5)],  # hi + 1 not a power of two
    ],
)
def test_check_range_agrees_with_comparing_every_value(lo: int, hi: int) -> None:
    rng = random.Random(lo * 31 + hi)
    edges = [lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, 0, -1, -(2**63), INT64_MAX, 2**31, 64]
    edges = [v for v in edges if -(2**63) <= v <= INT64_MAX]
    for _ in range(400):
        n = rng.choice([1, 2, 5, 64, 300])
        values = [rng.randint(lo, hi) for _ in range(n)]
        for i in rng.sample(range(n), min(n, rng.choice([0, 0, 1, 3]))):
            values[i] = rng.choice(edges)  # in range or just outside it
        bad = next((i for i, v in enumerate(values) if not lo <= v <= hi), None)
        if bad is None:
            check_range("c", column(values), lo, hi)
        else:
            refused(lambda values=values: check_range("c", column(values), lo, hi), f"c[{bad}]")
    check_range("c", column(), lo, hi)


def test_lane_ranges_check_several_columns_at_once_and_name_the_culprit() -> None:
    ranges = columns.LaneRanges(("a", 0, 63), ("b", 1, INT64_MAX), ("c", 2, 100), ("d", 0, 1))
    rng = random.Random(7)
    for _ in range(300):
        n = rng.choice([1, 3, 64])
        cols = [
            column(rng.randint(0, 63) for _ in range(n)),
            column(rng.randint(1, INT64_MAX) for _ in range(n)),
            column(rng.randint(2, 100) for _ in range(n)),
            column(rng.randint(0, 1) for _ in range(n)),
        ]
        ranges.check(cols)
        k, i = rng.randrange(4), rng.randrange(n)
        name, lo, hi = ranges.bounds[k]
        cols[k][i] = rng.choice([lo - 1, hi + 1] if hi < INT64_MAX else [lo - 1, -(2**63)])
        refused(lambda cols=cols: ranges.check(cols), f"{name}[{i}]")
    with pytest.raises(ValueError):
        columns.LaneRanges(("a", -1, 5))


def test_constant_checks_offsets_and_first_not() -> None:
    assert all_equal(column([1] * 64), 1) and not all_equal(column([1, 1, 0]), 1)
    assert all_equal(column(), 5)
    assert first_not(column([1, 1, 3, 1]), 1) == 2 and first_not(column([1, 1]), 1) == -1
    assert offsets(column([2, 0, 3])) == column([0, 2, 2, 5])
    assert offsets([]) == column([0])


def test_column_to_torch_reads_the_column_in_place() -> None:
    torch = pytest.importorskip("torch")
    col = column([5, -1, 2**40])
    tensor = columns.column_to_torch(col)
    assert tensor.dtype == torch.int64 and tensor.tolist() == [5, -1, 2**40]
    col[0] = 6  # the tensor shares the column's memory
    assert tensor[0].item() == 6
    assert columns.column_to_torch(column()).shape == (0,)


# ---------------------------------------------------------------- frames


def test_a_64_lane_decode_frame_round_trips_with_no_pages() -> None:
    frame = examples.decode_frame(64)
    assert frame.num_lanes == 64 and frame.pages == column() and frame.sampling == ()
    data = encode(frame)
    assert len(data) < 64 * 8 * 8 + 512  # eight int64 columns and a small header
    carried = decode(data)
    assert carried == frame and carried.expected_ns == 1_500_000
    lanes = carried.lanes
    assert [lane.slot for lane in lanes] == list(range(64))
    assert {(lane.phase, lane.commits, lane.query_len, lane.pages) for lane in lanes} == {
        ("decode", 1, 1, ())
    }
    assert Frame.from_lanes(11, frame.program, lanes, expected_ns=1_500_000) == frame


def test_lanes_view_cuts_the_flat_columns_by_lane() -> None:
    sampling = SamplingParams(temperature=0.5, seed=3)
    lanes = (
        FrameLane(5, 2, "decode", 3, (), 12, (), 1),
        FrameLane(1, 1, "prefill", 16, (7, 8, 9), 16, (4,), 0, sampling),
        FrameLane(0, 4, "decode", 9, (), 30, (6, 2), 1),
    )
    frame = Frame.from_lanes(3, MIXED_8, lanes, prompt_row=1, release_slots=(7,))
    assert frame.prompt_tokens == column([7, 8, 9]) and frame.pages == column([4, 6, 2])
    assert frame.query_len == column([1, 3, 1]) and frame.page_count == column([0, 1, 2])
    assert frame.prompt_offsets() == column([0, 0, 3, 3])
    assert frame.page_offsets() == column([0, 0, 1, 3])
    assert frame.sampling == ((1, sampling),)
    assert frame.lanes == lanes and decode(encode(frame)).lanes == lanes


def test_pages_need_only_be_distinct_within_a_lane() -> None:
    frame = examples.frame()
    shared = dataclasses.replace(frame, pages=column([5, 6, 7, 5]))  # lane 1 appends page 5 too
    assert shared.lanes[1].pages == (7, 5)
    reason = refused(lambda: dataclasses.replace(frame, pages=column([5, 6, 7, 7])), "pages")
    assert "lane 1" in reason


def test_a_prefill_lane_past_position_0_may_append_no_pages() -> None:
    lane = FrameLane(2, 1, "prefill", 64, tuple(range(64)), 64, (), 1, SamplingParams())
    assert Frame.from_lanes(1, PREFILL, [lane]).page_count == column([0])
    at_zero = dataclasses.replace(lane, prompt_start=0, position=0)
    refused(lambda: Frame.from_lanes(1, PREFILL, [at_zero]), "page_count[0]")


def test_prompt_tokens_fit_the_program_and_decode_programs_take_no_prefill_lane() -> None:
    lane = FrameLane(2, 1, "prefill", 0, tuple(range(65)), 0, (1,), 1, SamplingParams())
    assert "prompt_capacity 64" in refused(
        lambda: Frame.from_lanes(1, PREFILL, [lane]), "prompt_tokens"
    )
    small = dataclasses.replace(lane, prompt_tokens=(1,))
    refused(lambda: Frame.from_lanes(1, examples.DECODE, [small]), "prompt_tokens")


def test_a_mixed_frame_has_at_most_one_prefill_lane() -> None:
    lanes = [examples.prefill_lane(3), examples.prefill_lane(5)]
    assert "one prefill lane" in refused(lambda: Frame.from_lanes(1, MIXED_8, lanes, 0), "phase")


def test_sampling_names_exactly_the_prefill_lanes_in_order() -> None:
    frame = examples.frame()
    params = examples.sampling()
    for bad in [(), ((1, params),), ((0, params), (0, params)), ((0, params), (1, params))]:
        refused(lambda bad=bad: dataclasses.replace(frame, sampling=bad), "sampling")
    decoders = examples.decode_frame(4)
    refused(lambda: dataclasses.replace(decoders, sampling=((0, params),)), "sampling")


def test_frames_compare_by_value_and_keep_their_field_order() -> None:
    names = [f.name for f in dataclasses.fields(Frame)]
    assert names == [
        "fence", "program", "slot", "generation", "phase", "position", "query_len", "commits",
        "prompt_start", "prompt_tokens", "page_count", "pages", "sampling", "prompt_row",
        "release_slots", "expected_ns", "copies", "restores", "score_next", "score_k",
        "image_base", "pixels", "feature_rows",
    ]  # fmt: skip
    assert examples.frame() == examples.frame()
    assert examples.frame() != dataclasses.replace(examples.frame(), position=column([0, 18]))


# ---------------------------------------------------------------- completions


def test_completion_columns_and_lane_results() -> None:
    results = (
        LaneResult(3, 2, (42,), "stop"),
        LaneResult(4, 1, ()),  # a prefill chunk that commits nothing
        LaneResult(9, 7, (5, 6, 7)),
    )
    completion = Completion.from_results(4, 0, 2, 100, lanes=results)
    assert completion.token_count == column([1, 0, 3])
    assert completion.tokens == column([42, 5, 6, 7])
    assert completion.finished == column([1, 0, 0])
    assert completion.num_lanes == 3
    carried = decode(encode(completion))
    assert carried == completion and carried.lane_results() == results


def test_a_64_lane_completion_round_trips() -> None:
    results = tuple(LaneResult(s, 1, (s + 100,), "stop" if s % 7 == 0 else None) for s in range(64))
    completion = Completion.from_results(4, 0, 1, 100, lanes=results)
    assert decode(encode(completion)).lane_results() == results


def test_other_ranks_and_error_completions_carry_no_lanes() -> None:
    lane = (examples.lane_result(),)
    assert "only rank 0" in refused(lambda: Completion.from_results(4, 1, 2, 5, lanes=lane), "slot")
    refused(lambda: Completion.from_results(4, 0, 2, 5, lanes=lane, error="boom"), "error")
    assert Completion(4, 1, 2, 5).slot == column()
