"""The rank worker: frames in, completions out, against transformers' greedy tokens."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import load_model
from runtime.ranks.programs import ProgramError
from runtime.ranks.slots import FrameError
from runtime.ranks.worker import RankWorker
from runtime.transport.codec import decode, encode
from runtime.transport.schema import (
    Completion,
    Frame,
    FrameLane,
    SamplingParams,
    tensor_to_torch,
)
from tests.checkpoints import greedy, write_tiny

PAGE = 16
PAGES_PER_SLOT = 8  # 128 tokens per request
PROMPTS = [[5, 17, 33, 3, 60], [9, 9, 9, 41, 77, 12, 3, 50, 21], [88], list(range(3, 103))]
NEW = 6
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = write_tiny("llama", path, seed=11)
    return path, greedy(model, PROMPTS, NEW)


def make_worker(path) -> RankWorker:
    model = load_model(path)
    capacity = CapacityConfig(max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=128)
    return RankWorker(model, capacity, num_pages=4 * PAGES_PER_SLOT, page_size=PAGE)


def pages(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))


class Driver:
    """Builds well-formed frames the way the coordinator does."""

    def __init__(self, worker: RankWorker) -> None:
        self.w = worker
        self.fence = 0
        self.position: dict[int, int] = {}
        self.last: Completion | None = None  # the latest completion

    def _send(self, program: GraphDescriptor, lanes: list[FrameLane]) -> list[tuple[int, ...]]:
        self.fence += 1
        completion = self.w.execute(Frame(self.fence, program, tuple(lanes)))
        assert completion.device_ns > 0 and completion.rank == 0
        self.last = completion
        return [lane.tokens for lane in completion.lanes]

    def prefill(self, slot, generation, prompt, chunk=128, sampling=GREEDY):
        out = None
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            last = start + len(piece) == len(prompt)
            lane = FrameLane(
                slot,
                generation,
                "prefill",
                start,
                tuple(piece),
                start,
                pages(slot),
                1 if last else 0,
                sampling,
            )
            capacity = 64 if len(piece) <= 64 else 128
            program = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=capacity)
            out = self._send(program, [lane])[0]
        self.position[slot] = len(prompt)
        return out

    def decode(self, lanes: list[tuple[int, int]], batch: int):
        frame_lanes = [
            FrameLane(s, g, "decode", 0, (), self.position[s], pages(s), 1) for s, g in lanes
        ]
        out = self._send(GraphDescriptor(GraphKind.DECODE, batch), frame_lanes)
        for s, _ in lanes:
            self.position[s] += 1
        return out


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


def test_bad_frames_are_refused_without_changing_state(checkpoint):
    path, greedy = checkpoint
    d = Driver(make_worker(path))
    first = d.prefill(0, 1, PROMPTS[0])
    state = vars(d.w.slots.state(0)).copy()
    decode1 = GraphDescriptor(GraphKind.DECODE, 1)
    bad = [
        Frame(99, decode1, (FrameLane(1, 1, "decode", 0, (), 0, pages(1), 1),)),  # no state
        Frame(99, decode1, (FrameLane(0, 2, "decode", 0, (), 5, pages(0), 1),)),  # old generation
        Frame(99, decode1, (FrameLane(0, 1, "decode", 0, (), 7, pages(0), 1),)),  # wrong position
        Frame(
            99,
            GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
            (FrameLane(2, 1, "prefill", 3, (1, 2), 3, pages(2), 0),),  # new tenant not at 0
        ),
    ]
    for frame in bad:
        with pytest.raises(FrameError):
            d.w.execute(frame)
    unknown = GraphDescriptor(GraphKind.DECODE, 16)
    with pytest.raises(ProgramError):
        d.w.execute(Frame(99, unknown, (FrameLane(0, 1, "decode", 0, (), 5, pages(0), 1),)))
    assert vars(d.w.slots.state(0)) == state
    rest = [t for _ in range(NEW - 1) for t in d.decode([(0, 1)], 1)[0]]
    assert list(first) + rest == greedy[0]


def test_slot_reuse_with_a_new_generation_starts_fresh(checkpoint):
    path, greedy = checkpoint
    d = Driver(make_worker(path))
    d.prefill(0, 1, PROMPTS[1])
    d.decode([(0, 1)], 1)
    tokens = list(d.prefill(0, 2, PROMPTS[0]))  # the slot's next tenant
    for _ in range(NEW - 1):
        tokens += d.decode([(0, 2)], 1)[0]
    assert tokens == greedy[0]


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
    ]


def test_empty_frame_runs_nothing_but_applies_its_releases(checkpoint):
    path, _ = checkpoint
    d = Driver(make_worker(path))
    d.prefill(0, 1, PROMPTS[0])
    d.prefill(1, 1, PROMPTS[2])
    runs = d.w.frames
    d.fence += 1
    empty = Frame(d.fence, GraphDescriptor(GraphKind.DECODE, 1), (), release_slots=(0,))
    completion = d.w.execute(empty)
    assert completion.fence == d.fence and completion.device_ns == 0 and completion.lanes == ()
    assert d.w.frames == runs  # no program ran
    assert d.w.slots.state(0) is None and d.w.slots.state(1) is not None
    with pytest.raises(FrameError, match="no state"):
        d.decode([(0, 1)], 1)  # slot 0 was released
    d.decode([(1, 1)], 1)  # slot 1 is untouched
    d.fence += 1
    bogus = Frame(d.fence, GraphDescriptor(GraphKind.DECODE, 64), ())
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


def generate_until_stop(d: Driver, slot, generation, prompt, sampling, limit):
    tokens = list(d.prefill(slot, generation, prompt, sampling=sampling))
    reasons = [d.last.lanes[0].finish_reason]
    while reasons[-1] is None and len(tokens) < limit:
        tokens += d.decode([(slot, generation)], 1)[0]
        reasons.append(d.last.lanes[0].finish_reason)
    return tokens, reasons


def test_min_tokens_bars_eos_until_enough_tokens(eos_first):
    path, model, eos, first = eos_first
    worker = make_worker(path)
    assert worker.eos_ids == eos and first in eos
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
        assert all(lane.finish_reason is None for lane in d.last.lanes)
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
    completion = d.w.execute(
        Frame(d.fence, GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64), (lane,))
    )
    assert completion.lanes[0].tokens == ()
    assert completion.sidecars["logprobs"].shape == (1, 3)
    assert completion.sidecars["logprob_token_ids"].shape == (1, 2)
    # Sidecars travel through the codec unchanged.
    assert decode(encode(completion)) == completion
    # A frame where no lane asks carries none, even after frames that did.
    d2 = Driver(d.w)
    d2.fence = d.fence
    d2.prefill(2, 1, PROMPTS[2])
    assert d2.last.sidecars == {}


def test_full_width_fill_spans_every_page_column_with_padding(checkpoint):
    """What capture binds: the whole page-table width, padding rows all -1."""
    path, _ = checkpoint
    w = make_worker(path)
    program = w.programs[GraphDescriptor(GraphKind.DECODE, 4).key]
    program._fill([], full_width=True)
    x = program.inputs
    assert x.page_tables.shape == (4, program.max_pages)
    assert (x.page_tables == -1).all() and (x.slot_mapping == -1).all()
    assert (x.query_lens == 0).all() and (x.context_lens == 0).all()
    program._fill([])  # an eager frame reads only the columns it needs
    assert program.inputs.page_tables.shape == (4, 1)
