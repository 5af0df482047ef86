"""State programs on a CPU rank worker (issue 14, protocol 7): RESTORE and
SNAPSHOT frames run no forward.  A restore row binds a new generation to pages
another one filled: decode-ready at ``len(tokens) - 1`` (its pending token is
the record's last), the decodes that follow sample exactly what the
uninterrupted request does (greedy, and seeded sampling with penalties and
``min_tokens``); prefill-ready below it, the chunks that follow recompute the
rest.  Terminal rows drop their slots.  Every state frame completes with one
lane per row, no tokens and a positive device interval."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.deploy.launch import spawn_ranks, stop_ranks
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.checked_frame import FrameError
from runtime.ranks.model import load_model
from runtime.ranks.proposals import ProposerConfig
from runtime.ranks.worker import RankWorker
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.completion import Completion
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams
from tests.support.checkpoints import greedy, write_tiny
from tests.support.rank_messages import collect
from tests.support.rank_state import PENALIZED, changed, snapshot

PAGE = 16
PROMPT = [(7 * i + 3) % 120 + 2 for i in range(40)]  # 40 tokens: pages of 16, 16 and 8
EMITTED, TOTAL = 5, 12  # A stops after 5 outputs; the uninterrupted request makes 12
PREFILL = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
DECODE = GraphDescriptor(GraphKind.DECODE, 1)
RESTORE = GraphDescriptor(GraphKind.RESTORE, 2)
SNAPSHOT = GraphDescriptor(GraphKind.SNAPSHOT, 2)
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-state")
    write_tiny("llama", path, seed=31)
    return path


def make_worker(path, **kwargs) -> RankWorker:
    capacity = CapacityConfig(max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=64)
    return RankWorker(load_model(path), capacity, num_pages=40, page_size=PAGE, **kwargs)


class Run:
    """Frames to one worker, as the coordinator builds them."""

    def __init__(self, worker: RankWorker) -> None:
        self.w = worker
        self.fence = 0

    def frame(self, program, lanes, release=(), copies=()) -> Frame:
        self.fence += 1
        return Frame.from_lanes(self.fence, program, lanes, release_slots=release, copies=copies)

    def send(self, program, lanes, release=(), copies=()) -> Completion:
        done = self.w.execute(self.frame(program, lanes, release, copies))
        assert done.error is None
        return done

    def prefill(self, slot, tokens, start, chunks, pages, sampling, generation=1) -> list[int]:
        """Known (or fresh, from 0) prefill of ``tokens[start:]`` in ``chunks``; the
        last commits: its token."""
        at, out = start, []
        for k, size in enumerate(chunks):
            last = at + size == len(tokens)
            lane = FrameLane(slot, generation, "prefill", at, tuple(tokens[at : at + size]), at,
                             pages if k == 0 else (), int(last), sampling)  # fmt: skip
            out = list(self.send(PREFILL, [lane]).lane_results()[0].tokens)
            at += size
        assert at == len(tokens)
        return out

    def decode(self, slot, position, count, spare=(), generation=1) -> list[int]:
        """``count`` decodes from ``position`` (the pending token's); a lane whose
        context passes its pages appends the next page of ``spare``."""
        out, spare = [], list(spare)
        held = int(self.w.slots.page_count[slot])
        for _ in range(count):
            pages = ()
            if position + 1 > held * PAGE:
                pages, held = (spare.pop(0),), held + 1
            lane = FrameLane(slot, generation, "decode", 0, (), position, pages, 1)
            out += self.send(DECODE, [lane]).lane_results()[0].tokens
            position += 1
        return out

    def request(self, slot, pages, sampling, new) -> list[int]:
        """A fresh request over ``PROMPT`` making ``new`` tokens (pages hold them all)."""
        out = self.prefill(slot, PROMPT, 0, (len(PROMPT),), pages, sampling)
        return out + self.decode(slot, len(PROMPT), new - 1)


def restore_row(slot, record, position, pages, sampling, generation=1) -> FrameLane:
    return FrameLane(slot, generation, "state", position, (), position, pages, 0, sampling, record)


def terminal_row(slot, generation=1, position=0) -> FrameLane:
    return FrameLane(slot, generation, "state", position, (), position, (), 0)


def check_state_completion(done: Completion, lanes: int) -> None:
    assert done.error is None and done.num_lanes == lanes
    assert list(done.token_count) == [0] * lanes and len(done.tokens) == 0
    assert list(done.finished) == [0] * lanes
    assert all(result.tokens == () for result in done.lane_results())
    assert done.device_ns > 0


@pytest.mark.parametrize("sampling", [GREEDY, PENALIZED], ids=["greedy", "penalized"])
def test_a_decode_ready_restore_goes_on_as_the_uninterrupted_request(checkpoint, sampling):
    w = make_worker(checkpoint)
    r = Run(w)
    whole = r.request(3, (20, 21, 22, 23), sampling, TOTAL)
    # A: the same request in slot 0, stopped after 5 outputs: its pages hold KV
    # for positions 0..43; its pending token (output 5) sits at position 44.
    first = r.request(0, (0, 1, 2, 3), sampling, EMITTED)
    assert first == whole[:EMITTED]
    tokens = tuple(PROMPT + first)
    record = Restore(tokens, len(PROMPT))
    position = len(tokens) - 1
    held = [w.model.kv_cache.pages()[:, :, p].clone() for p in range(4)]
    # One RESTORE frame: B attaches A's two full pages and a private copy of the
    # partly used third; A's own row is terminal (its slot dropped).
    lanes = [restore_row(1, record, position, (0, 1, 12), sampling), terminal_row(0)]
    done = r.send(RESTORE, lanes, copies=((2, 12),))
    check_state_completion(done, 2)
    assert not w.slots.holds(0) and w.slots.holds(1)
    assert int(w.slots.next_position[1]) == position and int(w.slots.pending[1]) == 1
    assert int(w.slots.step[1]) == EMITTED
    assert int(w.arena.pending[1]) == tokens[-1] and int(w.arena.next_pos[1]) == position
    assert int(w.arena.steps[1]) == EMITTED
    rest = r.decode(1, position, TOTAL - EMITTED, spare=(13,))
    assert rest == whole[EMITTED:]
    # A's pages are untouched; the restored slot's step and penalty rows are the
    # uninterrupted one's.
    for p in range(4):
        assert torch.equal(w.model.kv_cache.pages()[:, :, p], held[p])
    assert int(w.slots.step[1]) == int(w.slots.step[3]) == TOTAL
    penalties = w.outputs.penalties  # kept only for slots that need the full sampler
    if sampling is PENALIZED:
        assert torch.equal(penalties.counts[1], penalties.counts[3])
        assert torch.equal(penalties.prompt_mask[1], penalties.prompt_mask[3])
    # A's generation is gone: a decode for it is refused, nothing changed.
    before = snapshot(w)
    with pytest.raises(FrameError, match="no state"):
        w.execute(r.frame(DECODE, [FrameLane(0, 1, "decode", 0, (), 45, (), 1)]))
    assert changed(before, snapshot(w)) == []


@pytest.mark.parametrize(
    ("position", "chunks", "pages", "copies"),
    [(32, (8, 5), (0, 1, 12), ()), (36, (4, 3, 2), (0, 1, 12), ((2, 12),)), (0, (45,), (8,), ())],
    ids=["page-boundary", "copied-page", "from-zero"],
)
def test_a_prefill_ready_restore_recomputes_the_rest(checkpoint, position, chunks, pages, copies):
    w = make_worker(checkpoint)
    r = Run(w)
    whole = r.request(3, (20, 21, 22, 23), PENALIZED, TOTAL)
    first = r.request(0, (0, 1, 2, 3), PENALIZED, EMITTED)
    tokens = PROMPT + first
    record = Restore(tuple(tokens), len(PROMPT))
    pages = pages if position else (8,)
    done = r.send(RESTORE, [restore_row(1, record, position, pages, PENALIZED)], copies=copies)
    check_state_completion(done, 1)
    assert int(w.slots.pending[1]) == 0 and int(w.slots.next_position[1]) == position
    # A chunk that does not continue the record is refused, nothing changed.
    bad = list(tokens[position : position + chunks[0]])
    bad[-1] = (bad[-1] + 1) % w.vocab
    before = snapshot(w)
    more = (13,) if position == 0 else ()
    with pytest.raises(FrameError, match="continues a restore"):
        lane = FrameLane(1, 1, "prefill", position, tuple(bad), position, more, 0, PENALIZED)
        w.execute(r.frame(PREFILL, [lane]))
    assert changed(before, snapshot(w)) == []
    # A decode before the prefill is done is refused (no pending token).
    with pytest.raises(FrameError, match="no pending token"):
        w.execute(r.frame(DECODE, [FrameLane(1, 1, "decode", 0, (), position, (), 1)]))
    # The rest recomputed in chunks: the last commits output 6.
    if position == 0:  # 45 tokens from zero need a fourth page past page 8
        lane = FrameLane(1, 1, "prefill", 0, tuple(tokens), 0, (13, 14), 1, PENALIZED)
        out = list(r.send(PREFILL, [lane]).lane_results()[0].tokens)
    else:
        out = r.prefill(1, tokens, position, chunks, (), PENALIZED)
    assert out == whole[EMITTED : EMITTED + 1]
    assert 1 not in w.slots.records  # the record's end was reached
    spare = (15, 16) if position == 0 else (13,)
    out += r.decode(1, len(tokens), TOTAL - EMITTED - 1, spare=spare)
    assert out == whole[EMITTED:]
    penalties = w.outputs.penalties
    assert torch.equal(penalties.counts[1], penalties.counts[3])


def test_snapshot_frames_drop_their_terminal_rows(checkpoint):
    w = make_worker(checkpoint)
    r = Run(w)
    r.request(0, (0, 1, 2, 3), GREEDY, 2)
    r.request(1, (4, 5, 6, 7), PENALIZED, 2)
    # A terminal row for a generation the rank does not hold is refused.
    before = snapshot(w)
    with pytest.raises(FrameError, match="lane 1: terminal row"):
        w.execute(r.frame(SNAPSHOT, [terminal_row(0), terminal_row(1, generation=2)]))
    assert changed(before, snapshot(w)) == []
    done = r.send(SNAPSHOT, [terminal_row(0, position=41), terminal_row(1, position=41)])
    check_state_completion(done, 2)
    assert list(done.slot) == [0, 1] and list(done.generation) == [1, 1]
    assert not w.slots.holds(0) and not w.slots.holds(1)
    for slot in (0, 1):
        with pytest.raises(FrameError, match="no state"):
            w.execute(r.frame(DECODE, [FrameLane(slot, 1, "decode", 0, (), 41, (), 1)]))
    # An empty snapshot frame (a release) is answered too.
    assert w.execute(Frame(r.fence + 1, SNAPSHOT)).error is None
    # The slot is free for a new request.
    r.request(0, (8, 9, 10), GREEDY, 1)


def test_refused_restore_rows_change_nothing(checkpoint):
    w = make_worker(checkpoint)
    r = Run(w)
    first = r.request(0, (0, 1, 2, 3), GREEDY, EMITTED)
    tokens = tuple(PROMPT + first)
    record = Restore(tokens, len(PROMPT))
    end = len(tokens) - 1

    def refused(lanes, copies=(), match=None) -> str:
        before = snapshot(w)
        with pytest.raises(FrameError, match=match) as raised:
            w.execute(r.frame(RESTORE, lanes, copies=copies))
        assert changed(before, snapshot(w)) == []
        return str(raised.value)

    # Past len(tokens) - 1: the last token is pending or still to prefill.
    assert "lane 0" in refused([restore_row(1, record, end + 1, (0, 1, 2), GREEDY)])
    # Pages that cannot hold the positions.
    assert "lane 0" in refused([restore_row(1, record, end, (0, 1), GREEDY)])
    # A restore for a generation the rank holds.
    refused([restore_row(0, record, end, (8, 9, 10), GREEDY)], match="not new")
    # A new generation without a record in a RESTORE program.
    refused([terminal_row(2)], match="no state")
    # Record tokens outside the vocabulary; copies outside the pool.
    wide = Restore((*tokens[:-1], w.vocab), len(PROMPT))
    refused([restore_row(1, wide, end, (0, 1, 12), GREEDY)], match="vocabulary")
    refused([restore_row(1, record, end, (0, 1, 12), GREEDY)], copies=((2, 99),), match="99")
    # A program the rank does not have.
    before = snapshot(w)
    with pytest.raises(ValueError, match="unknown"):
        program = GraphDescriptor(GraphKind.RESTORE, 64)
        w.execute(r.frame(program, [restore_row(1, record, end, (0, 1, 12), GREEDY)]))
    assert changed(before, snapshot(w)) == []


def test_the_catalog_lists_state_programs_per_decode_batch(checkpoint):
    w = make_worker(checkpoint, check_ranks=True)
    kinds = [(d.kind, d.batch_capacity) for d in w.report().descriptors]
    for kind in (GraphKind.RESTORE, GraphKind.SNAPSHOT):
        assert [b for k, b in kinds if k is kind] == [1, 2, 4]
    for d in w.report().descriptors:
        if d.kind in (GraphKind.RESTORE, GraphKind.SNAPSHOT):
            assert (d.token_capacity, d.prompt_capacity, d.target_capacity) == (
                1,
                0,
                d.batch_capacity,
            )
    assert not any(key[0] in ("restore", "snapshot") for key in w.programs)
    # --check-ranks: a state frame's CRC is that of no tokens.
    r = Run(w)
    r.request(0, (0, 1, 2, 3), GREEDY, 1)
    done = r.send(GraphDescriptor(GraphKind.SNAPSHOT, 1), [terminal_row(0)])
    assert done.token_crc == zlib.crc32(b"")
    assert done.stage_ns[4] >= done.device_ns > 0  # the wait stage counts the interval


# ---------------------------------------------------------------- speculation


@pytest.mark.parametrize("proposer", ["draft", "copy"])
def test_a_decode_ready_restore_feeds_speculation_like_the_original(checkpoint, proposer):
    capacity = CapacityConfig(
        max_concurrency=2, min_prefill_tokens=64, max_prefill_tokens=64, speculative_widths=(4,)
    )
    w = RankWorker(
        load_model(checkpoint),
        capacity,
        num_pages=40,
        page_size=PAGE,
        draft_model=load_model(checkpoint) if proposer == "draft" else None,
        proposer=ProposerConfig(proposer),
    )
    r = Run(w)
    prompt = (PROMPT[:12] * 4)[:40]  # repetitive: copy proposals find matches
    round_program = GraphDescriptor(GraphKind.SPECULATIVE, 1, 4, 3)

    def rounds(slot, position, count):
        tokens, counts = [], []
        for _ in range(count):
            lane = FrameLane(slot, 1, "decode", 0, (), position, (), 4)
            got = r.send(round_program, [lane]).lane_results()[0].tokens
            tokens += got
            counts.append(len(got))
            position += len(got)
        return tokens, counts

    first = r.prefill(0, prompt, 0, (40,), (0, 1, 2, 3), GREEDY)
    first += r.decode(0, 40, 2)  # positions 40, 41 hold KV; output 3 pending at 42
    tokens = tuple(prompt + first)
    fresh, fresh_counts = rounds(0, len(tokens) - 1, 4)
    # Slot 1: the state after output 3, over A's pages (page 2 copied: A's rounds
    # wrote past position 42 since, which slot 1's rounds overwrite before reading).
    record = Restore(tokens, len(prompt))
    row = restore_row(1, record, len(tokens) - 1, (0, 1, 12, 13), GREEDY)
    done = r.send(RESTORE, [row], copies=((2, 12),))
    check_state_completion(done, 1)
    hist = w.arena.history
    assert hist is not None and hist[1, : len(tokens)].tolist() == list(tokens)
    restored, restored_counts = rounds(1, len(tokens) - 1, 4)
    assert restored == fresh and restored_counts == fresh_counts
    if proposer == "draft":  # the draft is the target: every proposal accepted
        assert restored_counts == [4] * 4
    else:
        assert max(restored_counts) > 1


# ---------------------------------------------------------------- two rank processes


@pytest.mark.process
def test_two_ranks_restore_and_retire(tmp_path):
    """TP=2 over gloo: a request stopped after 5 tokens, restored decode-ready in
    another slot from its pages (one copied) while its own row retires, goes on
    with transformers' greedy tokens; the ranks agree (``--check-ranks``)."""
    model_dir = tmp_path / "model"
    expected = greedy(write_tiny("llama", model_dir, seed=31), [PROMPT], TOTAL)[0]
    world = 2
    channel = CoordinatorChannel(world)
    args = [
        "--model", str(model_dir), "--max-concurrency", "2", "--max-prefill-tokens", "64",
        "--num-pages", "16", "--device", "cpu", "--check-ranks",
    ]  # fmt: skip
    procs = spawn_ranks(
        channel.endpoints, world, args, env=dict(os.environ, FLARE_HOME=str(tmp_path))
    )
    fence = 0

    def run(program, lanes, copies=()) -> Completion:
        nonlocal fence
        fence += 1
        channel.publish(Frame.from_lanes(fence, program, lanes, copies=copies))
        zero, one = collect(channel, Completion, world)
        assert zero.error is None and one.error is None, (zero.error, one.error)
        assert zero.token_crc == one.token_crc >= 0
        assert zero.device_ns > 0 and one.device_ns > 0
        return zero

    def decode(slot, position, count, pages=()) -> list[int]:
        out = []
        for i in range(count):
            lane = FrameLane(slot, 1, "decode", 0, (), position + i, pages if i == 0 else (), 1)
            out += run(DECODE, [lane]).lane_results()[0].tokens
        return out

    try:
        channel.handshake(timeout_s=120.0)
        reports = collect(channel, CatalogReport, world, 120_000)
        kinds = {d.kind for d in reports[0].descriptors}
        assert {GraphKind.RESTORE, GraphKind.SNAPSHOT} <= kinds
        lane = FrameLane(0, 1, "prefill", 0, tuple(PROMPT), 0, (0, 1, 2), 1, GREEDY)
        first = list(run(PREFILL, [lane]).lane_results()[0].tokens)
        first += decode(0, len(PROMPT), EMITTED - 1)
        assert first == expected[:EMITTED]
        tokens = tuple(PROMPT + first)
        lanes = [restore_row(1, Restore(tokens, 40), 44, (0, 1, 8), GREEDY), terminal_row(0)]
        done = run(RESTORE, lanes, copies=((2, 8),))
        assert list(done.token_count) == [0, 0]
        assert first + decode(1, 44, TOTAL - EMITTED, pages=(9,)) == expected
        channel.shutdown_ranks()
        assert stop_ranks(procs, timeout_s=60) == [0] * world
    finally:
        stop_ranks(procs, timeout_s=0)
        channel.close()


def test_state_lanes_numpy_columns_are_int64(checkpoint):
    """The checked state frame's columns are what apply_state indexes with."""
    w = make_worker(checkpoint)
    frame = Frame.from_lanes(1, SNAPSHOT, [])
    assert w.execute(frame).num_lanes == 0
    checked = w.slots.check_state(
        Frame.from_lanes(2, RESTORE, [restore_row(0, Restore((5, 6), 2), 1, (0,), GREEDY)]), w.vocab
    )
    assert checked.slot.dtype == np.int64 and checked.query_len.tolist() == [0]
    assert checked.step.tolist() == [0] and checked.starts.tolist() == [True]


def test_a_restored_prefill_lane_keeps_its_record_for_the_next_chunks(checkpoint):
    """The protocol 6 path too: a restored prefill lane that stops short of its
    record's end leaves the record, and the next chunk must continue it."""
    w = make_worker(checkpoint)
    r = Run(w)
    tokens = PROMPT[:30]
    record = Restore(tuple(tokens), 20)  # 10 outputs already emitted
    lane = FrameLane(0, 1, "prefill", 0, tuple(tokens[:16]), 0, (0, 1), 0, GREEDY, record)
    r.send(PREFILL, [lane])
    assert w.slots.records[0] == record
    bad = [*tokens[16:29], (tokens[29] + 1) % w.vocab]
    before = snapshot(w)
    with pytest.raises(FrameError, match="position 29"):
        w.execute(r.frame(PREFILL, [FrameLane(0, 1, "prefill", 16, tuple(bad), 16, (), 1, GREEDY)]))
    assert changed(before, snapshot(w)) == []
    # Running past the record (which ends with output) is refused too.
    with pytest.raises(FrameError, match="runs past"):
        more = (*tokens[16:], 5)
        w.execute(r.frame(PREFILL, [FrameLane(0, 1, "prefill", 16, more, 16, (), 1, GREEDY)]))
    r.prefill(0, tokens, 16, (14,), (), GREEDY)
    assert 0 not in w.slots.records and int(w.slots.step[0]) == 11
