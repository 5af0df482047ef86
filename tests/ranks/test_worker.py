"""The rank worker: frames in, completions out, against transformers' greedy tokens."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.checked_frame import FrameError
from runtime.ranks.launch import Launch
from runtime.ranks.model import load_model
from runtime.ranks.shapes import VARIANTS, ProgramError
from runtime.ranks.worker import STAGES, RankWorker
from runtime.transport.codec import decode, encode
from runtime.transport.completion import Completion
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import tensor_to_torch
from tests.support.checkpoints import greedy, write_tiny
from tests.support.rank_state import changed, record_forwards, slot_row, snapshot

PAGE = 16
PAGES_PER_SLOT = 8  # 128 tokens per request
PROMPTS = [[5, 17, 33, 3, 60], [9, 9, 9, 41, 77, 12, 3, 50, 21], [88], list(range(3, 103))]
BOUNDARY = list(range(40, 56))  # one full page: its first decode needs a second
NEW = 6
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = write_tiny("llama", path, seed=11)
    return path, greedy(model, PROMPTS, NEW)


@pytest.fixture(scope="module")
def boundary(checkpoint):
    """transformers' greedy tokens for BOUNDARY and for its first 14 tokens."""
    path, _ = checkpoint
    return greedy(hf_model(path), [BOUNDARY, BOUNDARY[:14]], NEW)


def make_worker(path) -> RankWorker:
    model = load_model(path)
    capacity = CapacityConfig(max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=128)
    return RankWorker(model, capacity, num_pages=4 * PAGES_PER_SLOT, page_size=PAGE)


def pages(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))


def prefill_program(tokens: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64 if tokens <= 64 else 128)


class Driver:
    """Builds well-formed frames the way the coordinator does: a request's page
    table goes on its first prefill lane, later chunks and decode lanes append
    none unless told to.

    ``split``: run each frame as ``start`` then ``finish`` and keep the variant
    each ran (else ``execute``).
    """

    def __init__(self, worker: RankWorker, split: bool = False) -> None:
        self.w = worker
        self.split = split
        self.fence = 0
        self.position: dict[int, int] = {}
        self.last: Completion | None = None  # the latest completion
        self.variants: list[str] = []  # split: each frame's sampling variant
        self.steady: list[bool] = []  # split: whether it took the steady decode path

    def send(self, program, lanes: list[FrameLane], release=()) -> list[tuple[int, ...]]:
        self.fence += 1
        frame = Frame.from_lanes(self.fence, program, lanes, release_slots=release)
        if self.split:
            launch = self.w.start(frame)
            assert isinstance(launch, Launch) and launch.checked.frame is frame
            self.variants.append(launch.variant)
            self.steady.append(launch.checked.steady)
            completion = self.w.finish(launch)
        else:
            completion = self.w.execute(frame)
            assert set(self.w.stages[-1]) == set(STAGES)
        assert completion.device_ns > 0 and completion.rank == 0 and completion.error is None
        assert list(completion.slot) == [lane.slot for lane in lanes]
        assert list(completion.token_count) == [lane.commits for lane in lanes]
        self.last = completion
        return [result.tokens for result in completion.lane_results()]

    def prefill(self, slot, generation, prompt, chunk=128, sampling=GREEDY, appends=None):
        """``chunk``: a chunk length, or the list of them; ``appends``: the pages
        each chunk appends (default: the slot's whole table on the first)."""
        sizes = [chunk] * -(-len(prompt) // chunk) if isinstance(chunk, int) else list(chunk)
        appends = appends or [pages(slot)] + [()] * (len(sizes) - 1)
        assert len(appends) == len(sizes) and sum(sizes) >= len(prompt)
        out, start = None, 0
        for size, appended in zip(sizes, appends):
            piece = prompt[start : start + size]
            last = start + len(piece) == len(prompt)
            lane = FrameLane(slot, generation, "prefill", start, tuple(piece), start,
                             tuple(appended), 1 if last else 0, sampling)  # fmt: skip
            out = self.send(prefill_program(len(piece)), [lane])[0]
            start += len(piece)
        self.position[slot] = len(prompt)
        return out

    def decode(self, lanes: list[tuple[int, int]], batch: int, appends=None):
        appends = appends or {}
        frame_lanes = [
            FrameLane(s, g, "decode", 0, (), self.position[s], tuple(appends.get(s, ())), 1)
            for s, g in lanes
        ]
        out = self.send(GraphDescriptor(GraphKind.DECODE, batch), frame_lanes)
        for s, _ in lanes:
            self.position[s] += 1
        return out

    def release(self, *slots: int) -> Completion:
        self.fence += 1
        empty = Frame(self.fence, GraphDescriptor(GraphKind.DECODE, 1), release_slots=slots)
        return self.w.execute(empty)


def test_greedy_tokens_equal_transformers_one_request_at_a_time(checkpoint):
    path, greedy = checkpoint
    d = Driver(make_worker(path))
    for i, prompt in enumerate(PROMPTS):
        slot = 0
        tokens = list(d.prefill(slot, i + 1, prompt))
        for _ in range(NEW - 1):
            tokens += d.decode([(slot, i + 1)], 1)[0]
        assert tokens == greedy[i], i


def test_batched_and_chunked_requests_give_the_same_tokens(checkpoint):
    path, greedy = checkpoint
    d = Driver(make_worker(path))
    outs = {s: list(d.prefill(s, 1, PROMPTS[s], chunk=64)) for s in range(4)}
    for _ in range(NEW - 1):
        # All four share a batch-4 program; two frames back to back as if queued.
        results = d.decode([(s, 1) for s in range(4)], 4)
        for s, toks in enumerate(results):
            outs[s] += toks
    assert [outs[s] for s in range(4)] == greedy
    # Padding rows: three requests in the batch-4 program.
    d2 = Driver(make_worker(path))
    outs = {s: list(d2.prefill(s, 1, PROMPTS[s])) for s in range(3)}
    for _ in range(NEW - 1):
        for s, toks in enumerate(d2.decode([(s, 1) for s in range(3)], 4)):
            outs[s] += toks
    assert [outs[s] for s in range(3)] == greedy[:3]


def test_seeded_sampling_is_batch_invariant(checkpoint):
    path, _ = checkpoint
    sampling = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1000 + s) for s in range(3)
    ]

    def run(slots, sampling=sampling):
        d = Driver(make_worker(path))
        outs = {s: list(d.prefill(s, 1, PROMPTS[s], sampling=sampling[s])) for s in slots}
        for _ in range(NEW - 1):
            for s, toks in zip(slots, d.decode([(s, 1) for s in slots], 4)):
                outs[s] += toks
        return outs

    together = run([0, 1, 2])
    for s in range(3):
        assert run([s])[s] == together[s]
    # Asking for log probabilities, or min_tokens=0, does not perturb sampling,
    # whether every lane asks or only some do.
    for extra in [{"logprobs": 5}, {"logprobs": 0, "min_tokens": 0}, {"logprobs": 20}]:
        asked = [replace(p, **extra) if s != 1 else p for s, p in enumerate(sampling)]
        assert run([0, 1, 2], asked) == together, extra
        assert run([0], asked)[0] == together[0], extra


# ---------------------------------------------------------------- refused frames


def decode_lane(slot, generation, position, appended=()) -> FrameLane:
    return FrameLane(slot, generation, "decode", 0, (), position, tuple(appended), 1)


def prefill_lane(slot, generation, start, tokens, appended, commits=1) -> FrameLane:
    return FrameLane(slot, generation, "prefill", start, tuple(tokens), start, tuple(appended),
                     commits, GREEDY)  # fmt: skip


DECODE1, DECODE2 = GraphDescriptor(GraphKind.DECODE, 1), GraphDescriptor(GraphKind.DECODE, 2)
PREFILL64 = prefill_program(64)
# Every frame below is well formed (the schema accepts it) but does not fit the
# rank's state after the setup of the test that uses them: slot 0 holds
# generation 1 of PROMPTS[0] at position 5 with pages(0); slot 1 generation 1
# of BOUNDARY at position 16 with one page (page 8); slot 2 holds nothing.
REFUSED = {
    "no state": (DECODE1, [decode_lane(2, 1, 0)], "no state"),
    "unknown generation": (DECODE1, [decode_lane(0, 2, 5)], "no state"),
    "decode at a wrong position": (DECODE1, [decode_lane(0, 1, 7)], "slot 0 is at 5"),
    "prefill at a wrong position": (
        PREFILL64, [prefill_lane(0, 1, 4, [1, 2], ())], "slot 0 is at 5"
    ),
    "new tenant not at 0": (PREFILL64, [prefill_lane(2, 1, 3, [1, 2], pages(2))], "start at 0"),
    "a page out of range": (
        PREFILL64, [prefill_lane(2, 1, 0, [1, 2], (4 * PAGES_PER_SLOT,))], "outside the rank's"
    ),
    "a decode appending a page out of range": (
        DECODE1, [decode_lane(1, 1, 16, (99,))], "outside the rank's"
    ),
    "a prompt longer than its pages": (
        PREFILL64, [prefill_lane(2, 1, 0, range(20), (16,))], "needs a context of 20"
    ),
    "a decode past its last page": (DECODE1, [decode_lane(1, 1, 16)], "needs a context of 17"),
    "more pages than a request may hold": (
        PREFILL64, [prefill_lane(2, 1, 0, [1], range(15, 32))], "at most 16"
    ),
    "one bad lane beside a good one": (
        DECODE2, [decode_lane(0, 1, 5), decode_lane(1, 1, 16)], "lane 1: slot 1"
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def refusing(checkpoint, boundary):
    """A driver whose worker is in the state REFUSED assumes."""
    path, greedy = checkpoint
    d = Driver(make_worker(path))
    first = d.prefill(0, 1, PROMPTS[0])
    assert list(first) == greedy[0][:1]
    assert list(d.prefill(1, 1, BOUNDARY, appends=[(8,)])) == boundary[0][:1]
    return d


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_a_refused_frame_changes_neither_the_slot_table_nor_the_device_rows(refusing, case):
    d = refusing
    program, lanes, reason = REFUSED[case]
    before = snapshot(d.w)
    d.fence += 1
    with pytest.raises(FrameError, match=reason):
        d.w.execute(Frame.from_lanes(d.fence, program, lanes))
    assert changed(before, snapshot(d.w)) == []


def test_a_prompt_token_outside_the_vocabulary_is_refused_with_nothing_changed(checkpoint):
    path, _ = checkpoint
    w = make_worker(path)
    before = snapshot(w)
    lane = prefill_lane(2, 1, 0, [5, w.vocab], pages(2))
    with pytest.raises(FrameError, match="vocabulary"):
        w.execute(Frame.from_lanes(99, PREFILL64, [lane]))
    assert changed(before, snapshot(w)) == []


def test_refused_frames_leave_requests_to_continue_unchanged(checkpoint, boundary):
    path, greedy = checkpoint
    d = Driver(make_worker(path))
    first = d.prefill(0, 1, PROMPTS[0])
    d.prefill(1, 1, BOUNDARY, appends=[(8,)])
    before = snapshot(d.w)
    rows = slot_row(d.w, 0), slot_row(d.w, 1)
    for program, lanes, reason in REFUSED.values():
        with pytest.raises(FrameError, match=reason):
            d.w.execute(Frame.from_lanes(99, program, lanes))
    unknown = GraphDescriptor(GraphKind.DECODE, 16)
    with pytest.raises(ProgramError, match="unknown"):
        d.w.execute(Frame.from_lanes(99, unknown, [decode_lane(0, 1, 5)]))
    assert changed(before, snapshot(d.w)) == []
    assert (slot_row(d.w, 0), slot_row(d.w, 1)) == rows and not d.w.slots.holds(2)
    # Both requests go on as if nothing had been sent; slot 1 appends its second
    # page with the decode that crosses into it.
    tokens = {0: list(first), 1: list(boundary[0][:1])}
    for step in range(NEW - 1):
        appends = {1: (9,)} if step == 0 else {}
        for s, toks in enumerate(d.decode([(0, 1), (1, 1)], 2, appends)):
            tokens[s] += toks
    assert tokens == {0: greedy[0], 1: boundary[0]}


def test_frames_that_break_the_steady_decode_path_are_refused_with_nothing_changed(
    checkpoint, boundary
):
    """A decode frame continuing the last one's lanes is checked against what
    that frame left (the steady path); one that does not continue it, or runs
    past a lane's pages, is checked in full and refused."""
    path, greedy = checkpoint
    d = Driver(make_worker(path), split=True)
    short = BOUNDARY[:14]  # one page: its third decode needs a second
    tokens = {0: list(d.prefill(0, 1, PROMPTS[0])), 1: list(d.prefill(1, 1, short, appends=[(8,)]))}

    def decode(appends=None):
        for s, toks in enumerate(d.decode([(0, 1), (1, 1)], 2, appends)):
            tokens[s] += toks

    decode()
    decode()  # positions 6 and 15: the steady path
    assert d.steady == [False, False, False, True]
    before = snapshot(d.w)
    for lanes, reason in [
        ([decode_lane(0, 1, 7), decode_lane(1, 1, 16)], "lane 1: slot 1 needs a context of 17"),
        ([decode_lane(0, 1, 6), decode_lane(1, 1, 15)], "decode at position 6, slot 0 is at 7"),
        ([decode_lane(0, 1, 8), decode_lane(1, 1, 16)], "decode at position 8, slot 0 is at 7"),
        ([decode_lane(0, 1, 7), decode_lane(1, 2, 16)], "lane 1: decode for slot 1 generation 2"),
        ([decode_lane(1, 1, 16), decode_lane(0, 1, 7)], "lane 0: slot 1 needs a context of 17"),
    ]:
        with pytest.raises(FrameError, match=reason):
            d.w.execute(Frame.from_lanes(99, DECODE2, lanes))
        assert changed(before, snapshot(d.w)) == []
    decode({1: (9,)})  # slot 1 appends its second page: checked in full
    decode()
    decode()  # steady again
    assert d.steady[4:] == [False, False, True]
    assert tokens == {0: greedy[0], 1: boundary[1]}


def test_slot_reuse_with_a_new_generation_starts_fresh(checkpoint):
    path, greedy = checkpoint
    d = Driver(make_worker(path))
    d.prefill(0, 1, PROMPTS[1])
    d.decode([(0, 1)], 1)
    tokens = list(d.prefill(0, 2, PROMPTS[0]))  # the slot's next tenant
    for _ in range(NEW - 1):
        tokens += d.decode([(0, 2)], 1)[0]
    assert tokens == greedy[0]


def test_a_released_slot_reused_by_a_new_generation_sees_none_of_the_old_state(checkpoint):
    """The old tenant's pending token, settings (host columns and device rows) and
    penalty state are gone for the new generation, released first or not."""
    path, greedy = checkpoint
    old = SamplingParams(temperature=1.3, top_p=0.8, top_k=20, seed=5, min_tokens=3,
                         repetition_penalty=1.5, frequency_penalty=0.5,
                         logit_bias=((greedy[0][0], -50.0), (7, 3.0)), logprobs=4)  # fmt: skip
    for released in (True, False):
        w = make_worker(path)
        d = Driver(w, split=True)
        unused = snapshot(w)  # slot 5 is never used: its rows are the defaults
        d.prefill(0, 1, PROMPTS[1], sampling=old)
        d.decode([(0, 1)], 1)
        assert d.variants == ["logprobs", "logprobs"]
        if released:
            d.release(0)
            assert not w.slots.holds(0)
        # Generation 2 is greedy. Its first chunk commits no token, so the slot
        # has no pending token yet: the old tenant's is not there to decode from.
        d.send(PREFILL64, [prefill_lane(0, 2, 0, PROMPTS[0][:3], pages(0), commits=0)])
        assert slot_row(w, 0) == {
            "generation": 2, "next_position": 3, "pending": 0, "page_count": PAGES_PER_SLOT,
            "full": 0, "logprobs": -1, "step": 0, "settings": GREEDY,
        }  # fmt: skip
        before = snapshot(w)
        with pytest.raises(FrameError, match="slot 0 has no pending token"):
            d.w.execute(Frame.from_lanes(99, DECODE1, [decode_lane(0, 2, 3)]))
        assert changed(before, snapshot(w)) == []
        for name in ("arena.floats", "arena.ints", "arena.bias_ids", "arena.bias_values"):
            assert torch.equal(before[name][0], unused[name][5]), name
        tokens = list(d.send(PREFILL64, [prefill_lane(0, 2, 3, PROMPTS[0][3:], ())])[0])
        d.position[0] = len(PROMPTS[0])
        for _ in range(NEW - 1):
            tokens += d.decode([(0, 2)], 1)[0]
        assert tokens == greedy[0], released
        assert d.variants[2:] == ["argmax"] * (NEW + 1)  # no old full sampler or logprobs
        assert int(w.arena.pending[0]) == tokens[-1]
        # Generation 3 runs the full sampler (it asks for log probabilities) over
        # the slot's device rows and penalty state: still greedy's tokens.
        d.variants.clear()
        tokens = list(d.prefill(0, 3, PROMPTS[0], sampling=SamplingParams(logprobs=0)))
        for _ in range(NEW - 1):
            tokens += d.decode([(0, 3)], 1)[0]
            assert d.last.sidecars["logprobs"].shape == (1, 1)
        assert tokens == greedy[0] and d.variants == ["logprobs"] * NEW
        counts = w.outputs.penalties.counts[0].tolist()
        assert {t: c for t, c in enumerate(counts) if c} == Counter(tokens)
        mask = w.outputs.penalties.prompt_mask[0].nonzero().flatten().tolist()
        assert mask == sorted(set(PROMPTS[0]))


# ---------------------------------------------------------------- appended pages

TABLE = (21, 13, 17, 9, 30, 12, 25)  # PROMPTS[3] and NEW tokens: 105 tokens, 7 pages


@pytest.mark.parametrize(
    ("chunks", "appends"),
    [
        ([16, 84], [TABLE, ()]),  # the whole table up front
        ([16, 84], [TABLE[:1], TABLE[1:]]),  # one page, then the rest
        ([16, 48, 36], [TABLE[:1], TABLE[1:4], TABLE[4:]]),
        ([64, 36], [TABLE[:4], TABLE[4:]]),
    ],
    ids=["up-front", "1+6", "1+3+3", "4+3"],
)
def test_pages_appended_across_prefill_chunks_give_the_whole_tables_tokens(
    checkpoint, chunks, appends
):
    path, greedy = checkpoint
    w = make_worker(path)
    d = Driver(w)
    d.prefill(0, 1, PROMPTS[0])  # a neighbour whose table must stay as it is
    tokens = list(d.prefill(1, 1, PROMPTS[3], chunk=chunks, appends=appends))
    assert int(w.slots.page_count[1]) == len(TABLE)
    assert w.arena.page_tables[1, : len(TABLE)].tolist() == list(TABLE)
    for _ in range(NEW - 1):
        tokens += d.decode([(1, 1)], 1)[0]
    assert tokens == greedy[3]
    assert w.arena.page_tables[0, :PAGES_PER_SLOT].tolist() == list(pages(0))


def test_a_decode_lane_appends_the_page_it_crosses_into(checkpoint, boundary):
    path, _ = checkpoint
    w = make_worker(path)
    d = Driver(w)
    tokens = list(d.prefill(2, 1, BOUNDARY, appends=[(30,)]))  # exactly one page
    tokens += d.decode([(2, 1)], 1, appends={2: (4,)})[0]  # position 16: page 4
    for _ in range(NEW - 2):
        tokens += d.decode([(2, 1)], 1)[0]
    assert tokens == boundary[0]
    assert w.arena.page_tables[2, :2].tolist() == [30, 4] and int(w.slots.page_count[2]) == 2


# ---------------------------------------------------------------- sampling variants


def test_the_variant_follows_the_lanes_and_greedy_lanes_ignore_it(checkpoint):
    """All-greedy frames run "argmax", a seeded temperature lane "sample", a lane
    asking for log probabilities "logprobs"; a greedy lane batched with each
    gets the same tokens, and a sampled lane the same in "sample" and "logprobs"."""
    path, greedy = checkpoint
    hot = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    neighbours = {
        "argmax": SamplingParams(),
        "sample": hot,
        "logprobs": SamplingParams(logprobs=2),  # greedy, asking for log probabilities
        "sampled logprobs": replace(hot, logprobs=2),
    }
    tokens = {}
    for name, params in neighbours.items():
        d = Driver(make_worker(path), split=True)
        outs = {
            0: list(d.prefill(0, 1, PROMPTS[0])),
            1: list(d.prefill(1, 1, PROMPTS[1], sampling=params)),
        }
        for _ in range(NEW - 1):
            for s, toks in enumerate(d.decode([(0, 1), (1, 1)], 2)):
                outs[s] += toks
        variant = name.split()[-1]
        assert variant in VARIANTS
        assert d.variants == ["argmax"] + [variant] * NEW, name
        assert outs[0] == greedy[0], name  # the greedy lane, whatever the variant
        tokens[name] = outs[1]
    assert tokens["argmax"] == tokens["logprobs"] == greedy[1]
    assert tokens["sample"] == tokens["sampled logprobs"] != greedy[1]


def test_report_describes_the_catalog(checkpoint):
    path, _ = checkpoint
    w = make_worker(path)
    report = w.report()
    assert report.vocab_size == 128 and report.max_context == 256
    assert report.page_size == PAGE and report.num_pages == 4 * PAGES_PER_SLOT
    kinds = sorted((d.kind.value, d.batch_capacity, d.prompt_capacity) for d in report.descriptors)
    assert kinds == [
        ("decode", 1, 0),
        ("decode", 2, 0),
        ("decode", 4, 0),
        ("prefill", 1, 64),
        ("prefill", 1, 128),
        ("restore", 1, 0),
        ("restore", 2, 0),
        ("restore", 4, 0),
        ("snapshot", 1, 0),
        ("snapshot", 2, 0),
        ("snapshot", 4, 0),
    ]


def test_empty_frame_runs_nothing_but_applies_its_releases(checkpoint):
    path, _ = checkpoint
    d = Driver(make_worker(path))
    d.prefill(0, 1, PROMPTS[0])
    d.prefill(1, 1, PROMPTS[2])
    runs = d.w.frames
    kept = slot_row(d.w, 1)
    completion = d.release(0)
    assert completion.fence == d.fence and completion.device_ns == 0
    assert completion.num_lanes == 0 and completion.lane_results() == ()
    assert d.w.frames == runs  # no program ran
    assert not d.w.slots.holds(0) and slot_row(d.w, 1) == kept
    assert d.w.slots.settings[0] is None
    with pytest.raises(FrameError, match="no state"):
        d.decode([(0, 1)], 1)  # slot 0 was released
    d.decode([(1, 1)], 1)  # slot 1 is untouched
    d.fence += 1
    bogus = Frame(d.fence, GraphDescriptor(GraphKind.DECODE, 64))
    with pytest.raises(ProgramError, match="unknown"):
        d.w.execute(bogus)  # an empty frame still names a prepared program


# ---------------------------------------------------------------- min_tokens and logprobs


def hf_model(path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path).eval()


def hf_logprobs(model, prompt, generated) -> torch.Tensor:
    """float32 log_softmax of transformers' logits predicting each of ``generated``."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(generated)])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)], dim=-1)


def reference_min_tokens(model, prompt, eos, min_tokens, limit):
    """transformers greedy with the EOS ids barred for the first ``min_tokens`` tokens."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for step in range(limit):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            if step < min_tokens:
                logits[sorted(eos)] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in eos:
                break
    return out


@pytest.fixture(scope="module")
def eos_first(tmp_path_factory):
    """A checkpoint whose EOS ids are PROMPTS[2]'s greedy first token and the last id."""
    path = tmp_path_factory.mktemp("llama-eos")
    model = write_tiny("llama", path, seed=11)
    first = greedy(model, [PROMPTS[2]], 1)[0][0]
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = [first, config["vocab_size"] - 1]
    (path / "config.json").write_text(json.dumps(config))
    return path, model, frozenset(config["eos_token_id"]), first


def finish_reason(d: Driver) -> str | None:
    return d.last.lane_results()[0].finish_reason


def generate_until_stop(d: Driver, slot, generation, prompt, sampling, limit):
    tokens = list(d.prefill(slot, generation, prompt, sampling=sampling))
    reasons = [finish_reason(d)]
    while reasons[-1] is None and len(tokens) < limit:
        tokens += d.decode([(slot, generation)], 1)[0]
        reasons.append(finish_reason(d))
    return tokens, reasons


def test_min_tokens_bars_eos_until_enough_tokens(eos_first):
    path, model, eos, first = eos_first
    worker = make_worker(path)
    assert set(np.flatnonzero(worker.is_eos).tolist()) == eos and first in eos
    d = Driver(worker)
    limit = 10
    stopped_after_min = False
    for generation, n in enumerate([0, 1, 2, 3, 7], start=1):
        sampling = SamplingParams(min_tokens=n)
        tokens, reasons = generate_until_stop(d, 0, generation, PROMPTS[2], sampling, limit)
        assert tokens == reference_min_tokens(model, PROMPTS[2], eos, n, limit), n
        # No EOS (and no "stop") among the first n tokens; the request gets them all.
        assert len(tokens) > n and not eos & set(tokens[:n])
        assert all(r is None for r in reasons[:-1]) and all(r is None for r in reasons[:n])
        if n == 0:
            assert tokens == [first] and reasons == ["stop"]  # greedy's first token is EOS
        elif reasons[-1] == "stop":
            assert tokens[-1] in eos and len(tokens) > n
            stopped_after_min = True
    # Once min_tokens is reached the EOS ids are allowed again.
    assert stopped_after_min


def test_min_tokens_holds_for_sampled_requests_and_decode_batches(eos_first):
    path, _, eos, _ = eos_first
    d = Driver(make_worker(path))
    n = 5
    hot = SamplingParams(temperature=1.5, seed=3, min_tokens=n)
    prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[0]]
    params = [SamplingParams(min_tokens=n), hot, replace(hot, seed=4)]
    outs = {s: list(d.prefill(s, 1, prompts[s], sampling=params[s])) for s in range(3)}
    for _ in range(n - 1):
        for s, toks in enumerate(d.decode([(s, 1) for s in range(3)], 4)):
            outs[s] += toks
        assert all(lane.finish_reason is None for lane in d.last.lane_results())
        assert list(d.last.finished) == [0, 0, 0]
    for s in range(3):
        assert len(outs[s]) == n and not eos & set(outs[s]), s


def test_logprobs_match_transformers_for_greedy_requests(checkpoint):
    path, greedy_tokens = checkpoint
    model = hf_model(path)
    d = Driver(make_worker(path))
    asked = [3, -1, 20]
    outs: dict[int, list[int]] = {}
    rows: dict[int, list[tuple[list[float], list[int]]]] = {s: [] for s in range(3)}

    def collect(slots):
        values = tensor_to_torch(d.last.sidecars["logprobs"])
        ids = tensor_to_torch(d.last.sidecars["logprob_token_ids"])
        k = max(asked[s] for s in slots)
        assert values.dtype == torch.float32 and values.shape == (len(slots), 1 + k)
        assert ids.dtype == torch.int32 and ids.shape == (len(slots), k)
        for row, s in enumerate(slots):
            rows[s].append((values[row].tolist(), ids[row].tolist()))

    for s in range(3):
        outs[s] = list(d.prefill(s, 1, PROMPTS[s], sampling=SamplingParams(logprobs=asked[s])))
        if asked[s] >= 0:
            collect([s])
        else:  # nobody in this frame asked: no sidecars at all
            assert d.last.sidecars == {}
    for _ in range(NEW - 1):
        for s, toks in enumerate(d.decode([(s, 1) for s in range(3)], 4)):
            outs[s] += toks
        collect([0, 1, 2])
    assert [outs[s] for s in range(3)] == greedy_tokens[:3]  # logprobs change no token
    for s in (0, 2):
        k = asked[s]
        reference = hf_logprobs(model, PROMPTS[s], outs[s])  # (NEW, V)
        for j, (values, ids) in enumerate(rows[s]):
            token = outs[s][j]
            # Greedy: the sampled token is the top-1, with the same log probability.
            assert ids[0] == token and values[0] == values[1], (s, j)
            assert abs(values[0] - float(reference[j, token])) < 1e-4, (s, j)
            top = reference[j].topk(k)
            assert ids[:k] == top.indices.tolist(), (s, j)
            assert torch.allclose(torch.tensor(values[1 : 1 + k]), top.values, atol=1e-4)
            assert values[1 : 1 + k] == sorted(values[1 : 1 + k], reverse=True)


def test_logprobs_are_raw_and_sidecars_follow_the_frame(checkpoint):
    path, _ = checkpoint
    model = hf_model(path)
    d = Driver(make_worker(path))
    # A tempered, filtered request: its log probabilities ignore temperature and top-k.
    hot = SamplingParams(temperature=1.7, top_k=5, seed=9, logprobs=0)
    tokens = list(d.prefill(0, 1, PROMPTS[0], sampling=hot))
    values = [tensor_to_torch(d.last.sidecars["logprobs"])[0, 0].item()]
    assert d.last.sidecars["logprobs"].shape == (1, 1)
    assert d.last.sidecars["logprob_token_ids"].shape == (1, 0)
    for _ in range(4):
        tokens += d.decode([(0, 1)], 1)[0]
        values.append(tensor_to_torch(d.last.sidecars["logprobs"])[0, 0].item())
    reference = hf_logprobs(model, PROMPTS[0], tokens)
    expected = [float(reference[j, t]) for j, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(values, expected)) < 1e-4
    # A prefill chunk that commits no token still has its row.
    lane = FrameLane(1, 1, "prefill", 0, tuple(PROMPTS[3][:64]), 0, pages(1), 0,
                     SamplingParams(logprobs=2))  # fmt: skip
    d.fence += 1
    completion = d.w.execute(Frame.from_lanes(d.fence, PREFILL64, [lane]))
    assert completion.lane_results()[0].tokens == ()
    assert completion.sidecars["logprobs"].shape == (1, 3)
    assert completion.sidecars["logprob_token_ids"].shape == (1, 2)
    # Sidecars travel through the codec unchanged.
    assert decode(encode(completion)) == completion
    # A frame where no lane asks carries none, even after frames that did.
    d2 = Driver(d.w)
    d2.fence = d.fence
    d2.prefill(2, 1, PROMPTS[2])
    assert d2.last.sidecars == {}


# ---------------------------------------------------------------- padding


def test_padding_binds_the_whole_page_table_width_and_writes_no_slot(checkpoint):
    """What capture binds: every lane padding (scratch rows), the whole page-table
    width, no KV written and no slot's rows touched, in every variant; an eager
    frame reads only its own lanes and the page-table columns its longest lane
    needs."""
    path, _ = checkpoint
    w = make_worker(path)
    d = Driver(w)
    d.prefill(0, 1, PROMPTS[0], sampling=SamplingParams(repetition_penalty=1.3))
    forwards = record_forwards(w)
    program = w.programs[DECODE4.key]
    before = snapshot(w)
    program._pad()
    x = program.inputs
    scratch = w.arena.scratch
    assert (x.state_row == scratch).all() and (x.count_row == scratch).all()
    assert (x.query_lens == 0).all() and (x.from_pending == 0).all()
    for variant in VARIANTS:
        program._body(variant, program.max_pages)
        meta = forwards[-1]["meta"]
        assert meta.page_tables.shape == (4, program.max_pages)
        assert (meta.page_tables == -1).all() and (meta.slot_mapping == -1).all()
        assert (meta.query_lens == 0).all() and (meta.context_lens == 0).all()
    assert changed(before, snapshot(w)) == []
    forwards.clear()
    rest = [t for _ in range(NEW - 1) for t in d.decode([(0, 1)], 4)[0]]
    # An eager frame runs its own lanes (one of the four rows).
    assert [meta["meta"].page_tables.shape for meta in forwards] == [(1, 1)] * (NEW - 1)
    d.prefill(1, 1, PROMPTS[3], chunk=64)  # 64 then 100 tokens: 4 then 7 columns
    assert [meta["meta"].page_tables.shape[1] for meta in forwards[NEW - 1 :]] == [4, 7]
    assert len(rest) == NEW - 1


DECODE4 = GraphDescriptor(GraphKind.DECODE, 4)


def test_padding_a_prompt_program_writes_no_slot(checkpoint):
    path, _ = checkpoint
    w = make_worker(path)
    Driver(w).prefill(0, 1, PROMPTS[0], sampling=SamplingParams(repetition_penalty=1.3))
    program = w.programs[PREFILL64.key]
    before = snapshot(w)
    program._pad()
    for variant in VARIANTS:
        program._body(variant, program.max_pages)
    assert changed(before, snapshot(w)) == []
