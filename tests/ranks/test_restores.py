"""Prefix attach, copy-on-write pages and preemption resume on a CPU rank worker
(issue 14): a request that attaches another's pages (a partial page copied
into a private one) and prefills only the suffix under a restore record
samples what a fresh request does; a preempted request restored from its
prompt and emitted tokens goes on exactly as the uninterrupted run, seeded
sampling, ``min_tokens`` and penalties included; mismatching records and bad
copies are refused with nothing changed; with speculation the draft's cache
is copied too and the slot's history is restored (copy proposals accept as
for a fresh request)."""

from __future__ import annotations

import os

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
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import tensor_to_torch
from tests.support.checkpoints import greedy, write_tiny
from tests.support.rank_messages import collect
from tests.support.rank_state import PENALIZED, changed, snapshot

PAGE = 16
PROMPT = [(7 * i + 3) % 120 + 2 for i in range(40)]  # 40 tokens: pages of 16, 16 and 8
NEW = 6
PREFILL = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
DECODE = GraphDescriptor(GraphKind.DECODE, 1)
GREEDY = SamplingParams(logprobs=20)
SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=5, logprobs=20)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-restore")
    write_tiny("llama", path, seed=31)
    return path


def make_worker(path, mixed: bool = False) -> RankWorker:
    capacity = CapacityConfig(
        max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=64, mixed_prefill=mixed
    )
    return RankWorker(load_model(path), capacity, num_pages=32, page_size=PAGE)


class Run:
    """Frames to one worker, as the coordinator builds them."""

    def __init__(self, worker: RankWorker) -> None:
        self.w = worker
        self.fence = 0

    def frame(self, program, lanes, release=(), copies=(), prompt_row=-1) -> Frame:
        self.fence += 1
        return Frame.from_lanes(
            self.fence, program, lanes, prompt_row, release_slots=release, copies=copies
        )

    def send(self, program, lanes, release=(), copies=(), prompt_row=-1) -> Completion:
        done = self.w.execute(self.frame(program, lanes, release, copies, prompt_row))
        assert done.error is None
        return done

    def generate(
        self,
        slot: int,
        tokens: list[int],
        pages: tuple[int, ...],
        sampling: SamplingParams,
        new: int,
        *,
        start: int = 0,
        chunks: tuple[int, ...] | None = None,
        restore: Restore | None = None,
        copies=(),
        generation: int = 1,
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Prefill ``tokens[start:]`` (in ``chunks``; the first brings the pages,
        the copies and the record), then decode: ``new`` tokens and each one's
        log probability row (when asked)."""
        out, rows = [], []
        chunks = chunks or (len(tokens) - start,)
        assert sum(chunks) == len(tokens) - start
        at = start
        for k, size in enumerate(chunks):
            last = at + size == len(tokens)
            lane = FrameLane(slot, generation, "prefill", at, tuple(tokens[at : at + size]), at,
                             pages if k == 0 else (), int(last), sampling,
                             restore if k == 0 else None)  # fmt: skip
            done = self.send(PREFILL, [lane], copies=copies if k == 0 else ())
            at += size
        position = len(tokens)
        for i in range(new):
            if i:
                lane = FrameLane(slot, generation, "decode", 0, (), position, (), 1)
                done = self.send(DECODE, [lane])
                position += 1
            out += done.lane_results()[0].tokens
            if "logprobs" in done.sidecars:
                rows.append(tensor_to_torch(done.sidecars["logprobs"])[0])
        return out, rows


def page_kv(w: RankWorker, page: int) -> torch.Tensor:
    return w.model.kv_cache.pages()[:, :, page].clone()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_attached_prefix_samples_what_a_fresh_request_does(checkpoint, sampling):
    w = make_worker(checkpoint)
    r = Run(w)
    # A: the whole prompt in pages 0..3 (page 2 holds positions 32..39, then A's output).
    reference, ref_rows = r.generate(0, PROMPT, (0, 1, 2, 3), sampling, NEW)
    assert len(reference) == NEW and len(ref_rows) == NEW
    held = [page_kv(w, p) for p in range(4)]
    record = Restore(tuple(PROMPT), len(PROMPT))
    # B: A's two full pages (32 tokens), fresh pages after them; only the suffix is fed.
    b, b_rows = r.generate(1, PROMPT, (0, 1, 8, 9), sampling, NEW, start=32, restore=record)
    assert b == reference
    for got, want in zip(b_rows, ref_rows):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # C: 36 tokens, the last 4 in a private copy of A's partly used page 2.
    copy = ((2, 12),)
    c, c_rows = r.generate(
        2, PROMPT, (0, 1, 12, 13), sampling, NEW, start=36, restore=record, copies=copy
    )
    assert c == reference
    for got, want in zip(c_rows, ref_rows):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # A's pages are untouched: B and C wrote only their own pages.
    for p in range(4):
        assert torch.equal(page_kv(w, p), held[p]), p
    # Without the copy, page 14 holds nothing for positions 32..35: D's first
    # distribution is not A's (the copy is what made C right).
    _, d_rows = r.generate(3, PROMPT, (0, 1, 14, 15), sampling, 1, start=36, restore=record)
    assert not torch.allclose(d_rows[0], ref_rows[0], atol=1e-3)


def test_copies_run_in_an_empty_frame_and_copy_every_layer_k_and_v(checkpoint):
    w = make_worker(checkpoint)
    r = Run(w)
    r.generate(0, PROMPT, (0, 1, 2, 3), GREEDY, 2)
    assert not torch.equal(page_kv(w, 1), page_kv(w, 20))
    before = page_kv(w, 1)
    empty = Frame(r.fence + 1, DECODE, copies=((1, 20), (2, 21)))
    done = w.execute(empty)
    assert done.error is None and done.num_lanes == 0
    assert torch.equal(page_kv(w, 20), before) and torch.equal(page_kv(w, 1), before)
    assert torch.equal(page_kv(w, 21), page_kv(w, 2))
    kv = w.model.kv_cache.pages()
    assert kv.shape[:2] == (w.model.config.num_hidden_layers, 2)  # every layer, K and V
    assert kv[:, :, 20].abs().sum(dim=(2, 3, 4)).min() > 0


@pytest.mark.parametrize(
    ("attach", "chunks"),
    [(0, (25,)), (0, (16, 9)), (16, (9,))],
    ids=["recompute-one-chunk", "recompute-two-chunks", "attach-one-page"],
)
def test_a_resumed_request_goes_on_as_the_uninterrupted_one(checkpoint, attach, chunks):
    prompt = PROMPT[:20]
    emitted, total = 5, 12
    w = make_worker(checkpoint)
    r = Run(w)
    whole, _ = r.generate(0, prompt, (0, 1), PENALIZED, total)
    # The same request in slot 1, preempted after 5 tokens (the slot released).
    first, _ = r.generate(1, prompt, (4, 5), PENALIZED, emitted)
    assert first == whole[:emitted]
    r.send(DECODE, [], release=(1,))
    # Resumed in slot 2: the prompt and its 5 outputs recomputed (or page 4 attached).
    known = prompt + first
    record = Restore(tuple(known), len(prompt))
    pages = (8, 9) if attach == 0 else (4, 9)
    rest, _ = r.generate(
        2, known, pages, PENALIZED, total - emitted, start=attach, chunks=chunks, restore=record
    )
    assert rest == whole[emitted:]
    # Its penalty counts and step are the uninterrupted slot's.
    penalties = w.outputs.penalties
    assert torch.equal(penalties.counts[2], penalties.counts[0])
    assert penalties.counts[2].sum() == total
    assert int(w.slots.step[2]) == int(w.slots.step[0]) == total
    seen = penalties.prompt_mask | (penalties.counts > 0)
    assert torch.equal(seen[2], seen[0])  # outputs fed as chunk tokens add nothing new


def test_a_restore_record_sets_the_step_and_the_penalty_rows_before_the_chunk(checkpoint):
    w = make_worker(checkpoint)
    r = Run(w)
    known = [*PROMPT[:10], 3, 3, 9]
    record = Restore(tuple(known), 10)
    (token,), _ = r.generate(0, known, (0,), PENALIZED, 1, chunks=(13,), restore=record)
    assert int(w.slots.step[0]) == 4  # 3 restored outputs, then the one the chunk committed
    penalties = w.outputs.penalties
    expected = torch.bincount(torch.tensor([3, 3, 9, token]), minlength=w.vocab)
    assert torch.equal(penalties.counts[0], expected.to(torch.int32))
    mask = torch.zeros(w.vocab, dtype=torch.bool)
    mask[known] = True  # the record's prompt, and the chunk's tokens (outputs included)
    assert torch.equal(penalties.prompt_mask[0], mask)


def test_refused_restores_and_copies_change_nothing(checkpoint):
    w = make_worker(checkpoint)
    r = Run(w)
    r.generate(0, PROMPT, (0, 1, 2, 3), GREEDY, 2)
    record = Restore(tuple(PROMPT), len(PROMPT))

    def refused(lanes, copies=(), program=PREFILL, prompt_row=-1) -> str:
        before = snapshot(w)
        with pytest.raises(FrameError) as raised:
            w.execute(r.frame(program, lanes, copies=copies, prompt_row=prompt_row))
        assert changed(before, snapshot(w)) == []
        return str(raised.value)

    def lane(chunk, start=32, restore=record, slot=1, generation=1, pages=(0, 1, 8)):
        return FrameLane(slot, generation, "prefill", start, tuple(chunk), start, pages, 1,
                         GREEDY, restore)  # fmt: skip

    bad = list(PROMPT[32:40])
    bad[3] += 1
    message = refused([lane(bad)])
    assert "lane 0" in message and "position 35" in message
    # Without a record, a new generation starts at 0.
    assert "lane 0" in refused([lane(PROMPT[32:40], restore=None)])
    # prompt_start must be the position.
    odd = FrameLane(1, 1, "prefill", 0, tuple(PROMPT[32:40]), 32, (0, 1, 8), 1, GREEDY, record)
    assert "prompt_start" in refused([odd])
    # Past the record's tokens.
    short = Restore(tuple(PROMPT[:30]), 30)
    assert "lane 0" in refused([lane(PROMPT[32:40], restore=short)])
    # A chunk past the record's tokens when they end with output.
    resumed = Restore(tuple(PROMPT[:36]), 30)
    assert "runs past" in refused([lane(PROMPT[32:40], restore=resumed)])
    # A record for a generation the rank already holds (slot 0 generation 1).
    known = FrameLane(0, 1, "prefill", 42, (5,), 42, (), 1, GREEDY, Restore((1,) * 42, 42))
    assert "not new" in refused([known])
    # Record tokens outside the vocabulary.
    vocab = w.vocab
    wide = Restore((*PROMPT[:31], vocab), 32)
    assert "vocabulary" in refused([lane(PROMPT[32:33], restore=wide)])
    # Copies outside the pool, in a frame and in an empty frame.
    assert "page 99" in refused([lane(PROMPT[32:40])], copies=((2, 99),))
    before = snapshot(w)
    with pytest.raises(FrameError, match="page 40"):
        w.execute(Frame(r.fence + 1, DECODE, copies=((40, 2),)))
    assert changed(before, snapshot(w)) == []
    # A duplicated destination never becomes a frame.
    with pytest.raises(ProtocolError) as raised:
        r.frame(PREFILL, [lane(PROMPT[32:40])], copies=((2, 12), (3, 12)))
    assert raised.value.field == "copies"


def test_mixed_frames_restore_their_prompt_row(checkpoint):
    """The multi-lane check: a decode lane beside a restored prompt row."""
    w = make_worker(checkpoint, mixed=True)
    r = Run(w)
    reference, _ = r.generate(0, PROMPT, (0, 1, 2, 3), GREEDY, NEW)
    record = Restore(tuple(PROMPT), len(PROMPT))
    mixed = GraphDescriptor(GraphKind.MIXED, 2, prompt_capacity=64)
    decoder = FrameLane(0, 1, "decode", 0, (), len(PROMPT) + NEW - 1, (), 1)
    bad = FrameLane(1, 1, "prefill", 36, (1, 2, 3, 4), 36, (0, 1, 12), 1, GREEDY, record)
    before = snapshot(w)
    with pytest.raises(FrameError, match="lane 1"):
        w.execute(r.frame(mixed, [decoder, bad], copies=((2, 12),), prompt_row=1))
    assert changed(before, snapshot(w)) == []
    good = FrameLane(1, 1, "prefill", 36, tuple(PROMPT[36:]), 36, (0, 1, 12), 1, GREEDY, record)
    done = r.send(mixed, [decoder, good], copies=((2, 12),), prompt_row=1)
    assert done.lane_results()[1].tokens == (reference[0],)


# ---------------------------------------------------------------- speculation


def spec_worker(path, proposer: str, draft: bool) -> RankWorker:
    capacity = CapacityConfig(
        max_concurrency=2, min_prefill_tokens=64, max_prefill_tokens=64, speculative_widths=(4,)
    )
    return RankWorker(
        load_model(path),
        capacity,
        num_pages=32,
        page_size=PAGE,
        draft_model=load_model(path) if draft else None,
        proposer=ProposerConfig(proposer),
    )


def rounds(r: Run, slot: int, position: int, count: int) -> tuple[list[int], list[int]]:
    """``count`` greedy rounds of up to 4 tokens from ``position`` (the pending
    token's): (the tokens, each round's accepted count)."""
    program = GraphDescriptor(GraphKind.SPECULATIVE, 1, 4, 3)
    tokens, counts = [], []
    for _ in range(count):
        done = r.send(program, [FrameLane(slot, 1, "decode", 0, (), position, (), 4)])
        got = done.lane_results()[0].tokens
        tokens += got
        counts.append(len(got))
        position += len(got)
    return tokens, counts


@pytest.mark.parametrize("proposer", ["draft", "copy"])
def test_restored_rows_feed_speculation_like_a_fresh_request(checkpoint, proposer):
    # A repetitive prompt: copy proposals find matches in the history.
    prompt = (PROMPT[:12] * 4)[:40]
    w = spec_worker(checkpoint, proposer, draft=proposer == "draft")
    r = Run(w)
    sampling = SamplingParams()
    first, _ = r.generate(0, prompt, (0, 1, 2, 3), sampling, 1)
    fresh, fresh_counts = rounds(r, 0, len(prompt), 5)
    record = Restore(tuple(prompt), len(prompt))
    again, _ = r.generate(
        1, prompt, (0, 1, 12, 13), sampling, 1, start=36, restore=record, copies=((2, 12),)
    )
    assert again == first
    restored, restored_counts = rounds(r, 1, len(prompt), 5)
    assert restored == fresh
    assert restored_counts == fresh_counts
    if proposer == "draft":  # the draft is the target: every proposal accepted
        assert restored_counts == [4] * 5
    else:
        assert max(restored_counts) > 1
        hist = w.arena.history
        assert hist is not None and hist[1, :40].tolist() == prompt


# ---------------------------------------------------------------- two rank processes


@pytest.mark.process
def test_two_ranks_attach_and_copy_their_own_shards(tmp_path):
    """TP=2 over gloo (each rank holds one of the two KV heads of every page): a
    request attaching another's pages with a copy-on-write page gets
    transformers' greedy tokens, and the ranks agree (``--check-ranks``)."""
    model_dir = tmp_path / "model"
    expected = greedy(write_tiny("llama", model_dir, seed=31), [PROMPT], NEW)[0]
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

    def run(lane: FrameLane, copies=()) -> tuple[int, ...]:
        nonlocal fence
        fence += 1
        program = PREFILL if lane.phase == "prefill" else DECODE
        channel.publish(Frame.from_lanes(fence, program, [lane], copies=copies))
        zero, one = collect(channel, Completion, world)
        assert zero.error is None and one.error is None, (zero.error, one.error)
        assert zero.token_crc == one.token_crc >= 0
        return zero.lane_results()[0].tokens

    def generate(slot, start, pages, restore=None, copies=()) -> list[int]:
        lane = FrameLane(slot, 1, "prefill", start, tuple(PROMPT[start:]), start, pages, 1,
                         SamplingParams(), restore)  # fmt: skip
        out = list(run(lane, copies))
        for i in range(NEW - 1):
            out += run(FrameLane(slot, 1, "decode", 0, (), len(PROMPT) + i, (), 1))
        return out

    try:
        channel.handshake(timeout_s=120.0)
        collect(channel, CatalogReport, world, 120_000)
        assert generate(0, 0, (0, 1, 2, 3)) == expected
        record = Restore(tuple(PROMPT), len(PROMPT))
        assert generate(1, 36, (0, 1, 8, 9), record, copies=((2, 8),)) == expected
        channel.shutdown_ranks()
        assert stop_ranks(procs, timeout_s=60) == [0] * world
    finally:
        stop_ranks(procs, timeout_s=0)
        channel.close()
