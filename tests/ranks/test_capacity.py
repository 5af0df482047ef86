"""The rank's prepared-program catalog from capacity settings."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphKind
from runtime.ranks.capacity import CapacityConfig, CapacityError, build_catalog, padded_concurrency


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
