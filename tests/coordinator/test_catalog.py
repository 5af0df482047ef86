"""GraphDescriptor validation, cost-entry identity, wire form and catalog checks."""

from __future__ import annotations

import json

import pytest

from runtime.catalog import (
    CatalogError,
    GraphDescriptor,
    GraphKind,
    validate_catalog,
)
from runtime.coordinator.cost import CostCatalog
from runtime.coordinator.scheduler import Scheduler

# ---------------------------------------------------------------- validation

# (constructor kwargs, field the error message must name)
BAD_DESCRIPTORS = [
    pytest.param({"kind": "bogus", "batch_capacity": 1}, "kind", id="unknown-kind"),
    pytest.param({"kind": GraphKind.DECODE, "batch_capacity": 0}, "batch_capacity", id="b-zero"),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": -4}, "batch_capacity", id="b-negative"
    ),
    pytest.param({"kind": GraphKind.DECODE, "batch_capacity": 128}, "batch_capacity", id="b-128"),
    pytest.param({"kind": GraphKind.VISION, "batch_capacity": 65}, "batch_capacity", id="b-65"),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": 3}, "batch_capacity", id="b-not-pow2"
    ),
    pytest.param(
        {"kind": GraphKind.SPECULATIVE, "batch_capacity": 6, "token_capacity": 2},
        "batch_capacity",
        id="spec-b-not-pow2",
    ),
    pytest.param({"kind": GraphKind.DECODE, "batch_capacity": 2.0}, "batch_capacity", id="b-float"),
    pytest.param({"kind": GraphKind.DECODE, "batch_capacity": True}, "batch_capacity", id="b-bool"),
    pytest.param({"kind": GraphKind.DECODE, "batch_capacity": "4"}, "batch_capacity", id="b-str"),
    pytest.param(
        {"kind": GraphKind.PREFILL, "batch_capacity": 3, "prompt_capacity": 64},
        "batch_capacity",
        id="prefill-b-not-pow2",
    ),
    pytest.param(
        {"kind": GraphKind.SCORED_PREFILL, "batch_capacity": 6, "prompt_capacity": 64},
        "batch_capacity",
        id="scored-prefill-b-not-pow2",
    ),
    pytest.param(
        {"kind": GraphKind.MIXED, "batch_capacity": 1, "prompt_capacity": 64},
        "batch_capacity",
        id="mixed-b-1",
    ),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": 1, "token_capacity": 0},
        "token_capacity",
        id="w-zero",
    ),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": 2, "token_capacity": 2},
        "token_capacity",
        id="decode-w-2",
    ),
    pytest.param(
        {
            "kind": GraphKind.PREFILL,
            "batch_capacity": 1,
            "token_capacity": 2,
            "prompt_capacity": 64,
        },
        "token_capacity",
        id="prefill-w-2",
    ),
    pytest.param(
        {"kind": GraphKind.MIXED, "batch_capacity": 2, "token_capacity": 9, "prompt_capacity": 64},
        "token_capacity",
        id="mixed-w-9",
    ),
    pytest.param(
        {"kind": GraphKind.SPECULATIVE, "batch_capacity": 2, "proposal_depth": -1},
        "proposal_depth",
        id="d-negative",
    ),
    pytest.param(
        {
            "kind": GraphKind.SPECULATIVE,
            "batch_capacity": 2,
            "token_capacity": 1,
            "proposal_depth": 2,
        },
        "proposal_depth",
        id="width-one-d-2",
    ),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": 2, "proposal_depth": 1},
        "proposal_depth",
        id="decode-d-1",
    ),
    pytest.param(
        {
            "kind": GraphKind.PREFILL,
            "batch_capacity": 1,
            "proposal_depth": 1,
            "prompt_capacity": 64,
        },
        "proposal_depth",
        id="prefill-d-1",
    ),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": 4, "target_capacity": -1},
        "target_capacity",
        id="p-negative",
    ),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": 4, "target_capacity": 3},
        "target_capacity",
        id="decode-p-not-b",
    ),
    pytest.param(
        {
            "kind": GraphKind.SPECULATIVE,
            "batch_capacity": 4,
            "token_capacity": 3,
            "proposal_depth": 2,
            "target_capacity": 13,
        },
        "target_capacity",
        id="spec-p-above-bw",
    ),
    pytest.param(
        {
            "kind": GraphKind.SPECULATIVE,
            "batch_capacity": 4,
            "token_capacity": 3,
            "proposal_depth": 2,
            "target_capacity": 3,
        },
        "target_capacity",
        id="spec-p-below-b",
    ),
    pytest.param(
        {"kind": GraphKind.PREFILL, "batch_capacity": 1},
        "prompt_capacity",
        id="prefill-c-missing",
    ),
    pytest.param(
        {"kind": GraphKind.PREFILL, "batch_capacity": 1, "prompt_capacity": 100},
        "prompt_capacity",
        id="prefill-c-unaligned",
    ),
    pytest.param(
        {"kind": GraphKind.SCORED_PREFILL, "batch_capacity": 1, "prompt_capacity": -64},
        "prompt_capacity",
        id="c-negative",
    ),
    pytest.param(
        {"kind": GraphKind.MIXED, "batch_capacity": 2, "prompt_capacity": 32},
        "prompt_capacity",
        id="mixed-c-unaligned",
    ),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": 2, "prompt_capacity": 64},
        "prompt_capacity",
        id="decode-c-nonzero",
    ),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": 2, "estimated_duration_ns": -1},
        "estimated_duration_ns",
        id="estimate-negative",
    ),
    pytest.param(
        {"kind": GraphKind.DECODE, "batch_capacity": 2, "estimated_duration_ns": 1.5e6},
        "estimated_duration_ns",
        id="estimate-float",
    ),
]


@pytest.mark.parametrize(("kwargs", "field"), BAD_DESCRIPTORS)
def test_bad_descriptor_field_is_named(kwargs, field):
    with pytest.raises(CatalogError, match=field):
        GraphDescriptor(**kwargs)


def test_catalog_error_is_a_value_error():
    assert issubclass(CatalogError, ValueError)


VALID = [
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.SCORED_PREFILL, 1, prompt_capacity=4096),
    GraphDescriptor(GraphKind.DECODE, 1),
    GraphDescriptor(GraphKind.DECODE, 64),
    GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=1),
    GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=6, proposal_depth=5),
    GraphDescriptor(
        GraphKind.SPECULATIVE, 4, token_capacity=6, proposal_depth=5, target_capacity=12
    ),
    GraphDescriptor(GraphKind.MIXED, 2, token_capacity=8, prompt_capacity=64),
    GraphDescriptor(GraphKind.MIXED, 64, token_capacity=1, prompt_capacity=4096),
    GraphDescriptor(GraphKind.VISION, 1),
    GraphDescriptor(GraphKind.INIT, 1),
    GraphDescriptor(GraphKind.SNAPSHOT, 8),
    GraphDescriptor(GraphKind.RESTORE, 2, estimated_duration_ns=123),
]


def test_kind_accepts_wire_string():
    desc = GraphDescriptor("decode", 4)
    assert desc.kind is GraphKind.DECODE


def test_rectangular_target_capacity_defaults_to_b_times_w():
    spec = GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=3, proposal_depth=2)
    assert spec.target_capacity == 12
    assert GraphDescriptor(GraphKind.DECODE, 8).target_capacity == 8
    mixed = GraphDescriptor(GraphKind.MIXED, 4, token_capacity=2, prompt_capacity=128)
    assert mixed.target_capacity == 8
    # Prefill programs have no verification rows.
    assert GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64).target_capacity == 0


def test_queueable_kinds_are_decode_and_speculative_only():
    queueable = {d.kind for d in VALID if d.queueable}
    assert queueable == {GraphKind.DECODE, GraphKind.SPECULATIVE}


# ------------------------------------------------------------------ identity


def test_key_identity_ignores_estimated_duration():
    a = GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=3, proposal_depth=2)
    b = GraphDescriptor(
        GraphKind.SPECULATIVE,
        4,
        token_capacity=3,
        proposal_depth=2,
        estimated_duration_ns=7_000_000,
    )
    assert a.key == b.key
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert b.estimated_duration_ns == 7_000_000  # carried, just not part of identity


def test_implicit_and_explicit_rectangular_p_are_one_identity():
    implicit = GraphDescriptor(GraphKind.SPECULATIVE, 2, token_capacity=4, proposal_depth=3)
    explicit = GraphDescriptor(
        GraphKind.SPECULATIVE, 2, token_capacity=4, proposal_depth=3, target_capacity=8
    )
    assert implicit.key == explicit.key


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(
            GraphDescriptor(GraphKind.SPECULATIVE, 8, token_capacity=4, proposal_depth=3), id="B"
        ),
        pytest.param(
            GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=5, proposal_depth=3), id="W"
        ),
        pytest.param(
            GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=4, proposal_depth=2), id="D"
        ),
        pytest.param(
            GraphDescriptor(
                GraphKind.SPECULATIVE, 4, token_capacity=4, proposal_depth=3, target_capacity=10
            ),
            id="P",
        ),
    ],
)
def test_every_physical_extent_is_part_of_the_key(other):
    base = GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=4, proposal_depth=3)
    assert base.key != other.key
    assert base != other


def test_kind_and_prompt_capacity_are_part_of_the_key():
    assert GraphDescriptor(GraphKind.SNAPSHOT, 2).key != GraphDescriptor(GraphKind.RESTORE, 2).key
    assert (
        GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64).key
        != GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=128).key
    )


def test_cost_catalog_finds_entry_whatever_the_estimate():
    catalog = CostCatalog([GraphDescriptor(GraphKind.DECODE, 4)], ttl_ns=30_000_000_000)
    probe = GraphDescriptor(GraphKind.DECODE, 4, estimated_duration_ns=999)
    assert catalog.entry(probe).descriptor.key == probe.key


# ---------------------------------------------------------------------- wire


@pytest.mark.parametrize("desc", VALID, ids=lambda d: d.describe())
def test_wire_round_trip(desc):
    wire = desc.to_wire()
    # The wire form is plain JSON data.
    back = GraphDescriptor.from_wire(json.loads(json.dumps(wire)))
    assert back == desc
    assert back.key == desc.key
    assert back.kind is desc.kind
    assert back.estimated_duration_ns == desc.estimated_duration_ns
    assert back.to_wire() == wire


def test_wire_form_names_every_field():
    desc = GraphDescriptor(
        GraphKind.SPECULATIVE, 4, token_capacity=6, proposal_depth=5, estimated_duration_ns=42
    )
    assert desc.to_wire() == {
        "kind": "speculative",
        "batch_capacity": 4,
        "token_capacity": 6,
        "proposal_depth": 5,
        "target_capacity": 24,
        "prompt_capacity": 0,
        "device_allocated": False,
        "estimated_duration_ns": 42,
    }


def test_device_allocation_is_a_speculative_programs_value_source():
    ragged = GraphDescriptor(
        GraphKind.SPECULATIVE, 4, token_capacity=8, proposal_depth=7, target_capacity=12,
        device_allocated=True,
    )  # fmt: skip
    host = GraphDescriptor(
        GraphKind.SPECULATIVE, 4, token_capacity=8, proposal_depth=7, target_capacity=12
    )
    assert ragged.key != host.key  # two prepared programs, two cost entries
    assert ragged.describe() == "speculative B=4 D=7 W=8 P=12 device-allocated"
    assert GraphDescriptor.from_wire(ragged.to_wire()) == ragged
    with pytest.raises(CatalogError, match="device_allocated"):
        GraphDescriptor(GraphKind.DECODE, 4, device_allocated=True)
    with pytest.raises(CatalogError, match="device_allocated"):
        GraphDescriptor(GraphKind.SPECULATIVE, 4, device_allocated=True)  # D = 0
    with pytest.raises(CatalogError, match="device_allocated"):
        GraphDescriptor.from_wire({"kind": "decode", "batch_capacity": 1, "device_allocated": 1})


def test_from_wire_fills_defaults():
    desc = GraphDescriptor.from_wire({"kind": "decode", "batch_capacity": 2})
    assert desc == GraphDescriptor(GraphKind.DECODE, 2)
    assert desc.estimated_duration_ns == 0


def test_unknown_wire_field_rejected():
    wire = GraphDescriptor(GraphKind.DECODE, 2).to_wire()
    wire["active_rows"] = 1
    with pytest.raises(CatalogError, match="active_rows"):
        GraphDescriptor.from_wire(wire)


@pytest.mark.parametrize("data", [None, [], "decode", 3, [("kind", "decode")]])
def test_non_map_wire_rejected(data):
    with pytest.raises(CatalogError, match="map"):
        GraphDescriptor.from_wire(data)


@pytest.mark.parametrize("missing", ["kind", "batch_capacity"])
def test_wire_missing_required_field_rejected(missing):
    wire = GraphDescriptor(GraphKind.DECODE, 2).to_wire()
    del wire[missing]
    with pytest.raises(CatalogError, match=missing):
        GraphDescriptor.from_wire(wire)


def test_wire_values_are_validated():
    wire = GraphDescriptor(GraphKind.DECODE, 2).to_wire()
    wire["batch_capacity"] = 3
    with pytest.raises(CatalogError, match="batch_capacity"):
        GraphDescriptor.from_wire(wire)


# ------------------------------------------------------------------- catalog


def test_validate_catalog_keeps_order():
    descs = [
        GraphDescriptor(GraphKind.DECODE, 4),
        GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
        GraphDescriptor(GraphKind.DECODE, 1),
    ]
    assert validate_catalog(descs) == tuple(descs)


def test_duplicate_catalog_entries_rejected():
    descs = [
        GraphDescriptor(GraphKind.DECODE, 1),
        GraphDescriptor(GraphKind.DECODE, 4),
        GraphDescriptor(GraphKind.DECODE, 4, estimated_duration_ns=5_000_000),
    ]
    with pytest.raises(CatalogError, match=r"catalog\[2\] duplicates catalog\[1\]"):
        validate_catalog(descs)


def test_duplicate_rectangular_identity_rejected():
    descs = [
        GraphDescriptor(GraphKind.SPECULATIVE, 2, token_capacity=4, proposal_depth=3),
        GraphDescriptor(
            GraphKind.SPECULATIVE, 2, token_capacity=4, proposal_depth=3, target_capacity=8
        ),
    ]
    with pytest.raises(CatalogError, match="duplicates"):
        validate_catalog(descs)


def test_scheduler_rejects_duplicate_catalog():
    with pytest.raises(CatalogError, match="duplicates"):
        Scheduler([GraphDescriptor(GraphKind.DECODE, 2), GraphDescriptor(GraphKind.DECODE, 2)])


def test_non_descriptor_catalog_entry_rejected():
    with pytest.raises(CatalogError, match=r"catalog\[1\]"):
        validate_catalog([GraphDescriptor(GraphKind.DECODE, 2), {"kind": "decode"}])


def test_the_speculative_token_capacity_envelope():
    from runtime.catalog import within_speculative_envelope as fits

    rect = GraphDescriptor(GraphKind.SPECULATIVE, 4, token_capacity=8, proposal_depth=7)  # 32 rows
    ragged = GraphDescriptor(
        GraphKind.SPECULATIVE, 8, token_capacity=8, proposal_depth=7, target_capacity=24
    )
    width_one = GraphDescriptor(GraphKind.SPECULATIVE, 64)
    assert fits(rect, 32) and not fits(rect, 31)  # B x W <= R
    assert fits(ragged, 24) and not fits(ragged, 23)  # P <= R
    assert fits(width_one, 1) and fits(GraphDescriptor(GraphKind.DECODE, 64), 1)
    wide_mixed = GraphDescriptor(
        GraphKind.MIXED, 4, token_capacity=4, proposal_depth=3, prompt_capacity=64
    )
    assert fits(wide_mixed, 16) and not fits(wide_mixed, 15)
    with pytest.raises(CatalogError, match="speculative token capacity"):
        fits(rect, 0)


def test_a_packed_prefill_program_has_power_of_two_rows_sharing_its_capacity():
    packed = GraphDescriptor(GraphKind.PREFILL, 4, prompt_capacity=256)
    assert (packed.batch_capacity, packed.prompt_capacity, packed.target_capacity) == (4, 256, 0)
    assert packed.key != GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=256).key
    assert packed.describe() == "prefill B=4 C=256"
    assert not packed.queueable  # a prefill drains the window, packed or not
    assert GraphDescriptor.from_wire(packed.to_wire()) == packed


def test_a_scored_prefill_program_is_packed_like_prefill_with_its_own_cost_entry():
    scored = GraphDescriptor(GraphKind.SCORED_PREFILL, 4, prompt_capacity=256)
    plain = GraphDescriptor(GraphKind.PREFILL, 4, prompt_capacity=256)
    assert scored.key != plain.key  # its own cost entry
    assert scored.describe() == "scored_prefill B=4 C=256"
    assert not scored.queueable  # it drains the window (spec)
    assert GraphDescriptor.from_wire(scored.to_wire()) == scored
    with pytest.raises(CatalogError, match="power of two for scored_prefill"):
        GraphDescriptor(GraphKind.SCORED_PREFILL, 3, prompt_capacity=256)
