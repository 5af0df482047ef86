"""The replay's costs: the median of each graph's recorded intervals, and the rule that
prices the graphs a trace never ran from their measured neighbours."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import mixed_shapes
from scripts.scheduling_sim.replay.costs import CostError, MeasuredCosts, parse_program

PREFILL, DECODE, MIXED = GraphKind.PREFILL, GraphKind.DECODE, GraphKind.MIXED


def frames(*measured: tuple[GraphDescriptor, list[int]]) -> list[dict]:
    out = []
    for desc, intervals in measured:
        for ns in intervals:
            out.append(
                {
                    "graph": desc.describe(),
                    "kind": desc.kind.value,
                    "batch_capacity": desc.batch_capacity,
                    "token_capacity": desc.token_capacity,
                    "proposal_depth": desc.proposal_depth,
                    "target_capacity": desc.target_capacity,
                    "prompt_capacity": desc.prompt_capacity,
                    "device_ns": ns,
                }
            )
    return out


def prefill(c: int, b: int = 1) -> GraphDescriptor:
    return GraphDescriptor(PREFILL, b, prompt_capacity=c)


def decode(b: int) -> GraphDescriptor:
    return GraphDescriptor(DECODE, b)


def test_a_measured_graph_costs_its_median_interval():
    costs = MeasuredCosts(frames((decode(1), [3, 9, 4, 100, 5]), (prefill(64), [10, 12])))
    assert costs.duration_ns(decode(1)) == 5
    assert costs.duration_ns(prefill(64)) == 11
    assert costs.samples[decode(1)] == 5 and costs.priced == {}


def test_between_two_measured_sizes_the_price_is_interpolated():
    costs = MeasuredCosts(frames((prefill(64), [10_000]), (prefill(256), [40_000])))
    assert costs.duration_ns(prefill(128)) == 20_000
    priced = costs.priced[prefill(128)]
    assert priced.rule == "interpolated"
    assert priced.sources == ("prefill B=1 C=64", "prefill B=1 C=256")


def test_beyond_them_it_extrapolates_within_the_nearest_and_its_scaled_cost():
    costs = MeasuredCosts(frames((decode(1), [3_000]), (decode(2), [4_000])))
    # Along the line: B=4 -> 6,000, within [4,000, 8,000].
    assert costs.duration_ns(decode(4)) == 6_000
    assert costs.priced[decode(4)].rule == "extrapolated"
    # A steep line is held to the size ratio: B=64 at most 32x decode B=2.
    steep = MeasuredCosts(frames((decode(1), [1_000]), (decode(2), [10_000])))
    assert steep.duration_ns(decode(64)) == 320_000
    # Downwards, never below the nearest's scaled cost nor above the nearest's.
    assert steep.duration_ns(GraphDescriptor(DECODE, 1, 1, 0, 1)) == 1_000  # measured
    down = MeasuredCosts(frames((prefill(128), [20_000]), (prefill(256), [30_000])))
    assert down.duration_ns(prefill(64)) == 15_000


def test_one_measured_graph_scales_a_prompt_kind_and_holds_another():
    costs = MeasuredCosts(frames((prefill(64), [8_000]), (decode(2), [4_000])))
    assert costs.duration_ns(prefill(512)) == 64_000
    assert costs.priced[prefill(512)].rule == "scaled"
    assert costs.duration_ns(decode(8)) == 4_000


def test_packed_prefill_is_priced_within_its_batch_first():
    costs = MeasuredCosts(
        frames((prefill(128), [10_000]), (prefill(128, 2), [14_000]), (prefill(512, 2), [50_000]))
    )
    assert costs.duration_ns(prefill(256, 2)) == 26_000
    assert costs.priced[prefill(256, 2)].sources == ("prefill B=2 C=128", "prefill B=2 C=512")
    # No B=4 prefill measured: the kind's graphs, one per size (the cheapest).
    assert costs.duration_ns(prefill(256, 4)) == 23_333  # 10,000 at 128 .. 50,000 at 512


def test_other_kinds_stand_in_and_the_cheapest_is_the_last_resort():
    costs = MeasuredCosts(
        frames((prefill(64), [10_000]), (prefill(256), [40_000]), (decode(1), [3_000]))
    )
    mixed = GraphDescriptor(MIXED, 2, prompt_capacity=64)  # 64 + 2 tokens
    assert costs.duration_ns(mixed) == 10_000 + 30_000 * (64 + 2 - 64) // 192
    assert costs.priced[mixed].rule == "as prefill, interpolated"
    snapshot = GraphDescriptor(GraphKind.SNAPSHOT, 4)
    assert costs.duration_ns(snapshot) == 3_000
    assert costs.priced[snapshot].rule == "cheapest"


def test_no_measured_frame_cannot_price_anything():
    with pytest.raises(CostError):
        MeasuredCosts(frames((decode(1), [0])))


@pytest.mark.parametrize(
    "desc",
    [
        prefill(64),
        prefill(512, 4),
        decode(8),
        GraphDescriptor(GraphKind.SNAPSHOT, 2),
        *mixed_shapes((2, 4), (64, 128))[:3],
        GraphDescriptor(MIXED, 4, 2, 1, 8, 64),
        GraphDescriptor(GraphKind.SPECULATIVE, 4, 4, 3, 12),
        GraphDescriptor(GraphKind.SPECULATIVE, 2, 4, 3, 8, device_allocated=True),
    ],
)
def test_program_names_parse_back(desc):
    assert parse_program(desc.describe()) == desc


@pytest.mark.parametrize("name", ["", "decode", "decode B=x", "decode Q=2", "warp B=1"])
def test_bad_program_names_are_refused(name):
    with pytest.raises(ValueError):
        parse_program(name)
