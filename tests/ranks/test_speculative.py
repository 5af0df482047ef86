"""Complete speculative programs on a CPU rank worker (runtime/ranks/speculative.py):
greedy rounds give exactly greedy decoding's tokens for draft and copy proposals,
exact and device-allocated programs; a draft that is the target accepts every
proposal, also after a stretch of width-one programs (the draft context is
kept) and under penalties and sampling (p and q see the same per-position
state); frames queued behind a round continue from its actual end; the
sidecars are probabilities of the documented shapes; log probabilities come
per emitted token."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import load_model
from runtime.ranks.proposals import ProposerConfig, copy_proposals
from runtime.ranks.worker import RankWorker
from runtime.transport.completion import Completion
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams
from tests.support.checkpoints import greedy, write_tiny

PAGE = 16
PAGES_PER_SLOT = 8
PROMPTS = [[5, 17, 33, 3, 60, 5, 17, 33, 3, 60, 5, 17], [9, 9, 9, 41, 77, 12, 3, 50, 21]]
NEW = 24
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tmp_path_factory.mktemp("target")
    other = tmp_path_factory.mktemp("draft")
    hf = write_tiny("llama", target, seed=11)
    write_tiny("llama", other, seed=12)
    return target, other, greedy(hf, PROMPTS, NEW)


def make_worker(target, draft, proposer: str, widths=(4,), device=False) -> RankWorker:
    capacity = CapacityConfig(
        max_concurrency=2,
        min_prefill_tokens=64,
        max_prefill_tokens=64,
        speculative_widths=widths,
        device_allocation=device,
    )
    return RankWorker(
        load_model(target),
        capacity,
        num_pages=2 * PAGES_PER_SLOT,
        page_size=PAGE,
        draft_model=None if draft is None else load_model(draft),
        proposer=ProposerConfig(proposer),
    )


class Rounds:
    """Drives a worker as the coordinator would: prompts, then rounds."""

    def __init__(self, worker: RankWorker, sampling=GREEDY) -> None:
        self.w = worker
        self.fence = 0
        self.out: dict[int, list[int]] = {}
        self.position: dict[int, int] = {}  # tokens held: the pending one is at position - 1
        self.sampling = sampling
        self.completions: list[Completion] = []
        self.rounds: list[tuple[dict[int, int], Completion]] = []

    def run(self, program: GraphDescriptor, lanes: list[FrameLane]) -> Completion:
        self.fence += 1
        completion = self.w.execute(Frame.from_lanes(self.fence, program, lanes))
        assert completion.error is None, completion.error
        self.completions.append(completion)
        for result in completion.lane_results():
            self.out.setdefault(result.slot, []).extend(result.tokens)
            self.position[result.slot] = self.position.get(result.slot, 0) + len(result.tokens)
        return completion

    def prefill(self, prompts) -> None:
        for slot, prompt in enumerate(prompts):
            table = tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))
            lane = FrameLane(slot, 1, "prefill", 0, tuple(prompt), 0, table, 1, self.sampling)
            self.run(GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64), [lane])
            self.position[slot] = len(prompt) + 1  # the prompt and the pending token

    def round(self, program: GraphDescriptor, queries: dict[int, int]) -> Completion:
        lanes = [
            FrameLane(s, 1, "decode", 0, (), self.position[s] - 1, (), q)
            for s, q in queries.items()
        ]
        completion = self.run(program, lanes)
        self.rounds.append((queries, completion))
        return completion

    def decode(self, slots) -> Completion:
        lanes = [FrameLane(s, 1, "decode", 0, (), self.position[s] - 1, (), 1) for s in slots]
        return self.run(GraphDescriptor(GraphKind.DECODE, len(slots)), lanes)


def speculative(b: int, w: int, device: bool = False) -> GraphDescriptor:
    p = b * w // 2 if device else 0
    return GraphDescriptor(GraphKind.SPECULATIVE, b, w, w - 1, p, device_allocated=device)


def remaining(r: Rounds, slot: int, w: int) -> int:
    return max(1, min(w, NEW - len(r.out[slot])))


@pytest.mark.parametrize(
    ("proposer", "same", "device"),
    [("copy", False, False), ("draft", True, False), ("draft", False, False),
     ("draft", True, True), ("copy", False, True)],
)  # fmt: skip
def test_greedy_rounds_give_greedy_decodings_tokens(models, proposer, same, device):
    target, other, reference = models
    draft = None if proposer == "copy" else (target if same else other)
    worker = make_worker(target, draft, proposer, device=device)
    r = Rounds(worker)
    r.prefill(PROMPTS)
    program = speculative(2, 4, device)
    for i in range(40):
        if min(len(v) for v in r.out.values()) >= NEW:
            break
        if i % 3 == 2:  # width-one programs between rounds
            r.decode([0, 1])
        else:  # exact lengths differ per lane (device-allocated: ceilings)
            r.round(program, {0: remaining(r, 0, 4), 1: remaining(r, 1, 3)})
    for slot in (0, 1):
        assert r.out[slot][:NEW] == reference[slot]
    counts = [c for done in r.completions for c in done.token_count]
    if proposer == "draft" and same and not device:  # a draft that is the target
        for queries, completion in r.rounds:  # every offered proposal accepted
            assert list(completion.token_count) == list(queries.values())
    assert max(counts) > 1 or (proposer == "draft" and not same)  # some round accepted


def test_a_draft_equal_to_the_target_accepts_everything_after_width_one_stretches(models):
    target, _, reference = models
    r = Rounds(make_worker(target, target, "draft"))
    r.prefill(PROMPTS)
    program = speculative(2, 4)
    for _ in range(3):  # a stretch of ordinary decode: the draft is fed too
        r.decode([0, 1])
    for _ in range(4):
        completion = r.round(program, {0: 4, 1: 4})
        assert list(completion.token_count) == [4, 4]  # every proposal accepted
        r.decode([0, 1])
    for slot in (0, 1):
        assert r.out[slot] == reference[slot][: len(r.out[slot])]


def test_sampled_rounds_with_penalties_accept_a_draft_equal_to_the_target(models):
    """p and q see the same per-position penalty counts, step and filters, so a
    draft that is the target is accepted (up to float rounding between the
    draft's one-token steps and the target's packed forward)."""
    target, _, _ = models
    sampling = SamplingParams(
        temperature=0.8, top_p=0.95, top_k=50, seed=7, frequency_penalty=0.5,
        presence_penalty=0.3, repetition_penalty=1.2, min_tokens=30,
    )  # fmt: skip
    r = Rounds(make_worker(target, target, "draft"), sampling)
    r.prefill(PROMPTS)
    offered = accepted = 0
    for _ in range(6):
        completion = r.round(speculative(2, 4), {0: 4, 1: 4})
        offered += 6
        accepted += sum(completion.token_count) - 2
        survival = completion.sidecars["survival"].values()
        assert all(0.0 <= v <= 1.0 for v in survival)
    assert accepted >= 0.9 * offered
    eos = worker_eos(r.w)
    assert not eos.intersection(t for v in r.out.values() for t in v)  # min_tokens holds


def worker_eos(worker: RankWorker) -> set[int]:
    return {int(i) for i in np.nonzero(worker.is_eos)[0]}


def test_seeded_sampled_rounds_repeat_and_a_random_draft_keeps_tokens_valid(models):
    target, other, _ = models
    sampling = SamplingParams(temperature=1.0, seed=3)
    outs = []
    for _ in range(2):
        r = Rounds(make_worker(target, other, "draft"), sampling)
        r.prefill(PROMPTS)
        for _ in range(5):
            r.round(speculative(2, 4), {0: 4, 1: 2})
        outs.append(dict(r.out))
        assert all(0 <= t < 128 for v in r.out.values() for t in v)
    assert outs[0] == outs[1]


def test_frames_queued_behind_a_round_continue_from_its_end(models):
    """The coordinator builds the next frame before it hears of a round, with the
    round's bound as the position; the rank continues from the round's end."""
    target, _, reference = models
    r = Rounds(make_worker(target, None, "copy"))
    r.prefill(PROMPTS)
    before = dict(r.position)
    completion = r.round(speculative(2, 4), {0: 4, 1: 4})
    # A frame built with the bound (position + 4), as if the round had emitted 4.
    lanes = [FrameLane(s, 1, "decode", 0, (), before[s] + 4 - 1, (), 1) for s in (0, 1)]
    r.run(GraphDescriptor(GraphKind.DECODE, 2), lanes)
    assert min(completion.token_count) < 4  # the bound was not reached
    for slot in (0, 1):
        assert r.out[slot] == reference[slot][: len(r.out[slot])]
    # A position beyond the bound is still refused, naming the range.
    bad = [FrameLane(0, 1, "decode", 0, (), r.position[0] + 10, (), 1)]
    r.fence += 1
    with pytest.raises(Exception, match="slot 0 is at"):
        r.w.execute(Frame.from_lanes(r.fence, GraphDescriptor(GraphKind.DECODE, 1), bad))


def test_sidecars_and_log_probabilities_of_a_round(models):
    target, _, _ = models
    worker = make_worker(target, target, "draft", device=True)
    r = Rounds(worker, SamplingParams(logprobs=3))
    r.prefill(PROMPTS)
    completion = r.round(speculative(2, 4, device=True), {0: 4, 1: 4})
    conf = completion.sidecars["confidence"]
    assert conf.dtype == "float32" and tuple(conf.shape) == (2, 2, 3)
    values = torch.tensor(conf.values()).view(2, 2, 3)
    assert torch.allclose(values[1], torch.cumprod(values[0], dim=1))
    assert ((values >= 0) & (values <= 1)).all()
    assert tuple(completion.sidecars["survival"].shape) == (2, 3)
    # P = 4 rows for two lanes: the allocation used at most 4 (accepted + 1 each).
    assert sum(completion.token_count) <= 4
    emitted = sum(completion.token_count)
    assert tuple(completion.sidecars["logprobs"].shape) == (emitted, 4)
    assert tuple(completion.sidecars["logprob_token_ids"].shape) == (emitted, 3)
    logprobs = completion.sidecars["logprobs"].values()
    assert all(v <= 0 and math.isfinite(v) for v in logprobs)
    # The sampled (greedy) token is the most likely one: its logprob is the top one.
    for row in range(emitted):
        assert logprobs[row * 4] == pytest.approx(logprobs[row * 4 + 1], abs=1e-5)


def test_copy_proposals_take_the_longest_latest_match_with_a_full_continuation():
    history = torch.tensor(
        [
            [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 1, 2, 3, 0, 0],  # "1 2 3" ends at 12
            [4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # runs of one token
            [8, 6, 5, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # nothing repeats
        ]
    )
    end = torch.tensor([12, 5, 4])
    out = copy_proposals(history, end, depth=3, n_min=2, n_max=4)
    # Lane 0: "1 2 3" occurred at 0-2 (followed by 4 5 9) and 6-8 (followed by 7 1 2):
    # the latest with three known tokens after it wins.
    assert out[0].tolist() == [7, 1, 2]
    assert out[1].tolist() == [4, 4, 4]
    assert out[2].tolist() == [-1, -1, -1]


@pytest.mark.parametrize("proposer", ["copy", "draft"])
def test_wide_mixed_programs_verify_beside_a_prompt_chunk(models, proposer):
    """A wide mixed program (B, W > 1, C): one prompt row and verifying decoders in
    one forward; every token equals greedy decoding's."""
    target, _, reference = models
    capacity = CapacityConfig(
        max_concurrency=2, min_prefill_tokens=64, max_prefill_tokens=64,
        mixed_prefill=True, speculative_widths=(4,),
    )  # fmt: skip
    worker = RankWorker(
        load_model(target), capacity, num_pages=2 * PAGES_PER_SLOT, page_size=PAGE,
        draft_model=load_model(target) if proposer == "draft" else None,
        proposer=ProposerConfig(proposer),
    )  # fmt: skip
    wide = GraphDescriptor(GraphKind.MIXED, 2, 4, 3, prompt_capacity=64)
    assert wide in worker.catalog
    r = Rounds(worker)
    r.prefill(PROMPTS[:1])
    # Slot 1's prompt in two chunks beside slot 0's rounds: the first commits nothing.
    table = tuple(range(PAGES_PER_SLOT, 2 * PAGES_PER_SLOT))
    chunks = [(0, PROMPTS[1][:5], table, 0), (5, PROMPTS[1][5:], (), 1)]
    for start, piece, pages, commits in chunks:
        lanes = [
            FrameLane(0, 1, "decode", 0, (), r.position[0] - 1, (), 4),
            FrameLane(1, 1, "prefill", start, tuple(piece), start, pages, commits, GREEDY),
        ]
        r.fence += 1
        done = worker.execute(Frame.from_lanes(r.fence, wide, lanes, prompt_row=1))
        assert done.error is None, done.error
        counts = list(done.token_count)
        assert counts[1] == commits and 1 <= counts[0] <= 4
        if proposer == "draft":  # the draft is the target: all accepted
            assert counts[0] == 4
        for result in done.lane_results():
            r.out.setdefault(result.slot, []).extend(result.tokens)
        r.position[0] += counts[0]
    r.position[1] = len(PROMPTS[1]) + 1
    while min(len(v) for v in r.out.values()) < NEW:
        r.round(speculative(2, 4), {0: remaining(r, 0, 4), 1: remaining(r, 1, 4)})
    for slot in (0, 1):
        assert r.out[slot][:NEW] == reference[slot]
