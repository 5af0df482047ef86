"""Prefix allocation kernel against its torch reference and the host's rule,
runtime.coordinator.rounds.device_allocation, which the coordinator uses to
recompute the allocation from the confidence sidecar: all three must agree exactly.

The kernel runs under the Triton interpreter on CPU: conftest.py imports it with
TRITON_INTERPRET=1 before this module does.
"""

import pytest
import torch

from kernels.reference.prefix_allocation import prefix_allocation_reference
from kernels.triton.prefix_allocation import prefix_allocation
from runtime.coordinator.rounds import device_allocation


def _all_three(joint, ceilings, slots, rows):
    """The kernel's query lengths, asserted equal to the reference's and the host's."""
    joint = torch.tensor(joint, dtype=torch.float32) if not torch.is_tensor(joint) else joint
    ceilings = torch.as_tensor(ceilings, dtype=torch.int64)
    slots = torch.as_tensor(slots, dtype=torch.int64)
    got = prefix_allocation(joint, ceilings, slots, rows)
    ref = prefix_allocation_reference(joint, ceilings, slots, rows)
    host = device_allocation(joint.tolist(), ceilings.tolist(), slots.tolist(), rows)
    assert got.dtype == torch.int64 and got.shape == (joint.shape[0],)
    assert got.tolist() == ref.tolist() == host, (got.tolist(), ref.tolist(), host)
    return host


def _joint(gen, lanes, depth, levels=None):
    """Random (R, D) joint prefix probabilities: running products of confidences,
    optionally quantized to a few levels so that ties are common."""
    conf = torch.rand(lanes, depth, generator=gen)
    if levels is not None:
        conf = (conf * levels).ceil() / levels
    return conf.cumprod(dim=1)


@pytest.mark.parametrize("seed", range(6))
def test_random_cases_agree(seed):
    gen = torch.Generator().manual_seed(seed)
    for case in range(12):
        lanes = int(torch.randint(1, 9, (1,), generator=gen))
        depth = int(torch.randint(1, 8, (1,), generator=gen))
        joint = _joint(gen, lanes, depth, levels=4 if case % 2 else None)
        ceilings = torch.randint(1, depth + 2, (lanes,), generator=gen)
        slots = torch.randperm(3 * lanes, generator=gen)[:lanes]
        total = int(ceilings.sum())
        rows = int(torch.randint(lanes, total + 3, (1,), generator=gen))
        queries = _all_three(joint, ceilings, slots, rows)
        assert sum(queries) == min(rows, total)
        assert all(1 <= q <= c for q, c in zip(queries, ceilings.tolist()))


def test_ties_go_to_the_shorter_prefix_then_the_lower_slot():
    # Every prefix of every lane is 0.5: the shorter prefix first, so all lanes
    # grow to 2 rows before any grows to 3; among equal depths the lower slot,
    # and slots are not in lane order.
    joint = [[0.5, 0.5, 0.5]] * 3
    slots = [7, 2, 4]
    assert _all_three(joint, [4, 4, 4], slots, 4) == [1, 2, 1]
    assert _all_three(joint, [4, 4, 4], slots, 5) == [1, 2, 2]
    assert _all_three(joint, [4, 4, 4], slots, 6) == [2, 2, 2]
    assert _all_three(joint, [4, 4, 4], slots, 7) == [2, 3, 2]
    assert _all_three(joint, [4, 4, 4], slots, 8) == [2, 3, 3]
    # Equal probability at different depths: the shorter prefix wins over the slot.
    joint = [[0.9, 0.6], [0.6, 0.1]]
    assert _all_three(joint, [3, 3], [0, 9], 4) == [2, 2]


def test_the_hosts_own_examples():
    joint = [[0.9, 0.8, 0.7], [0.6, 0.3, 0.1], [0.95, 0.9, 0.85]]
    assert _all_three(joint, [4, 4, 4], [0, 1, 2], 7) == [2, 1, 4]
    assert _all_three(joint, [4, 4, 2], [0, 1, 2], 7) == [4, 1, 2]
    assert _all_three([[0.5], [0.5]], [2, 2], [5, 3], 3) == [1, 2]


def test_ceilings_may_sum_above_the_rows():
    joint = [[0.9, 0.8, 0.7, 0.6], [0.85, 0.5, 0.4, 0.3], [0.2, 0.1, 0.05, 0.01]]
    ceilings = [5, 5, 5]  # 15 rows wanted, 7 given: the best 4 frontiers win
    assert _all_three(joint, ceilings, [0, 1, 2], 7) == [4, 2, 1]
    # And a ceiling bounds its lane even when it holds the best prefixes.
    assert _all_three(joint, [2, 5, 5], [0, 1, 2], 7) == [2, 4, 1]
    # Ceilings past D + 1 are bounded by the prefixes the lane has.
    assert _all_three([[0.9], [0.8]], [9, 9], [0, 1], 9) == [2, 2]


def test_zero_probability_prefixes_are_never_admitted():
    """A zero joint probability is a certain rejection: rows stay unused instead."""
    joint = [[0.9, 0.0, 0.0], [0.4, 0.3, 0.0]]
    assert _all_three(joint, [4, 4], [0, 1], 5) == [2, 3]  # the positive ones
    assert _all_three(joint, [4, 4], [0, 1], 6) == [2, 3]  # rows left, nothing possible
    assert _all_three(joint, [4, 4], [0, 1], 9) == [2, 3]


def test_pending_rows_only():
    joint = [[0.9, 0.8], [0.7, 0.6], [0.5, 0.4]]
    assert _all_three(joint, [3, 3, 3], [0, 1, 2], 3) == [1, 1, 1]
    assert _all_three(joint, [3, 3, 3], [0, 1, 2], 1) == [1, 1, 1]  # fewer rows than lanes
    assert _all_three(joint, [1, 1, 1], [0, 1, 2], 9) == [1, 1, 1]  # ceilings of 1


def test_limits_strides_and_int32():
    gen = torch.Generator().manual_seed(11)
    lanes, depth = 64, 16
    wide = _joint(gen, lanes, 2 * depth, levels=8)
    joint = wide[:, ::2]  # a strided view
    ceilings = torch.randint(1, depth + 2, (lanes,), generator=gen)
    slots = torch.randperm(lanes, generator=gen)
    for rows in (lanes, 200):
        _all_three(joint, ceilings, slots, rows)
    got = prefix_allocation(joint, ceilings.int(), slots.int(), 200)
    assert got.tolist() == prefix_allocation_reference(joint, ceilings, slots, 200).tolist()


def test_empty_shapes():
    assert _all_three(torch.zeros(0, 3), [], [], 4) == []
    assert _all_three(torch.zeros(2, 0), [1, 1], [0, 1], 4) == [1, 1]


def _good():
    return {
        "joint": torch.rand(3, 4),
        "ceilings": torch.tensor([2, 3, 5]),
        "slots": torch.tensor([4, 0, 2]),
        "rows": 8,
    }


def _with(**changes):
    return lambda args: {**args, **changes}


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("joint", _with(joint=torch.rand(3))),
        ("joint", _with(joint=torch.rand(3, 4, dtype=torch.float64))),
        ("joint", _with(joint=torch.rand(65, 4))),
        ("joint", _with(joint=torch.rand(3, 17))),
        ("ceilings", _with(ceilings=torch.tensor([2, 3]))),
        ("ceilings", _with(ceilings=torch.tensor([2.0, 3.0, 5.0]))),
        ("ceilings", _with(ceilings=torch.tensor([2, 3, 5], device="meta"))),
        ("slots", _with(slots=torch.tensor([[4, 0, 2]]))),
        ("slots", _with(slots=torch.tensor([4, 0, 2], dtype=torch.int16))),
        ("rows", _with(rows=-1)),
        ("rows", _with(rows=8.0)),
    ],
)
def test_launcher_names_bad_argument(name, bad):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        prefix_allocation(**bad(_good()))


@pytest.mark.parametrize("seed", range(4))
def test_lanes_with_ceiling_zero_are_absent(seed):
    """A program with fewer lanes than its capacity passes ceiling 0 for the padding:
    those lanes take no row and do not count against the rows, so the others
    get exactly what the coordinator computes for the real lanes alone."""
    gen = torch.Generator().manual_seed(100 + seed)
    lanes, depth = 8, 3
    joint = _joint(gen, lanes, depth, levels=4)
    ceilings = torch.randint(1, depth + 2, (lanes,), generator=gen)
    slots = torch.randperm(3 * lanes, generator=gen)[:lanes]
    real = torch.rand(lanes, generator=gen) < 0.6
    real[0] = True
    rows = int(torch.randint(int(real.sum()), 2 * lanes, (1,), generator=gen))
    padded = torch.where(real, ceilings, 0)
    got = prefix_allocation(joint, padded, slots, rows).tolist()
    ref = prefix_allocation_reference(joint, padded, slots, rows).tolist()
    keep = real.nonzero().flatten()
    host = device_allocation(
        joint[keep].tolist(), ceilings[keep].tolist(), slots[keep].tolist(), rows
    )
    assert got == ref
    assert [got[i] for i in keep.tolist()] == host
    assert all(got[i] == 0 for i in range(lanes) if not real[i])
