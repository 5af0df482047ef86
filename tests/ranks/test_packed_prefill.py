"""Packed prefill programs: a PREFILL descriptor of batch capacity B > 1 runs up to
B prompt rows that share its C packed prompt tokens (issue 26, the rank side).

The same rows run as packed frames and as single prefill frames give the same
greedy tokens, log probabilities, KV and pending tokens at TP=1 and TP=2
(gloo), equal to transformers; rows finish their prompt or take a chunk, and a
row continues over its cached prefix.  Inactive rows and unused token
capacity mutate nothing; a frame over B lanes or C tokens, or with a decode
lane, is refused with nothing changed; each prompt row keeps its own penalty
state (reset, prompt marks, a restored row left as restored); the draft
context is fed every row.  The rank's capacity settings build no packed
programs yet: the catalog here adds them.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig, build_catalog
from runtime.ranks.model import load_model
from runtime.ranks.model.parallel import TPGroup
from runtime.ranks.programs import PreparedProgram
from runtime.ranks.proposals import ProposerConfig
from runtime.ranks.shapes import ProgramError, ProgramShape
from runtime.ranks.worker import RankWorker
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import tensor_to_torch
from tests.support.checkpoints import greedy, write_tiny
from tests.support.rank_state import changed, record_forwards, slot_row, snapshot
from tests.support.tp_runs import tp1_and_tp2

PAGE = 16
PAGES_PER_SLOT = 8  # 128 tokens per request
PROMPTS = [
    [5, 17, 33, 3, 60],
    [9, 9, 9, 41, 77, 12, 3, 50, 21],
    [88],
    list(range(3, 103)),  # 100 tokens: a 64-token chunk, then the rest over its cache
    [(7 * i + 3) % 120 + 2 for i in range(50)],  # 50 tokens: 27, then 23 across a page
]
NEW = 6
LOGPROBS = 3
CAPACITY = CapacityConfig(max_concurrency=8, min_prefill_tokens=64, max_prefill_tokens=128)


def packed(b: int, c: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, b, prompt_capacity=c)


def single(tokens: int) -> GraphDescriptor:
    """The smallest single prefill program holding ``tokens``."""
    return packed(1, 64 if tokens <= 64 else 128)


def decode_program(b: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.DECODE, b)


def pages(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))


def make_worker(
    path, group: TPGroup | None = None, rank: int = 0, world: int = 1, *, draft=None, widths=()
) -> RankWorker:
    """A worker over the capacity's catalog plus packed prefill programs (B = 2, 4;
    C = 64, 128); with ``widths``, speculative rounds (a draft model, else copy
    proposals)."""
    capacity = dataclasses.replace(CAPACITY, speculative_widths=tuple(widths))
    catalog = build_catalog(capacity) + [packed(b, c) for b in (2, 4) for c in (64, 128)]
    proposer = ProposerConfig("draft" if draft else "copy") if widths else None
    return RankWorker(
        load_model(path, group), capacity, num_pages=6 * PAGES_PER_SLOT, page_size=PAGE,
        rank=rank, world_size=world, catalog=catalog, proposer=proposer,
        draft_model=None if draft is None else load_model(draft, group),
    )  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-packed")
    model = write_tiny("llama", path, seed=13)
    return path, greedy(model, PROMPTS, NEW)


# ---------------------------------------------------------------- a frame driver


class Driver:
    """Frames as the coordinator builds them; rows are ("prefill", slot, start,
    end) over PROMPTS[slot] or ("decode", slot)."""

    def __init__(self, worker: RankWorker, sampling: SamplingParams) -> None:
        self.w = worker
        self.sampling = sampling
        self.fence = 0
        self.position: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[list[float]]] = {}  # rank 0, when asked

    def lane(self, row: tuple) -> FrameLane:
        if row[0] == "decode":
            return FrameLane(row[1], 1, "decode", 0, (), self.position[row[1]], (), 1)
        _, slot, start, end = row
        prompt = PROMPTS[slot]
        chunk, last = tuple(prompt[start:end]), int(end == len(prompt))
        table = pages(slot) if start == 0 else ()  # the first chunk brings the table
        return FrameLane(slot, 1, "prefill", start, chunk, start, table, last, self.sampling)

    def run(self, program: GraphDescriptor, rows: list[tuple]):
        self.fence += 1
        lanes = [self.lane(row) for row in rows]
        completion = self.w.execute(Frame.from_lanes(self.fence, program, lanes))
        assert completion.error is None and completion.device_ns > 0
        for lane in lanes:
            fed = len(lane.prompt_tokens) if lane.phase == "prefill" else 1
            self.position[lane.slot] = lane.position + fed
        if self.w.rank == 0:
            results = completion.lane_results()
            values = completion.sidecars.get("logprobs")
            for i, (lane, result) in enumerate(zip(lanes, results, strict=True)):
                assert (result.slot, len(result.tokens)) == (lane.slot, lane.commits)
                self.tokens.setdefault(lane.slot, []).extend(result.tokens)
                if result.tokens and values is not None:
                    self.logprobs.setdefault(lane.slot, []).append(
                        tensor_to_torch(values)[i].tolist()
                    )
        return completion

    def finish(self) -> None:
        """Decode every prompted slot to NEW tokens (every rank: by its slot table)."""
        while True:
            behind = [s for s in sorted(self.position) if self.w.slots.step[s] < NEW]
            if not behind:
                return
            batch = next(b for b in (1, 2, 4, 8) if b >= len(behind))
            self.run(decode_program(batch), [("decode", s) for s in behind])


# Packed frames: rows that finish their prompt, a chunk short of its end (it
# commits nothing), the rest of a prompt over its cached prefix (64 tokens, and
# 27 ending inside a page); rows left inactive, and a frame that fills C.
SCHEDULE = [
    (packed(4, 128), [("prefill", 3, 0, 64), ("prefill", 0, 0, 5), ("prefill", 1, 0, 9)]),
    (packed(4, 64), [("prefill", 2, 0, 1), ("prefill", 3, 64, 100), ("prefill", 4, 0, 27)]),
    (packed(2, 64), [("prefill", 4, 27, 50)]),
]


def run_schedule(d: Driver, use_packed: bool) -> None:
    for program, rows in SCHEDULE:
        if use_packed:
            d.run(program, rows)
        else:  # each row alone, in the same order
            for row in rows:
                d.run(single(row[3] - row[2]), [row])
    d.finish()


def scenario(path: str, group: TPGroup, rank: int, world: int) -> dict:
    """Both schedules on fresh workers, argmax and logprobs variants: what the
    tests compare (rank 0: tokens and log probabilities)."""
    out: dict = {}
    for name, sampling in (("argmax", SamplingParams()), ("logprobs", SamplingParams(logprobs=3))):
        caches = []
        for use_packed in (True, False):
            d = Driver(make_worker(path, group, rank, world), sampling)
            run_schedule(d, use_packed)
            key = f"{name}-{'packed' if use_packed else 'separate'}"
            out[key] = {"tokens": d.tokens, "logprobs": d.logprobs}
            out[f"{key}-pending"] = [int(d.w.arena.pending[s]) for s in range(len(PROMPTS))]
            cache = d.w.model.kv_cache
            caches.append(cache._storage[:, :, : cache.num_slots].clone())
        out[f"{name}-kv_max_diff"] = float((caches[0] - caches[1]).abs().max())
        out[f"{name}-kv_written"] = float(caches[0].abs().sum())
    return out


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    return tp1_and_tp2(scenario, str(path), tmp_path_factory.mktemp("packed-tp2"))


@pytest.mark.parametrize("variant", ["argmax", "logprobs"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.process
def test_packed_frames_equal_single_prefills_and_transformers(checkpoint, runs, tp, variant):
    _, reference = checkpoint
    got = runs[tp]
    packed_run, separate = got[f"{variant}-packed"], got[f"{variant}-separate"]
    slots = range(len(PROMPTS))
    assert [packed_run["tokens"][s] for s in slots] == reference
    assert [separate["tokens"][s] for s in slots] == reference
    if variant == "logprobs":  # every token's log probabilities agree too
        for s in slots:
            a, b = (torch.tensor(r["logprobs"][s]) for r in (packed_run, separate))
            assert a.shape == (NEW, 1 + LOGPROBS)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # The KV both schedules wrote is the same (and not trivially zero), and so
    # are the pending tokens the next decode reads.
    assert got[f"{variant}-kv_max_diff"] < 1e-5 and got[f"{variant}-kv_written"] > 0
    assert got[f"{variant}-packed-pending"] == got[f"{variant}-separate-pending"]
    assert got[f"{variant}-packed-pending"] == [tokens[-1] for tokens in reference]


@pytest.mark.process
def test_tp2_ranks_agree(runs):
    for variant in ("argmax", "logprobs"):
        pending = f"{variant}-packed-pending"
        assert runs["rank1"][pending] == runs[2][pending]
        assert runs["rank1"][f"{variant}-packed"]["tokens"] == {}  # only rank 0 reports


# ---------------------------------------------------------------- shape and packing


def test_a_packed_prefill_shape_has_b_lanes_sharing_c_tokens():
    assert ProgramShape.of(packed(4, 128)) == ProgramShape(128, 4, 128)
    assert ProgramShape.of(packed(64, 64)) == ProgramShape(64, 64, 64)
    assert ProgramShape.of(packed(1, 64)) == ProgramShape(64, 1, 64)  # a single prefill
    assert not ProgramShape.of(packed(4, 128)).mixed


@pytest.mark.parametrize("padded", [False, True])
def test_rows_pack_at_the_prefix_sums_of_their_query_lengths(checkpoint, padded):
    """Three rows in a B=4, C=128 program: what the program derives on the device
    from the one query-length upload (offsets, positions, slots, logits rows).
    An eager (CPU) frame runs its three rows and 54 tokens; ``padded``: the whole
    shape, as a captured program does."""
    path, _ = checkpoint
    w = make_worker(path)
    if padded:
        for p in w.programs.values():
            p._body = functools.partial(_padded_body, p)
    d = Driver(w, SamplingParams())
    d.run(single(10), [("prefill", 4, 0, 10)])  # slot 4 holds a 10-token prefix
    forwards = record_forwards(w)
    d.run(packed(4, 128), [("prefill", 1, 0, 9), ("prefill", 4, 10, 50), ("prefill", 0, 0, 5)])
    (forward,) = forwards
    meta = forward["meta"]
    r = 4 if padded else 3
    assert forward["input_ids"].shape == ((128,) if padded else (54,))
    assert meta.query_lens.tolist() == [9, 40, 5, 0][:r]
    assert meta.query_start.tolist() == [0, 9, 49, 54][:r]
    assert meta.context_lens.tolist() == [9, 50, 5, 0][:r]
    assert meta.prefill_row is None and meta.max_query_len == 128
    assert forward["last"].tolist() == [8, 48, 53, 53][:r]  # each row's logits row
    ids = PROMPTS[1] + PROMPTS[4][10:50] + PROMPTS[0]
    assert forward["input_ids"][:54].tolist() == ids
    assert forward["positions"][:54].tolist() == [*range(9), *range(10, 50), *range(5)]
    slot_of = [pages(s)[p // PAGE] * PAGE + p % PAGE for s, p in ((1, 0), (4, 10), (0, 0))]
    assert meta.slot_mapping[[0, 9, 49]].tolist() == slot_of
    assert (meta.slot_mapping[54:] == -1).all()  # unused token capacity writes nothing


def _padded_body(program: PreparedProgram, variant: str, width: int, *extent: int) -> None:
    """A program body over its whole shape, whatever the frame's extent."""
    PreparedProgram._body(program, variant, width)


def test_the_capacity_packed_programs_are_prepared_and_run(checkpoint):
    """``CapacityConfig(packed_prefill=True)``: the rank reports and runs them."""
    path, reference = checkpoint
    capacity = dataclasses.replace(CAPACITY, max_concurrency=4, packed_prefill=True)
    w = RankWorker(load_model(path), capacity, num_pages=6 * PAGES_PER_SLOT, page_size=PAGE)
    reported = [d for d in w.report().descriptors if d.kind is GraphKind.PREFILL]
    assert [(d.batch_capacity, d.prompt_capacity) for d in reported] == [
        (1, 64),
        (1, 128),
        (2, 128),
    ]
    assert all(d.key in w.programs for d in reported)
    d = Driver(w, SamplingParams())
    d.run(packed(2, 128), [("prefill", 1, 0, 9), ("prefill", 3, 0, 100)])
    assert (d.tokens[1], d.tokens[3]) == (reference[1][:1], reference[3][:1])


# ---------------------------------------------------------------- no stray state


def test_inactive_rows_and_unused_capacity_mutate_nothing(checkpoint):
    """Two rows in a B=4, C=128 program under the full sampler with speculation
    (a history to keep): rows 2 and 3 and 87 token rows are padding."""
    path, _ = checkpoint
    w = make_worker(path, widths=(2,))
    penalized = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5)
    d = Driver(w, penalized)
    for slot in (0, 1):
        d.run(single(len(PROMPTS[slot])), [("prefill", slot, 0, len(PROMPTS[slot]))])
    cache = w.model.kv_cache
    num_slots = cache.num_slots  # the visible slots (the scratch row is hidden)
    # Noise in every visible slot, so any stray write shows.
    gen = torch.Generator().manual_seed(5)
    visible = cache._storage[:, :, :num_slots]
    cache._storage[:, :, :num_slots] = torch.randn(visible.shape, generator=gen)
    before = snapshot(w)
    others = [s for s in range(w.arena.slots) if s not in (2, 3)]
    state0, state1 = slot_row(w, 0), slot_row(w, 1)
    d.run(packed(4, 128), [("prefill", 3, 0, 40), ("prefill", 2, 0, 1)])
    after = snapshot(w)
    kv = after["kv"] != before["kv"]  # (layers, 2, slots, KV, d)
    written = kv.flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
    expected = [pages(3)[p // PAGE] * PAGE + p % PAGE for p in range(40)]
    assert written == sorted([pages(2)[0] * PAGE, *expected])
    for name, value in after.items():  # every other slot's device rows are untouched
        if name.startswith(("arena.", "penalties.")):
            assert torch.equal(value[others], before[name][others]), name
    assert (slot_row(w, 0), slot_row(w, 1)) == (state0, state1)
    # The two rows: slot 3 took a chunk (nothing committed), slot 2 its whole prompt.
    # Only a row that commits a token writes its device rows' position and step.
    assert [int(w.slots.next_position[s]) for s in (3, 2)] == [40, 1]
    assert [int(w.arena.next_pos[s]) for s in (3, 2)] == [0, 1]
    assert [int(w.arena.steps[s]) for s in (3, 2)] == [0, 1]
    assert d.tokens[3] == [] and len(d.tokens[2]) == 1
    assert int(w.arena.pending[2]) == d.tokens[2][0]
    assert w.arena.history[3, :40].tolist() == PROMPTS[3][:40]
    assert w.arena.history[2, :2].tolist() == [88, d.tokens[2][0]]
    penalties = w.outputs.penalties
    assert set(penalties.prompt_mask[3].nonzero().flatten().tolist()) == set(PROMPTS[3][:40])
    assert set(penalties.prompt_mask[2].nonzero().flatten().tolist()) == {88}
    assert int(penalties.counts[3].sum()) == 0 and int(penalties.counts[2].sum()) == 1


def test_frames_over_b_lanes_or_c_tokens_are_refused_with_nothing_changed(checkpoint):
    path, _ = checkpoint
    w = make_worker(path)
    d = Driver(w, SamplingParams())
    d.run(single(9), [("prefill", 1, 0, 9)])
    rows = [d.lane(("prefill", s, 0, len(PROMPTS[s]))) for s in (0, 2, 4)]  # 5 + 1 + 50
    # The wire refuses more lanes than B and more tokens than C, naming them.
    with pytest.raises(ProtocolError, match="3 lanes exceed the program's batch_capacity 2"):
        Frame.from_lanes(9, packed(2, 128), rows)
    over = [*rows, d.lane(("prefill", 3, 0, 10))]  # 66 tokens
    with pytest.raises(ProtocolError, match="66 prompt tokens exceed the program's prompt_cap"):
        Frame.from_lanes(9, packed(4, 64), over)
    before = snapshot(w)
    # A decode lane beside prompt rows passes the wire; the rank refuses it.
    roles = Frame.from_lanes(9, packed(4, 64), [rows[0], d.lane(("decode", 1))])
    with pytest.raises(ProgramError, match="lane 1: a decode lane for prefill B=4 C=64"):
        w.execute(roles)
    # The programs refuse what does not fit them, whatever the frame says.
    fits = w.slots.check(Frame.from_lanes(10, packed(4, 128), rows), w.vocab)
    program = w.programs[packed(4, 128).key]
    host = np.zeros(program.int_size, np.int64)
    assert program.pack(fits, host)[0] == 7 * 4 + 1 + 56  # lane fields, prefill_row, tokens
    for target, bad, reason in [
        (w.programs[packed(2, 128).key], fits, "3 lanes for 2 rows of prefill B=2 C=128"),
        (program, dataclasses.replace(fits, query_len=np.array([5, 1, 129])), "lane 2: 129"),
        (program, dataclasses.replace(fits, query_len=np.array([60, 60, 9])), "129 tokens do"),
    ]:
        with pytest.raises(ProgramError, match=reason):
            target.pack(bad, host)
    assert changed(before, snapshot(w)) == []
    d.run(packed(4, 128), [("prefill", s, 0, len(PROMPTS[s])) for s in (0, 2, 4)])  # it runs


# ---------------------------------------------------------------- per-lane state

PENALTIES = [
    SamplingParams(repetition_penalty=2.0, presence_penalty=1.5),
    SamplingParams(frequency_penalty=1.2, repetition_penalty=0.6),
    SamplingParams(temperature=0.8, top_k=40, seed=9, presence_penalty=-1.0,
                   repetition_penalty=1.4),
]  # fmt: skip
RESUMED = [*PROMPTS[4][:12], 7, 7, 30]  # a 12-token prompt and 3 emitted tokens


def penalized_run(path, use_packed: bool) -> dict:
    """Earlier generations on slots 0 and 1 leave penalty state behind; then two
    new generations there and a resumed one on slot 2 (its record restored by
    the rank), as one packed frame or as single prefills; then 5 decode steps."""
    w = make_worker(path)
    fence = 0

    def run(program, lanes):
        nonlocal fence
        fence += 1
        completion = w.execute(Frame.from_lanes(fence, program, lanes))
        assert completion.error is None
        return {r.slot: list(r.tokens) for r in completion.lane_results()}

    for slot, prompt in ((0, PROMPTS[4][:20]), (1, PROMPTS[3][:30])):
        run(single(len(prompt)), [FrameLane(slot, 1, "prefill", 0, tuple(prompt), 0,
                                            pages(slot), 1, PENALTIES[slot])])  # fmt: skip
        for position in range(len(prompt), len(prompt) + 3):
            run(decode_program(1), [FrameLane(slot, 1, "decode", 0, (), position, (), 1)])
    record = Restore(tuple(RESUMED), 12)
    rows = [
        FrameLane(0, 2, "prefill", 0, tuple(PROMPTS[1]), 0, pages(0), 1, PENALTIES[0]),
        FrameLane(2, 1, "prefill", 0, tuple(RESUMED), 0, pages(2), 1, PENALTIES[2], record),
        FrameLane(1, 2, "prefill", 0, tuple(PROMPTS[0]), 0, pages(1), 1, PENALTIES[1]),
    ]
    tokens: dict[int, list[int]] = {}
    for program, lanes in (
        [(packed(4, 64), rows)] if use_packed else [(single(1), [r]) for r in rows]
    ):
        tokens.update(run(program, lanes))
    position = {0: len(PROMPTS[1]), 1: len(PROMPTS[0]), 2: len(RESUMED)}
    for _ in range(5):
        lanes = [FrameLane(s, 2 if s < 2 else 1, "decode", 0, (), position[s], (), 1)
                 for s in (0, 1, 2)]  # fmt: skip
        for slot, new in run(decode_program(4), lanes).items():
            tokens[slot] += new
            position[slot] += 1
    state = w.outputs.penalties
    return {
        "tokens": tokens,
        "counts": state.counts[:3].clone(),
        "prompt_mask": state.prompt_mask[:3].clone(),
        "steps": [int(w.slots.step[s]) for s in range(3)],
    }


def test_each_prompt_row_keeps_its_own_penalty_state(checkpoint):
    """The ``sample`` variant of a packed frame: each new generation resets its own
    row and marks its own prompt, a restored row is left as the rank restored
    it; the rows sample what single prefills do."""
    path, _ = checkpoint
    got, want = penalized_run(path, True), penalized_run(path, False)
    assert got["tokens"] == want["tokens"] and all(len(t) == 6 for t in got["tokens"].values())
    assert got["steps"] == want["steps"] == [6, 6, 9]  # the resumed row went on from 3
    assert torch.equal(got["counts"], want["counts"])
    assert torch.equal(got["prompt_mask"], want["prompt_mask"])
    # Exactly each row's own prompt and outputs: nothing of the earlier generations.
    vocab = got["counts"].shape[1]
    outputs = [got["tokens"][0], got["tokens"][1], [7, 7, 30, *got["tokens"][2]]]
    prompts = [PROMPTS[1], PROMPTS[0], RESUMED]  # a resumed chunk marks its outputs too
    for slot in range(3):
        counts = torch.bincount(torch.tensor(outputs[slot]), minlength=vocab)
        assert torch.equal(got["counts"][slot], counts.to(torch.int32)), slot
        marked = got["prompt_mask"][slot].nonzero().flatten().tolist()
        assert marked == sorted(set(prompts[slot])), slot


def speculative(b: int, w: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.SPECULATIVE, b, w, w - 1)


def test_the_draft_context_is_fed_every_packed_row(checkpoint):
    """With a draft that is the target: the packed rows' draft KV and token
    history are what single prefills leave, and the next round accepts every
    proposal of every row."""
    path, reference = checkpoint
    kept = []
    for use_packed in (True, False):
        w = make_worker(path, draft=path, widths=(4,))
        d = Driver(w, SamplingParams())
        for program, rows in SCHEDULE:
            if use_packed:
                d.run(program, rows)
            else:
                for row in rows:
                    d.run(single(row[3] - row[2]), [row])
        draft = w.draft_model.kv_cache
        kept.append((draft._storage[:, :, : draft.num_slots].clone(), w.arena.history[:5].clone()))
        for s, prompt in enumerate(PROMPTS):  # each prompt, then its pending token
            assert w.arena.history[s, : len(prompt) + 1].tolist() == [*prompt, reference[s][0]]
        if use_packed:  # a round over four rows, then one over the fifth
            for slots in ([0, 1, 2, 3], [4]):
                lanes = [FrameLane(s, 1, "decode", 0, (), d.position[s], (), 4) for s in slots]
                d.fence += 1
                frame = Frame.from_lanes(d.fence, speculative(len(slots), 4), lanes)
                completion = w.execute(frame)
                assert list(completion.token_count) == [4] * len(slots)  # every proposal
                for result in completion.lane_results():
                    assert list(result.tokens) == reference[result.slot][1:5]
    (kv_packed, history_packed), (kv_single, history_single) = kept
    assert float((kv_packed - kv_single).abs().max()) < 1e-5 and kv_packed.abs().sum() > 0
    assert torch.equal(history_packed, history_single)
