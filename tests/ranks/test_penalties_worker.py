"""Logit bias and penalties end to end through RankWorker frames.

The program keeps each slot's penalty state on the device (output-token counts,
prompt-token mask); greedy tokens follow the argmax of the adjusted logits,
checked against transformers' logits with the token-by-token reference applied,
and against transformers' ``generate(repetition_penalty=...)``; seeded lanes
are batch-invariant; lanes without adjustments are bitwise what they were;
mixed frames agree with separate frames.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import pytest
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.engine.startup import ModelFacts
from runtime.coordinator.engine.submission import check_submission
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.checked_frame import FrameError
from runtime.ranks.model import load_model
from runtime.ranks.worker import RankWorker
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import tensor_to_torch
from tests.support.checkpoints import write_tiny
from tests.support.penalty_reference import reference
from tests.support.rank_state import changed, snapshot

PAGE = 16
PAGES_PER_SLOT = 8  # 128 tokens per request
VOCAB = 128  # write_tiny's; EOS is 127
EOS = VOCAB - 1
PROMPTS = [
    [5, 17, 33, 3, 60, 17, 5],
    [9, 9, 9, 41, 77, 12, 3, 50, 21],
    [88, 88],
    list(range(3, 103)),  # two prefill chunks of 64
]
NEW = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-penalties")
    return path, write_tiny("llama", path, seed=23)


def make_worker(path, mixed: bool = False) -> RankWorker:
    capacity = CapacityConfig(
        max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=128, mixed_prefill=mixed
    )
    return RankWorker(load_model(path), capacity, num_pages=4 * PAGES_PER_SLOT, page_size=PAGE)


def pages(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))


def state_of(w: RankWorker):
    return w.outputs.penalties


class Driver:
    """Frames as the coordinator builds them; every slot's committed tokens."""

    runs: ClassVar[dict[int, int]] = {}  # per worker: the generations used so far

    def __init__(self, worker: RankWorker) -> None:
        self.w = worker
        self.fence = 0
        self.position: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.prompt: dict[int, list[int]] = {}
        self.sampling: dict[int, SamplingParams] = {}
        # Fresh generations on a reused worker: every driver starts above the last.
        base = Driver.runs[id(worker)] = Driver.runs.get(id(worker), 0) + 1000
        self.generation: dict[int, int] = dict.fromkeys(range(64), base)
        self.last = None

    def send(self, program: GraphDescriptor, lanes: list[FrameLane], prompt_row: int = -1):
        self.fence += 1
        frame = Frame.from_lanes(self.fence, program, lanes, prompt_row)
        completion = self.w.execute(frame)
        assert completion.error is None
        for lane, result in zip(lanes, completion.lane_results(), strict=True):
            self.tokens[lane.slot].extend(result.tokens)
        self.last = completion
        return completion

    def begin(self, slot: int, prompt: list[int], sampling: SamplingParams) -> None:
        self.generation[slot] += 1
        self.prompt[slot], self.sampling[slot], self.tokens[slot] = prompt, sampling, []
        self.position[slot] = 0

    def chunk(self, slot: int, end: int) -> FrameLane:
        start, prompt = self.position[slot], self.prompt[slot]
        self.position[slot] = end
        tokens, last = tuple(prompt[start:end]), int(end == len(prompt))
        generation = self.generation[slot]
        table = pages(slot) if start == 0 else ()  # the first chunk brings the table
        return FrameLane(slot, generation, "prefill", start, tokens, start, table, last,
                         self.sampling[slot])  # fmt: skip

    def prefill(self, slot: int, prompt: list[int], sampling: SamplingParams, chunk: int = 64):
        self.begin(slot, prompt, sampling)
        while self.position[slot] < len(prompt):
            lane = self.chunk(slot, min(self.position[slot] + chunk, len(prompt)))
            cap = 64 if len(lane.prompt_tokens) <= 64 else 128
            self.send(GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=cap), [lane])

    def decoders(self, slots: list[int]) -> list[FrameLane]:
        lanes = []
        for s in slots:
            lanes.append(FrameLane(s, self.generation[s], "decode", 0, (), self.position[s], (), 1))
            self.position[s] += 1
        return lanes

    def decode(self, slots: list[int], batch: int | None = None):
        batch = batch or next(b for b in (1, 2, 4) if b >= len(slots))
        return self.send(GraphDescriptor(GraphKind.DECODE, batch), self.decoders(slots))

    def mixed(self, chunk: FrameLane, slots: list[int]):
        lanes = self.decoders(slots)
        row = min(1, len(lanes))  # the prompt row is not lane 0 when there are decoders
        lanes.insert(row, chunk)
        batch = next(b for b in (2, 4) if b >= len(lanes))
        cap = 64 if len(chunk.prompt_tokens) <= 64 else 128
        program = GraphDescriptor(GraphKind.MIXED, batch, prompt_capacity=cap)
        return self.send(program, lanes, prompt_row=row)


def generate(w: RankWorker, requests, new: int = NEW, together: bool = True) -> list[list[int]]:
    """(prompt, sampling) per slot: prefill each, then decode batched or one by one."""
    d = Driver(w)
    for slot, (prompt, sampling) in enumerate(requests):
        d.prefill(slot, prompt, sampling)
    slots = list(range(len(requests)))
    for _ in range(new - 1):
        for group in [slots] if together else [[s] for s in slots]:
            d.decode(group, batch=4 if together else 1)
    return [d.tokens[s] for s in slots]


def hf_reference(model, prompt: list[int], p: SamplingParams, new: int = NEW) -> list[int]:
    """Greedy over transformers' logits with the reference adjustments and min_tokens."""
    out: list[int] = []
    with torch.no_grad():
        for step in range(new):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            adjusted = reference(logits, p, prompt, out)
            if step < p.min_tokens:
                adjusted[EOS] = float("-inf")
            out.append(int(adjusted.argmax()))
    return out


def check_state(d: Driver, slot: int) -> None:
    """The slot's penalty state is its consumed prompt and its committed tokens."""
    state = state_of(d.w)
    mask = state.prompt_mask[slot].nonzero().flatten().tolist()
    assert mask == sorted(set(d.prompt[slot][: d.position[slot]])), slot
    counts = Counter({t: c for t, c in enumerate(state.counts[slot].tolist()) if c})
    assert counts == Counter(d.tokens[slot]), slot


PENALISED = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5)


def test_state_equals_committed_tokens_and_consumed_prompt(checkpoint):
    path, _ = checkpoint
    w = make_worker(path)
    state = state_of(w)
    d = Driver(w)
    long = PROMPTS[3]
    d.begin(0, long, PENALISED)
    program = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
    d.send(program, [d.chunk(0, 64)])  # a chunk short of the prompt end: commits nothing
    assert state.prompt_mask[0].nonzero().flatten().tolist() == sorted(set(long[:64]))
    assert state.counts[0].sum() == 0
    d.send(program, [d.chunk(0, 100)])
    # A bias and no penalty: the full sampler, so its state is kept too.  (A slot
    # whose settings never need the state, like slot 2, runs "argmax" frames on
    # its own, which do not maintain it: nothing reads it.)
    d.prefill(1, PROMPTS[1], SamplingParams(logit_bias=((9, -2.0),)))
    d.prefill(2, PROMPTS[2], SamplingParams())  # no adjustments, decoding beside them
    check_state(d, 0)
    check_state(d, 1)
    for _ in range(6):
        d.decode([0, 1, 2])
        check_state(d, 0)
        check_state(d, 1)
    assert len(d.tokens[0]) == 7
    # A new generation in slot 0 starts from a fresh row: only its own prompt and tokens.
    d.prefill(0, PROMPTS[2], PENALISED)
    d.decode([1, 0])
    check_state(d, 0)
    check_state(d, 1)
    assert len(d.tokens[0]) == 2


@pytest.mark.parametrize(
    "settings",
    [
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(frequency_penalty=1.5, presence_penalty=1.0),
        SamplingParams(presence_penalty=-2.0),
        SamplingParams(logit_bias=((42, 6.0), (17, -4.0), (3, 2.5))),
        SamplingParams(
            repetition_penalty=1.2,
            frequency_penalty=0.4,
            presence_penalty=0.3,
            logit_bias=((7, 3.0),),
        ),
        SamplingParams(min_tokens=3, logit_bias=((EOS, 100.0),)),  # EOS barred, then forced
    ],
    ids=["rep1.8", "rep0.7", "freq+pres", "pres-2", "bias", "combined", "min_tokens+bias"],
)
def test_greedy_tokens_follow_the_adjusted_argmax_of_transformers_logits(checkpoint, settings):
    path, model = checkpoint
    w = make_worker(path)
    requests = [(prompt, settings) for prompt in PROMPTS]
    together = generate(w, requests)
    expected = [hf_reference(model, prompt, settings) for prompt in PROMPTS]
    assert together == expected
    plain = generate(w, [(prompt, SamplingParams()) for prompt in PROMPTS])
    assert together != plain  # the adjustment mattered
    if settings.min_tokens:
        assert all(t[:3].count(EOS) == 0 and t[3:] == [EOS] * (NEW - 3) for t in together)


def test_a_large_negative_bias_on_the_greedy_token_changes_it(checkpoint):
    path, model = checkpoint
    w = make_worker(path)
    plain = generate(w, [(prompt, SamplingParams()) for prompt in PROMPTS])
    requests = [(p, SamplingParams(logit_bias=((t[0], -100.0),))) for p, t in zip(PROMPTS, plain)]
    biased = generate(w, requests)
    for tokens, base in zip(biased, plain):
        assert tokens[0] != base[0] and base[0] not in tokens
    assert biased == [hf_reference(model, p, s) for p, s in requests]


def test_repetition_penalty_equals_transformers_generate(checkpoint):
    path, model = checkpoint
    w = make_worker(path)
    got = generate(w, [(prompt, SamplingParams(repetition_penalty=1.5)) for prompt in PROMPTS])
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
                                 repetition_penalty=1.5)  # fmt: skip
            expected.append(out[0, len(prompt) :].tolist())
    assert got == expected
    plain = generate(w, [(prompt, SamplingParams()) for prompt in PROMPTS])
    assert got != plain


def test_different_settings_in_one_batch_equal_each_request_alone(checkpoint):
    path, _ = checkpoint
    w = make_worker(path)
    requests = [
        (PROMPTS[0], SamplingParams(0.9, 0.95, 40, 11, repetition_penalty=1.4)),
        (PROMPTS[1], SamplingParams(frequency_penalty=0.8, logit_bias=((9, -5.0),))),
        (PROMPTS[2], SamplingParams(1.2, 1.0, -1, 12)),  # no adjustments
        (
            PROMPTS[3],
            SamplingParams(0.7, 0.8, -1, 13, presence_penalty=1.1, logit_bias=((4, 1.0),)),
        ),
    ]
    together = generate(w, requests)
    alone = generate(w, requests, together=False)
    assert together == alone
    # Reordered across slots: each request keeps its tokens.
    swapped = generate(w, requests[::-1])
    assert swapped == together[::-1]


def test_lanes_without_adjustments_are_bitwise_unchanged_beside_adjusted_lanes(checkpoint):
    path, _ = checkpoint
    plain_greedy = SamplingParams(logprobs=5)
    plain_seeded = SamplingParams(0.8, 0.9, 30, 5, logprobs=5)
    adjusted = SamplingParams(repetition_penalty=1.6, logit_bias=((3, 2.0),), logprobs=5)

    def run(neighbours: SamplingParams):
        d = Driver(make_worker(path))
        samplings = [plain_greedy, neighbours, plain_seeded, neighbours]
        for slot in range(4):
            d.prefill(slot, PROMPTS[slot], samplings[slot])
        rows = []
        for _ in range(NEW - 1):
            d.decode([0, 1, 2, 3])
            rows.append(tensor_to_torch(d.last.sidecars["logprobs"])[[0, 2]])
        return d.tokens, torch.stack(rows)

    beside_adjusted, logprobs_a = run(adjusted)
    beside_plain, logprobs_b = run(SamplingParams(logprobs=5))
    assert beside_adjusted[0] == beside_plain[0] and beside_adjusted[2] == beside_plain[2]
    assert torch.equal(logprobs_a, logprobs_b)
    assert beside_adjusted[1] != beside_plain[1]


def test_log_probabilities_stay_those_of_the_raw_logits(checkpoint):
    path, model = checkpoint
    prompt = PROMPTS[1]
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    best = int(raw.argmax())
    sidecars = {}
    for name, sampling in (
        ("plain", SamplingParams(logprobs=5)),
        (
            "biased",
            SamplingParams(logprobs=5, logit_bias=((best, -100.0),), repetition_penalty=2.0),
        ),
    ):
        d = Driver(make_worker(path))
        d.prefill(0, prompt, sampling)
        sidecars[name] = (d.tokens[0][0], tensor_to_torch(d.last.sidecars["logprobs"])[0],
                          tensor_to_torch(d.last.sidecars["logprob_token_ids"])[0])  # fmt: skip
    plain, biased = sidecars["plain"], sidecars["biased"]
    assert plain[0] == best and biased[0] != best
    assert torch.equal(plain[1][1:], biased[1][1:]) and torch.equal(plain[2], biased[2])
    assert abs(float(biased[1][0]) - float(raw[biased[0]])) < 1e-4  # the chosen token, raw


def test_mixed_frames_with_penalties_agree_with_separate_frames(checkpoint):
    path, model = checkpoint
    samplings = [
        SamplingParams(repetition_penalty=1.5, logprobs=2),
        SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, logit_bias=((9, -3.0),)),
        SamplingParams(repetition_penalty=1.3, logit_bias=((50, 4.0),)),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]  # the third arrives in two chunks

    def run(use_mixed: bool):
        w = make_worker(path, mixed=True)
        d = Driver(w)
        for slot in (0, 1):
            d.prefill(slot, prompts[slot], samplings[slot])
        d.begin(2, prompts[2], samplings[2])
        for end in (64, 100):
            chunk = d.chunk(2, end)
            if use_mixed:
                d.mixed(chunk, [0, 1])
            else:
                d.send(GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64), [chunk])
                d.decode([0, 1])
        for _ in range(NEW - 1):
            d.decode([0, 1, 2])
        state = state_of(w)
        return [d.tokens[s] for s in range(3)], state.counts[:3].clone(), state.prompt_mask[:3]

    mixed_tokens, mixed_counts, mixed_mask = run(True)
    separate_tokens, separate_counts, separate_mask = run(False)
    assert mixed_tokens == separate_tokens
    assert torch.equal(mixed_counts, separate_counts) and torch.equal(mixed_mask, separate_mask)
    expected = [
        hf_reference(model, p, s, len(t)) for p, s, t in zip(prompts, samplings, mixed_tokens)
    ]
    assert mixed_tokens == expected
    used = [program.desc.kind for program in make_worker(path, mixed=True).programs.values()]
    assert GraphKind.MIXED in used


def test_a_bias_outside_the_vocabulary_is_refused_on_the_ranks_and_at_submission(checkpoint):
    path, _ = checkpoint
    w = make_worker(path)
    d = Driver(w)
    d.prefill(0, PROMPTS[0], SamplingParams(repetition_penalty=1.2))
    counts, mask = state_of(w).counts.clone(), state_of(w).prompt_mask.clone()
    before = snapshot(w)
    bad = SamplingParams(logit_bias=((5, 1.0), (VOCAB, -1.0)))
    lane = FrameLane(1, 1, "prefill", 0, (1, 2), 0, pages(1), 1, bad)
    prefill = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
    with pytest.raises(FrameError, match=rf"logit_bias token id {VOCAB} is outside the vocabulary"):
        w.execute(Frame.from_lanes(99, prefill, [lane]))
    assert not w.slots.holds(1) and changed(before, snapshot(w)) == []
    assert torch.equal(state_of(w).counts, counts) and torch.equal(state_of(w).prompt_mask, mask)
    facts = ModelFacts(tuple(w.catalog), VOCAB, 128, PAGE, 32, "tiny")
    with pytest.raises(ValueError, match=r"logit_bias\[1\] token id 128 is outside the vocabulary"):
        check_submission([1, 2], 4, bad, False, facts)
    ok = SamplingParams(logit_bias=((VOCAB - 1, 1.0),))
    assert check_submission([1, 2], 4, ok, False, facts)[1] == ok
