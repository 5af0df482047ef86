"""The rank worker: frames in, completions out, against transformers' greedy tokens."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import load_model
from runtime.ranks.programs import ProgramError
from runtime.ranks.slots import FrameError
from runtime.ranks.worker import RankWorker
from runtime.transport.schema import Frame, FrameLane, SamplingParams
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

    def _send(self, program: GraphDescriptor, lanes: list[FrameLane]) -> list[tuple[int, ...]]:
        self.fence += 1
        completion = self.w.execute(Frame(self.fence, program, tuple(lanes)))
        assert completion.device_ns > 0 and completion.rank == 0
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

    def run(slots):
        d = Driver(make_worker(path))
        outs = {s: list(d.prefill(s, 1, PROMPTS[s], sampling=sampling[s])) for s in slots}
        for _ in range(NEW - 1):
            for s, toks in zip(slots, d.decode([(s, 1) for s in slots], 4)):
                outs[s] += toks
        return outs

    together = run([0, 1, 2])
    for s in range(3):
        assert run([s])[s] == together[s]


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
