"""The simulator's cost profiles: roofline and additive curves, catalogs."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import mixed_shapes
from scripts.scheduling_sim.catalogs import PROFILES, RooflineProfile, build_catalog

ROOFLINE = ("llama1b-h100", "llama8b-h100")
ADDITIVE = ("llama1b-h100-additive", "llama8b-h100-additive")


def decode(b: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.DECODE, b)


def prefill(c: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=c)


def mixed(b: int, c: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.MIXED, b, prompt_capacity=c)


@pytest.mark.parametrize("name", ROOFLINE)
def test_roofline_prompt_chunk_rides_decode_nearly_free(name):
    profile = PROFILES[name]
    assert isinstance(profile, RooflineProfile)
    riding = profile.duration_ns(mixed(16, 64))
    alone = profile.duration_ns(decode(16))
    assert alone <= riding <= 1.03 * alone


@pytest.mark.parametrize("name", ADDITIVE)
def test_additive_prompt_chunk_costs_visibly_more(name):
    profile = PROFILES[name]
    assert profile.duration_ns(mixed(16, 64)) > 1.15 * profile.duration_ns(decode(16))


@pytest.mark.parametrize("name", ROOFLINE + ADDITIVE)
def test_prefill_costs_grow_with_capacity(name):
    profile = PROFILES[name]
    costs = [profile.duration_ns(prefill(c)) for c in (64, 256, 1024, 4096, 8192)]
    assert costs == sorted(costs) and costs[0] < costs[-1]
    # Large chunks are compute-bound, and attention is quadratic: doubling a large
    # chunk more than doubles its cost.
    assert costs[-1] > 2 * costs[-2] > 4 * costs[-3]


def test_additive_numbers_unchanged():
    # The earlier curves, to the nanosecond.
    p1, p8 = PROFILES["llama1b-h100-additive"], PROFILES["llama8b-h100-additive"]
    assert p1.duration_ns(decode(1)) == round((2 * 1.24e9 / 3.35e9 + 0.8 + 0.015) * 1e6)
    assert p8.duration_ns(prefill(64)) == round(
        (2 * 8.0e9 / 3.35e9 + 0.8 + 64 * 2 * 8.0e9 / 550e9 + 64 * 64 * 3e-7) * 1e6
    )


def test_roofline_constants_follow_the_model_class():
    p1, p8 = PROFILES["llama1b-h100"], PROFILES["llama8b-h100"]
    assert p1.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2 == 32 * 1024
    assert p8.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    # Memory-bound decode: weights plus a nominal context's KV per row, plus overhead.
    expected = 0.8 + (1.24e9 * 2 + 16 * 1024 * 32768) / 3.35e9
    assert p1.duration_ms(decode(16)) == pytest.approx(expected)
    # Compute-bound prefill: 2 * params per token plus causal attention.
    c = 4096
    expected = 0.8 + (c * 2 * 8.03e9 + 2 * 32 * 32 * 128 * c * c) / 550e9
    assert p8.duration_ms(prefill(c)) == pytest.approx(expected)


def test_roofline_depends_on_shape_and_draft_adds():
    p = PROFILES["llama8b-h100"]
    # Padding rows cost the same as useful ones: decode cost grows with B.
    assert p.duration_ns(decode(1)) < p.duration_ns(decode(16)) < p.duration_ns(decode(64))
    spec1 = GraphDescriptor(GraphKind.SPECULATIVE, 8, token_capacity=1)
    spec4 = GraphDescriptor(GraphKind.SPECULATIVE, 8, token_capacity=4, proposal_depth=3)
    assert p.duration_ns(spec1) == p.duration_ns(decode(8))
    draft = 3 * 0.15 * p.duration_ms(decode(8))
    assert p.duration_ms(spec4) == pytest.approx(p.duration_ms(decode(8)) + draft)


@pytest.mark.parametrize("name", ROOFLINE + ADDITIVE)
def test_profiles_price_any_valid_descriptor(name):
    profile = PROFILES[name]
    descriptors = [
        mixed(64, 8192),
        prefill(8192),
        decode(64),
        GraphDescriptor(GraphKind.SCORED_PREFILL, 1, prompt_capacity=128),
        GraphDescriptor(
            GraphKind.MIXED, 8, token_capacity=4, proposal_depth=3, prompt_capacity=512
        ),
        GraphDescriptor(GraphKind.SPECULATIVE, 64, token_capacity=8, proposal_depth=7),
        GraphDescriptor(GraphKind.VISION, 1),
        GraphDescriptor(GraphKind.INIT, 1),
        GraphDescriptor(GraphKind.SNAPSHOT, 1),
        GraphDescriptor(GraphKind.RESTORE, 1),
    ]
    for desc in descriptors:
        cost = profile.duration_ns(desc)
        assert isinstance(cost, int) and cost > 0, desc.describe()


def test_build_catalog_mixed_shapes():
    buckets, batches = (64, 128, 256), (1, 2, 4, 8)
    plain = build_catalog(buckets, batches)
    with_mixed = build_catalog(buckets, batches, mixed=True)
    assert with_mixed[: len(plain)] == plain
    assert with_mixed[len(plain) :] == mixed_shapes(batches, buckets)
    assert all(d.kind is GraphKind.MIXED for d in with_mixed[len(plain) :])
    assert len(with_mixed) == len(plain) + 3 * 3  # batches 2, 4, 8 x three buckets
    speculative = build_catalog(buckets, batches, speculative_widths=(2, 4))
    assert sum(d.kind is GraphKind.SPECULATIVE for d in speculative) == 8
