"""Mixed prefill/decode programs: one packed forward with a prompt row and decode rows.

The same work run as one mixed frame and as separate prefill and decode frames
gives the same greedy tokens, log probabilities and KV at TP=1 and TP=2 (gloo),
equal to transformers; inactive rows and unused token capacity write nothing;
packed offsets are prefix sums of the one uploaded query-length field.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.arena import LANE_FIELDS, SCALARS, FrameInputs, int_size
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.checked_frame import FrameError
from runtime.ranks.model import load_model
from runtime.ranks.model.attention import (
    AttentionMetadata,
    mixed_paged_attention,
    packed_query_start,
    paged_attention_reference,
    split_prompt_row,
)
from runtime.ranks.model.kv_cache import PagedKVCache
from runtime.ranks.model.parallel import TPGroup
from runtime.ranks.programs import PreparedProgram
from runtime.ranks.shapes import ProgramError, ProgramShape
from runtime.ranks.worker import RankWorker
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import tensor_to_torch
from tests.support.checkpoints import greedy, write_tiny
from tests.support.rank_state import changed, record_forwards, slot_row, snapshot
from tests.support.tp_runs import tp1_and_tp2

PAGE = 16
PAGES_PER_SLOT = 8  # 128 tokens per request
PROMPTS = [[5, 17, 33, 3, 60], [9, 9, 9, 41, 77, 12, 3, 50, 21], [88], list(range(3, 103))]
NEW = 6
LOGPROBS = 3
SAMPLING = SamplingParams(logprobs=LOGPROBS)  # greedy, with log probabilities to compare


def mixed(b: int, c: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.MIXED, b, prompt_capacity=c)


def prefill_program(c: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=c)


def decode_program(b: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.DECODE, b)


def pages(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))


def make_worker(path, group: TPGroup | None = None, rank: int = 0, world: int = 1) -> RankWorker:
    model = load_model(path, group)
    capacity = CapacityConfig(
        max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=128, mixed_prefill=True
    )
    return RankWorker(
        model, capacity, num_pages=5 * PAGES_PER_SLOT, page_size=PAGE, rank=rank, world_size=world
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-mixed")
    model = write_tiny("llama", path, seed=11)
    return path, greedy(model, PROMPTS, NEW)


# ---------------------------------------------------------------- a frame driver


class Driver:
    """Frames as the coordinator builds them; rows are ("decode", slot) or
    ("prefill", slot, start, end) over PROMPTS[slot]."""

    def __init__(self, worker: RankWorker) -> None:
        self.w = worker
        self.fence = 0
        self.position: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[list[float]]] = {}  # rank 0: per token, 1 + LOGPROBS

    def lane(self, row: tuple) -> FrameLane:
        if row[0] == "decode":
            slot = row[1]
            return FrameLane(slot, 1, "decode", 0, (), self.position[slot], (), 1, None)
        _, slot, start, end = row
        prompt = PROMPTS[slot]
        last = 1 if end == len(prompt) else 0
        chunk = tuple(prompt[start:end])
        table = pages(slot) if start == 0 else ()  # the first chunk brings the table
        return FrameLane(slot, 1, "prefill", start, chunk, start, table, last, SAMPLING)

    def run(self, program: GraphDescriptor, rows: list[tuple], prompt_row: int = -1):
        self.fence += 1
        lanes = tuple(self.lane(row) for row in rows)
        completion = self.w.execute(Frame.from_lanes(self.fence, program, lanes, prompt_row))
        assert completion.error is None and completion.device_ns > 0
        for lane in lanes:
            self.position[lane.slot] = (
                lane.position + len(lane.prompt_tokens) if lane.phase == "prefill" else
                self.position[lane.slot] + 1
            )  # fmt: skip
        if self.w.rank == 0:
            values = tensor_to_torch(completion.sidecars["logprobs"])  # (R, 1 + K)
            results = completion.lane_results()
            for i, (lane, result) in enumerate(zip(lanes, results, strict=True)):
                assert (result.slot, result.generation) == (lane.slot, lane.generation)
                assert len(result.tokens) == lane.commits  # a prompt chunk may commit none
                self.tokens.setdefault(lane.slot, []).extend(result.tokens)
                if result.tokens:
                    self.logprobs.setdefault(lane.slot, []).append(values[i].tolist())
        return completion


def prologue(d: Driver) -> None:
    """Three requests prefilled and decoding (common to both schedules)."""
    for slot in range(3):
        d.run(prefill_program(64), [("prefill", slot, 0, len(PROMPTS[slot]))])
    d.run(decode_program(4), [("decode", 0), ("decode", 1), ("decode", 2)])


# The schedule: (mixed frame, prompt row) and the same work as separate frames.
STEPS = [
    # A 100-token prompt arrives in two chunks beside three decoders; the prompt
    # row is not lane 0, and the slots are out of order.
    (
        (mixed(4, 64), [("decode", 1), ("prefill", 3, 0, 64), ("decode", 0), ("decode", 2)], 1),
        [
            (prefill_program(64), [("prefill", 3, 0, 64)]),
            (decode_program(4), [("decode", 1), ("decode", 0), ("decode", 2)]),
        ],
    ),
    (  # the prompt's last chunk commits its first token; one row padded
        (mixed(4, 64), [("decode", 2), ("decode", 0), ("prefill", 3, 64, 100)], 2),
        [
            (prefill_program(64), [("prefill", 3, 64, 100)]),
            (decode_program(2), [("decode", 2), ("decode", 0)]),
        ],
    ),
    (  # a decode-only population in a mixed program (prompt row -1)
        (mixed(2, 128), [("decode", 3), ("decode", 1)], -1),
        [(decode_program(2), [("decode", 3), ("decode", 1)])],
    ),
]


def run_schedule(d: Driver, use_mixed: bool) -> None:
    prologue(d)
    for (program, rows, prompt_row), separate in STEPS:
        if use_mixed:
            d.run(program, rows, prompt_row)
        else:
            for prog, prog_rows in separate:
                d.run(prog, prog_rows)
    while True:  # decode every request to NEW tokens
        behind = [s for s in range(4) if d.w.slots.step[s] < NEW]
        if not behind:
            break
        batch = next(b for b in (1, 2, 4) if b >= len(behind))
        d.run(decode_program(batch), [("decode", s) for s in behind])


def scenario(path: str, group: TPGroup, rank: int, world: int) -> dict:
    """Both schedules on fresh workers; what the test compares (rank 0: tokens)."""
    out: dict = {}
    caches = []
    for use_mixed in (True, False):
        d = Driver(make_worker(path, group, rank, world))
        run_schedule(d, use_mixed)
        name = "mixed" if use_mixed else "separate"
        out[name] = {"tokens": d.tokens, "logprobs": d.logprobs}
        # Each slot's pending token, on the device (the next decode's input).
        pending = {s: int(d.w.arena.pending[s]) for s in range(4)}
        assert all(d.w.slots.pending[s] for s in range(4))
        if rank == 0:
            assert pending == {s: d.tokens[s][-1] for s in range(4)}
        out[f"{name}_pending"] = pending
        cache = d.w.model.kv_cache
        # The visible slots: padding writes the hidden scratch slot, whatever it holds.
        caches.append(cache._storage[:, :, : cache.num_slots])
    out["kv_max_diff"] = float((caches[0] - caches[1]).abs().max())
    out["kv_written"] = float(caches[0].abs().sum())
    return out


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    return tp1_and_tp2(scenario, str(path), tmp_path_factory.mktemp("mixed-tp2"))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.process
def test_mixed_frames_equal_separate_frames_and_transformers(checkpoint, runs, tp):
    _, reference = checkpoint
    got = runs[tp]
    mixed_tokens, separate_tokens = got["mixed"]["tokens"], got["separate"]["tokens"]
    assert [mixed_tokens[s] for s in range(4)] == reference
    assert [separate_tokens[s] for s in range(4)] == reference
    for s in range(4):  # every token's log probabilities agree too
        a = torch.tensor(got["mixed"]["logprobs"][s])
        b = torch.tensor(got["separate"]["logprobs"][s])
        assert a.shape == (NEW, 1 + LOGPROBS)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # The KV the two schedules wrote is the same (and not trivially zero).
    assert got["kv_max_diff"] < 1e-5 and got["kv_written"] > 0
    assert got["mixed_pending"] == got["separate_pending"]


@pytest.mark.process
def test_tp2_ranks_agree(runs):
    assert runs["rank1"]["mixed_pending"] == runs[2]["mixed_pending"]
    assert runs["rank1"]["mixed"]["tokens"] == {}  # only rank 0 reports lanes
    assert runs[2]["mixed"]["tokens"] == runs[1]["mixed"]["tokens"]


# ---------------------------------------------------------------- no stray state


def test_inactive_rows_and_unused_capacity_mutate_nothing(checkpoint):
    path, reference = checkpoint
    d = Driver(make_worker(path))
    d.run(prefill_program(64), [("prefill", 0, 0, len(PROMPTS[0]))])
    d.run(prefill_program(64), [("prefill", 1, 0, len(PROMPTS[1]))])
    cache = d.w.model.kv_cache
    num_slots = cache.num_slots  # the visible slots (the scratch row is hidden)
    # Every visible slot holds noise, so any stray write shows (finite, so
    # masked keys stay harmless).
    gen = torch.Generator().manual_seed(5)
    cache._storage[:, :, :num_slots] = torch.randn(
        cache._storage[:, :, :num_slots].shape, generator=gen
    )

    def changed_slots(before: torch.Tensor) -> list[int]:
        after = cache._storage[:, :, :num_slots]  # (layers, 2, slots, KV, d)
        return (after != before).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()

    def slot_of(slot: int, position: int) -> int:
        return pages(slot)[position // PAGE] * PAGE + position % PAGE

    def device_rows(slots: list[int]) -> dict[str, torch.Tensor]:
        """Those slots' arena rows and penalty state, as they are now."""
        state = snapshot(d.w)
        return {k: v[slots] for k, v in state.items() if k.startswith(("arena.", "penalties."))}

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(a[k], b[k]) for k in a)

    others = [s for s in range(64) if s not in (0, 3)]  # slot 1 sits out, the rest are empty
    state1, rows = slot_row(d.w, 1), device_rows(others)
    position0 = d.position[0]
    # B=4, C=128: a 40-token prompt chunk (slot 3, lane 1) and one decoder (slot
    # 0): two padded rows, 131 - 41 unused token rows; slot 1 sits out.
    before = cache._storage[:, :, :num_slots].clone()
    d.run(mixed(4, 128), [("decode", 0), ("prefill", 3, 0, 40)], 1)
    assert changed_slots(before) == sorted(
        [slot_of(0, position0)] + [slot_of(3, p) for p in range(40)]
    )
    assert slot_row(d.w, 1) == state1 and not d.w.slots.holds(2)
    assert same(device_rows(others), rows)
    state3 = slot_row(d.w, 3)
    assert (state3["next_position"], state3["step"], state3["pending"]) == (40, 0, 0)
    assert d.tokens[3] == []  # a chunk short of the prompt end commits no token
    # A prompt-only population: the prompt's last 60 tokens, no decoders.
    before = cache._storage[:, :, :num_slots].clone()
    d.run(mixed(4, 128), [("prefill", 3, 40, 100)], 0)
    assert changed_slots(before) == [slot_of(3, p) for p in range(40, 100)]
    assert d.tokens[3] == reference[3][:1]  # the prompt row's first token
    assert slot_row(d.w, 1) == state1 and same(device_rows(others), rows)


# ---------------------------------------------------------------- shape and arena


def test_mixed_program_shape_is_the_spec_packed_extent():
    shape = ProgramShape.of(mixed(4, 64))
    assert (shape.tokens, shape.lanes, shape.max_query_len, shape.row_query_len) == (67, 4, 64, 1)
    assert shape.mixed and not ProgramShape.of(decode_program(4)).mixed
    wide = GraphDescriptor(GraphKind.MIXED, 8, token_capacity=3, proposal_depth=2,
                           prompt_capacity=128)  # fmt: skip
    assert ProgramShape.of(wide) == ProgramShape(128 + 7 * 3, 8, 128, 3)
    assert ProgramShape.of(prefill_program(64)) == ProgramShape(64, 1, 64)


@pytest.mark.process
def test_wider_mixed_programs_need_a_proposer(checkpoint):
    """Wide mixed programs verify proposals (tests/ranks/test_speculative.py
    runs them); without a proposal source there is nothing to verify."""
    path, _ = checkpoint
    w = make_worker(path)
    wide = GraphDescriptor(GraphKind.MIXED, 4, token_capacity=2, proposal_depth=1,
                           prompt_capacity=64)  # fmt: skip
    with pytest.raises(ProgramError, match="needs a proposer"):
        PreparedProgram(wide, w.model, w.outputs, w.arena, PAGE)


def run_lanes(w: RankWorker, fence: int, program, lanes, prompt_row: int = -1):
    completion = w.execute(Frame.from_lanes(fence, program, lanes, prompt_row))
    assert completion.error is None
    return completion


def first_chunk(slot: int, tokens, commits: int = 1) -> FrameLane:
    return FrameLane(slot, 1, "prefill", 0, tuple(tokens), 0, pages(slot), commits, SAMPLING)


def decoder(slot: int, position: int) -> FrameLane:
    return FrameLane(slot, 1, "decode", 0, (), position, (), 1)


def _padded_body(program: PreparedProgram, variant: str, width: int, *extent: int) -> None:
    """A program body over its whole shape, whatever the frame's extent."""
    PreparedProgram._body(program, variant, width)


def test_packed_offsets_are_prefix_sums_of_query_lengths_whatever_the_slots(checkpoint):
    """Decoders at positions 10 and 4 around a 37-token prompt row: what the
    program derives on the device from the lanes' query lengths, start positions
    and slots (the forward's inputs), in lane order whatever the slots."""
    path, _ = checkpoint
    for (a, b, c), padded in itertools.product(([3, 0, 2], [1, 2, 0], [2, 3, 1]), (False, True)):
        w = make_worker(path)
        if padded:  # the whole shape, as a captured program runs it
            for p in w.programs.values():
                p._body = functools.partial(_padded_body, p)
        run_lanes(w, 1, prefill_program(64), [first_chunk(a, range(60, 70))])
        run_lanes(w, 2, prefill_program(64), [first_chunk(c, (11, 12, 13, 14))])
        pending = int(w.arena.pending[a]), int(w.arena.pending[c])
        forwards = record_forwards(w)
        lanes = [decoder(a, 10), first_chunk(b, range(20, 57), commits=0), decoder(c, 4)]
        run_lanes(w, 3, mixed(4, 64), lanes, prompt_row=1)
        (forward,) = forwards
        meta = forward["meta"]
        # Eager (CPU) frames run their own extent: 3 lanes, 39 tokens.
        r = 4 if padded else 3
        n = w.programs[mixed(4, 64).key].shape.tokens if padded else 39
        assert forward["input_ids"].shape == (n,)
        assert meta.query_lens.tolist() == [1, 37, 1, 0][:r]
        assert meta.query_start.tolist() == [0, 1, 38, 39][:r]  # lane order, not slot order
        assert forward["last"].tolist() == [0, 37, 38, 38][:r]  # each lane's logits row
        # Decoders read their slot's pending token on the device.
        assert forward["input_ids"][:39].tolist() == [pending[0], *range(20, 57), pending[1]]
        assert forward["positions"][:39].tolist() == [10, *range(37), 4]
        assert meta.prefill_row.tolist() == [1]
        slot_of = [pages(s)[p // PAGE] * PAGE + p % PAGE for s, p in zip((a, b, c), (10, 0, 4))]
        assert meta.slot_mapping[[0, 1, 38]].tolist() == slot_of
        assert (meta.slot_mapping[39:] == -1).all()  # unused token capacity writes nothing
        assert meta.context_lens.tolist() == [11, 37, 5, 0][:r]
    # The derivation is tensor ops on the arena: a new length moves every later offset.
    program = w.programs[mixed(4, 64).key]
    program.inputs.query_lens[0] = 2
    program._body("argmax", program.max_pages)
    assert forwards[-1]["meta"].query_start.tolist() == [0, 2, 39, 40]
    assert packed_query_start(torch.tensor([0, 3, 0, 2])).tolist() == [0, 0, 3, 3]


def test_one_query_length_upload_and_no_uploaded_offsets(checkpoint):
    path, _ = checkpoint
    names = [f.name for f in dataclasses.fields(FrameInputs)]
    assert names == [*LANE_FIELDS, *SCALARS, "input_ids"]
    assert "query_lens" in names and "prefill_row" in names
    derived = {"query_start", "logits_indices", "cu_seqlens", "positions", "slot_mapping",
               "context_lens", "page_tables"}  # fmt: skip
    assert not derived & set(names)
    w = make_worker(path)
    program = w.programs[mixed(2, 128).key]
    n, lanes, scratch = program.shape.tokens, program.shape.lanes, w.arena.scratch
    assert (n, lanes) == (129, 2)
    # Per token: its id; per lane: 7 fields (slot row, query length, start
    # position, step, commit row, from pending, penalty row to reset);
    # prefill_row.  No page table: the slots' rows live in the arena.
    assert program._ints.numel() == int_size(n, lanes) == n + 7 * lanes + 1
    # A frame packs the lanes and the tokens it feeds, nothing per page.
    Driver(w).run(prefill_program(64), [("prefill", 0, 0, len(PROMPTS[0]))])
    checked = w.slots.check(Frame.from_lanes(9, mixed(2, 128), [decoder(0, 5)]), w.vocab)
    host = np.full(program.int_size, -7, np.int64)
    assert program.pack(checked, host) == (7 * lanes + 1 + 1, 1)
    packed = FrameInputs.over(torch.from_numpy(host), n, lanes)
    assert packed.query_lens.tolist() == [1, 0] and packed.state_row.tolist() == [0, scratch]
    assert packed.prefill_row.tolist() == [-1] and packed.from_pending.tolist() == [1, 0]
    assert packed.reset_row.tolist() == [scratch, scratch]  # a decoder resets nothing
    assert packed.input_ids[:1].tolist() == [0]  # its id comes from its pending token
    # What capture binds: all padding, the whole page-table width, nothing written.
    forwards = record_forwards(w)
    before = snapshot(w)
    program._pad()
    x = program.inputs
    assert (x.query_lens == 0).all() and (x.state_row == scratch).all()
    assert (x.count_row == scratch).all()
    program._body("argmax", program.max_pages)
    meta = forwards[-1]["meta"]
    assert meta.page_tables.shape == (lanes, program.max_pages)
    assert (meta.slot_mapping == -1).all() and (meta.page_tables == -1).all()
    assert changed(before, snapshot(w)) == []


def test_frames_and_programs_refuse_rows_that_do_not_fit_their_role(checkpoint):
    """The schema refuses a prompt row that is not the frame's one prefill lane;
    a program refuses lanes beyond its rows or roles; nothing changes."""
    path, _ = checkpoint
    w = make_worker(path)
    d = Driver(w)
    d.run(prefill_program(64), [("prefill", 1, 0, len(PROMPTS[1]))])
    chunk, decode = d.lane(("prefill", 3, 0, 10)), d.lane(("decode", 1))
    fits = Frame.from_lanes(1, mixed(4, 64), [decode, chunk], prompt_row=1)
    before = snapshot(w)
    for program, lanes, row, reason in [
        (mixed(4, 64), [decode, chunk], 0, "not a prefill lane"),  # a 10-token row
        (mixed(4, 64), [decode, chunk], -1, "must name the prefill lane"),
        (mixed(4, 64), [d.lane(("prefill", 3, 0, 65))], 0, "prompt_capacity"),  # beyond C
        (mixed(4, 64), [decode], 1, "prompt_row"),  # no such lane
        (mixed(4, 64), [chunk, d.lane(("prefill", 2, 0, 1))], 0, "one prefill lane at most"),
        (decode_program(2), [decode], 0, "prompt_row"),
        (prefill_program(64), [chunk], 0, "only mixed programs"),
    ]:
        with pytest.raises(ProtocolError, match=reason):
            Frame.from_lanes(9, program, lanes, prompt_row=row)
    checked = w.slots.check(fits, w.vocab)
    mixed4 = w.programs[mixed(4, 64).key]
    host = np.zeros(mixed4.int_size, np.int64)
    mixed4.pack(checked, host)  # fits
    one_decoder = dataclasses.replace(checked, query_len=np.array([1, 1]))
    for target, bad, reason in [
        (mixed4, dataclasses.replace(checked, query_len=np.array([2, 10])), "lane 0: 2 tokens"),
        (mixed4, dataclasses.replace(checked, prefill=np.array([True, True])), "at most one"),
        (w.programs[decode_program(1).key], checked, "2 lanes for 1 rows"),
        (w.programs[decode_program(2).key], one_decoder, "a prompt lane for"),
    ]:
        with pytest.raises(ProgramError, match=reason):
            target.pack(bad, host)
    assert changed(before, snapshot(w)) == []
    d.run(mixed(4, 64), [("decode", 1), ("prefill", 3, 0, 10)], 1)  # and it runs


# ---------------------------------------------------------------- attention


def _attention_case(lanes: list[tuple[int, int]], c: int, num_lanes: int):
    """Random paged K/V (noise in every page) for lanes of (past, new) tokens."""
    heads, kv_heads, d, page_size, num_pages = 4, 2, 8, 4, 40
    cache = PagedKVCache(
        num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=kv_heads, head_dim=d
    )
    cache._storage.normal_()
    perm = torch.randperm(num_pages).tolist()
    tables = []
    for past, new in lanes:
        n = -(-(past + new) // page_size)
        tables.append(perm[:n])
        perm = perm[n:]
    meta, positions = AttentionMetadata.build(
        query_lens=[new for _, new in lanes],
        context_lens=[past + new for past, new in lanes],
        page_tables=tables,
        page_size=page_size,
        num_tokens=c + num_lanes - 1,
        num_lanes=num_lanes,
        max_pages=5,
        max_query_len=c,
    )
    q = torch.randn(meta.num_tokens, heads, d)
    k, v = torch.randn(2, meta.num_tokens, kv_heads, d)
    cache.write(0, k, v, meta.slot_mapping)
    return (q, cache.key(0), cache.value(0), positions), meta, tables, 1 / math.sqrt(d)


@pytest.mark.parametrize(
    ("lanes", "row"),
    [
        ([(5, 1), (12, 1), (6, 9), (0, 1)], 2),  # prompt row 2: 6 cached + 9 new
        ([(6, 12)], 0),  # prompt only, a full chunk
        ([(5, 1), (12, 1), (0, 1)], -1),  # decoders only
        ([], -1),  # nothing
    ],
)
def test_two_pass_mixed_attention_equals_the_one_pass_reference(lanes, row):
    torch.manual_seed(0)
    args, meta, _, scale = _attention_case(lanes, 12, 6)
    one_pass = paged_attention_reference(*args, meta, scale)  # every lane with Q = C
    mixed_meta = dataclasses.replace(meta, prefill_row=torch.tensor([row]), row_query_len=1)
    prompt, rows = split_prompt_row(mixed_meta)
    assert prompt.num_lanes == 1 and prompt.max_query_len == 12 and rows.max_query_len == 1
    got = mixed_paged_attention(*args, mixed_meta, scale)
    torch.testing.assert_close(got, one_pass, atol=1e-6, rtol=0)
    used = sum(new for _, new in lanes)
    assert bool(got[:used].abs().sum() > 0) == bool(used)
    assert torch.equal(got[used:], torch.zeros_like(got[used:]))  # unused capacity


def test_mixed_prompt_row_attends_causally_over_prefix_and_chunk():
    torch.manual_seed(1)
    lanes = [(5, 1), (12, 1), (6, 9), (0, 1)]
    (q, k_pages, v_pages, positions), meta, tables, scale = _attention_case(lanes, 12, 6)
    mixed_meta = dataclasses.replace(meta, prefill_row=torch.tensor([2]), row_query_len=1)
    got = mixed_paged_attention(q, k_pages, v_pages, positions, mixed_meta, scale)
    kv_heads, d = k_pages.shape[2], k_pages.shape[3]
    heads = q.shape[1]
    k = k_pages[tables[2]].reshape(-1, kv_heads, d)[:15]  # (ctx, KV, d)
    v = v_pages[tables[2]].reshape(-1, kv_heads, d)[:15]
    k = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (H, ctx, d)
    v = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    qs = q[2:11].transpose(0, 1)  # the chunk's tokens, after lanes 0 and 1
    causal = torch.ones(9, 15, dtype=torch.bool).tril(6)
    dense = F.scaled_dot_product_attention(qs, k, v, attn_mask=causal, scale=scale)
    torch.testing.assert_close(got[2:11], dense.transpose(0, 1))


# ---------------------------------------------------------------- the worker


def test_report_lists_mixed_programs_and_decode_lanes_keep_their_state(checkpoint):
    path, _ = checkpoint
    w = make_worker(path)
    kinds = sorted(
        (d.kind.value, d.batch_capacity, d.prompt_capacity) for d in w.report().descriptors
    )
    assert [k for k in kinds if k[0] == "mixed"] == [
        ("mixed", 2, 64), ("mixed", 2, 128), ("mixed", 4, 64), ("mixed", 4, 128),
    ]  # fmt: skip
    d = Driver(w)
    d.run(prefill_program(64), [("prefill", 0, 0, 5)])
    state, before = slot_row(d.w, 0), snapshot(d.w)
    # A mixed frame with a decoder that has no state is refused with nothing changed.
    lanes = [d.lane(("prefill", 1, 0, 9)), FrameLane(2, 1, "decode", 0, (), 3, (), 1)]
    bad = Frame.from_lanes(99, mixed(2, 64), lanes, prompt_row=0)
    with pytest.raises(FrameError, match="no state"):
        d.w.execute(bad)
    assert slot_row(d.w, 0) == state and not d.w.slots.holds(1)
    assert changed(before, snapshot(d.w)) == []


@pytest.mark.process
def test_rank_process_with_mixed_prefill_runs_a_mixed_frame(checkpoint, tmp_path):
    """``python -m runtime.ranks --mixed-prefill`` reports and runs mixed programs."""
    from runtime.deploy.launch import spawn_ranks, stop_ranks
    from runtime.transport.catalog_report import CatalogReport
    from runtime.transport.completion import Completion
    from runtime.transport.coordinator_channel import CoordinatorChannel

    path, reference = checkpoint
    channel = CoordinatorChannel(1)
    args = ["--model", str(path), "--max-concurrency", "2", "--max-prefill-tokens", "64",
            "--num-pages", "32", "--device", "cpu", "--mixed-prefill"]  # fmt: skip
    procs = spawn_ranks(channel.endpoints, 1, args, env=dict(os.environ, FLARE_HOME=str(tmp_path)))

    def receive(kind):
        while True:
            message = channel.recv(timeout_ms=120_000)
            assert message is not None, f"timed out waiting for {kind.__name__}"
            if isinstance(message, kind):
                return message

    try:
        channel.handshake(timeout_s=120.0)
        report = receive(CatalogReport)
        assert mixed(2, 64) in report.descriptors
        first = FrameLane(0, 1, "prefill", 0, tuple(PROMPTS[0]), 0, pages(0), 1, SAMPLING)
        channel.publish(Frame.from_lanes(1, prefill_program(64), [first]))
        tokens = {0: list(receive(Completion).lane_results()[0].tokens)}
        decoder = FrameLane(0, 1, "decode", 0, (), len(PROMPTS[0]), (), 1, None)
        chunk = FrameLane(1, 1, "prefill", 0, tuple(PROMPTS[1]), 0, pages(1), 1, SAMPLING)
        lanes = (decoder, chunk)
        channel.publish(Frame.from_lanes(2, mixed(2, 64), lanes, prompt_row=1))
        completion = receive(Completion)
        assert completion.error is None and completion.fence == 2
        results = completion.lane_results()
        tokens[0] += results[0].tokens
        tokens[1] = list(results[1].tokens)
        assert tokens == {0: reference[0][:2], 1: reference[1][:1]}
        channel.shutdown_ranks()
        assert stop_ranks(procs, timeout_s=60) == [0]
    finally:
        stop_ranks(procs, timeout_s=0)
        channel.close()
