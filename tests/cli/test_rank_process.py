"""`python -m runtime.ranks` flag handling (runtime/cli/rank_process.py): what the
rank entry point accepts and prepares from the flags `flare run` passes."""

from __future__ import annotations


def test_rank_entry_point_prepares_mixed_programs_when_asked():
    from runtime.catalog import GraphKind
    from runtime.cli.rank_process import parse_args
    from runtime.ranks.capacity import build_catalog

    base = ["--frames-endpoint", "ipc:///x/f", "--completions-endpoint", "ipc:///x/c"]
    assert not parse_args(base).capacity.mixed_prefill
    capacity = parse_args([*base, "--mixed-prefill", "--max-concurrency", "4"]).capacity
    assert capacity.mixed_prefill
    mixed = [d for d in build_catalog(capacity) if d.kind is GraphKind.MIXED]
    assert {d.batch_capacity for d in mixed} == {2, 4} and mixed


def test_rank_entry_point_takes_every_dtype_flare_run_passes():
    from runtime.cli.rank_process import parse_args
    from runtime.deploy.config import DTYPES

    base = ["--frames-endpoint", "ipc:///x/f", "--completions-endpoint", "ipc:///x/c"]
    assert parse_args(base).dtype == "auto"
    for dtype in DTYPES:
        assert parse_args([*base, "--dtype", dtype]).dtype == dtype


def test_the_rank_prepares_packed_prefill_programs_only_when_asked():
    from runtime.catalog import GraphKind
    from runtime.cli.rank_process import parse_args
    from runtime.ranks.capacity import build_catalog

    base = ["--frames-endpoint", "ipc:///x/f", "--completions-endpoint", "ipc:///x/c"]
    assert not parse_args(base).capacity.packed_prefill
    capacity = parse_args([*base, "--packed-prefill", "--max-concurrency", "8"]).capacity
    packed = [
        (d.batch_capacity, d.prompt_capacity)
        for d in build_catalog(capacity)
        if d.kind is GraphKind.PREFILL and d.batch_capacity > 1
    ]
    assert packed and all(c >= 64 * b for b, c in packed)


def test_the_rank_prepares_scored_prefill_programs_only_when_asked():
    from runtime.catalog import GraphKind
    from runtime.cli.rank_process import parse_args
    from runtime.ranks.capacity import build_catalog

    base = ["--frames-endpoint", "ipc:///x/f", "--completions-endpoint", "ipc:///x/c"]
    assert not parse_args(base).capacity.scored_prefill
    capacity = parse_args([*base, "--scored-prefill", "--packed-prefill"]).capacity
    catalog = build_catalog(capacity)
    shapes = {
        kind: [(d.batch_capacity, d.prompt_capacity) for d in catalog if d.kind is kind]
        for kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL)
    }
    assert shapes[GraphKind.SCORED_PREFILL] == shapes[GraphKind.PREFILL] != []
