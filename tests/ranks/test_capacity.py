"""The rank's prepared-program catalog from capacity settings."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphKind
from runtime.ranks.capacity import (
    CapacityConfig,
    CapacityError,
    balanced_prompt_bucket,
    build_catalog,
    mixed_shapes,
    padded_concurrency,
)
from runtime.ranks.shapes import ProgramShape


@pytest.mark.parametrize(("n", "padded"), [(1, 1), (2, 2), (3, 4), (6, 8), (8, 8), (33, 64)])
def test_padded_concurrency(n, padded):
    assert padded_concurrency(n) == padded


def test_concurrency_six_gets_an_eight_row_bucket():
    assert CapacityConfig(max_concurrency=6).decode_batches() == (1, 2, 4, 8)


def test_prefill_buckets_double_and_include_the_maximum():
    cfg = CapacityConfig(min_prefill_tokens=64, max_prefill_tokens=1536)
    assert cfg.prefill_buckets() == (64, 128, 256, 512, 1024, 1536)
    assert cfg.prefill_buckets(max_context=600) == (64, 128, 256, 512, 576)
    assert all(b % 64 == 0 for b in cfg.prefill_buckets(max_context=600))


def test_catalog_is_valid_and_complete():
    catalog = build_catalog(CapacityConfig(max_concurrency=5, max_prefill_tokens=512))
    kinds = [d.kind for d in catalog]
    assert kinds.count(GraphKind.PREFILL) == 4 and kinds.count(GraphKind.DECODE) == 4
    assert len({d.key for d in catalog}) == len(catalog)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_concurrency": 65}, "max_concurrency"),
        ({"max_prefill_tokens": 100}, "max_prefill_tokens"),
        ({"min_prefill_tokens": 0}, "min_prefill_tokens"),
        ({"min_prefill_tokens": 256, "max_prefill_tokens": 128}, "min_prefill_tokens"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(CapacityError, match=field):
        CapacityConfig(**kwargs)


def test_context_below_one_bucket_is_refused():
    with pytest.raises(CapacityError, match="max_context"):
        CapacityConfig().prefill_buckets(max_context=32)


# ---------------------------------------------------------------- mixed_shapes


def test_mixed_shapes_on_the_project_ladder():
    """Concurrency 8 and the 64..2048 ladder: batches 2, 4, 8 times six prompt buckets."""
    cfg = CapacityConfig(max_concurrency=8, max_prefill_tokens=2048, mixed_prefill=True)
    prompts = cfg.prefill_buckets()
    assert prompts == (64, 128, 256, 512, 1024, 2048)
    mixed = [d for d in build_catalog(cfg) if d.kind is GraphKind.MIXED]
    assert {(d.batch_capacity, d.prompt_capacity) for d in mixed} == {
        (b, c) for b in (2, 4, 8) for c in prompts
    }
    assert len(mixed) == 18
    assert all(d.token_capacity == 1 and d.proposal_depth == 0 for d in mixed)
    # A one-row bucket cannot hold a prompt row and a decoder: never mixed.
    assert all(d.batch_capacity >= 2 for d in mixed)
    # Off by default (the spec: mixed capture only with --mixed-prefill).
    assert not [d for d in build_catalog(CapacityConfig()) if d.kind is GraphKind.MIXED]


# The spec's example: Qwen concurrency four (batch buckets 1, 2, 4), 4096-token
# chunks, five draft tokens and token capacity six add 22 speculative and 20
# ordinary mixed graphs.  The spec does not list its prompt ladder; 20 ordinary
# graphs over two mixed batch buckets means ten prompt buckets, so this test
# states a 10-bucket ladder ending at 4096.
SPEC_LADDER = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)


def test_mixed_shapes_reproduce_the_spec_counts():
    ordinary = mixed_shapes((1, 2, 4), SPEC_LADDER)
    speculative = mixed_shapes((1, 2, 4), SPEC_LADDER, wider_widths=(6,), token_envelope=32)
    assert len(ordinary) == 20
    assert len(speculative) == 22
    wide = [d for d in speculative if d.token_capacity > 1]
    assert [(d.batch_capacity, d.token_capacity, d.proposal_depth) for d in wide] == [
        (2, 6, 5),
        (4, 6, 5),
    ]
    # The balanced bucket minimizes max(P/64, 4096/P): 512 gives 8 on both sides.
    assert {d.prompt_capacity for d in wide} == {512}
    # The maximum packed extent C + (B - 1) * W (spec, "Mixed execution
    # contract"), by hand: the wide graphs pack a 512-token prompt row beside one
    # and three rows of six; the width-one ones a prompt bucket beside B - 1
    # pending tokens, the largest 4096 + 3 = 4099 (the capture headroom).
    assert [ProgramShape.of(d).tokens for d in wide] == [512 + 6, 512 + 3 * 6]
    width_one = [ProgramShape.of(d).tokens for d in speculative if d.token_capacity == 1]
    assert sorted(width_one) == sorted(c + b - 1 for b in (2, 4) for c in SPEC_LADDER)
    assert max(ProgramShape.of(d).tokens for d in speculative) == 4099
    assert max(ProgramShape.of(d).tokens for d in ordinary) == 4099


def test_mixed_shapes_envelope_limits_batch_and_depth():
    shapes = mixed_shapes((2, 4, 8), (64, 256), wider_widths=(2, 4), token_envelope=16)
    wide = {(d.batch_capacity, d.token_capacity) for d in shapes if d.token_capacity > 1}
    assert wide == {(2, 2), (2, 4), (4, 2), (4, 4), (8, 2)}  # B*W <= 16


@pytest.mark.parametrize(
    ("ladder", "balanced"),
    [((64,), 64), ((64, 128), 64), ((64, 128, 256), 128), ((64, 256, 1024, 4096), 256)],
)
def test_balanced_prompt_bucket_ties_choose_the_smaller(ladder, balanced):
    # (64, 128): 64 gives max(1, 2) = 2 and 128 gives max(2, 1) = 2: the tie goes to 64.
    assert balanced_prompt_bucket(ladder) == balanced


def test_mixed_shapes_refuse_bad_settings():
    with pytest.raises(CapacityError, match="wider_widths"):
        mixed_shapes((2,), (64,), wider_widths=(1,))
    with pytest.raises(CapacityError, match="token_envelope"):
        mixed_shapes((2,), (64,), wider_widths=(2,), token_envelope=0)
    with pytest.raises(CapacityError, match="prompt_buckets"):
        mixed_shapes((2,), ())
    with pytest.raises(CapacityError, match="mixed_prefill"):
        CapacityConfig(mixed_prefill=1)
