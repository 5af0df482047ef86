"""The rank loop's two-slot queue: a second frame is received, checked and
packed while the first runs; completions leave in fence order; a frame past its
deadline is reported naming the fence and the rank.  The device's "not finished
yet" is played by an event that completes after a few polls (CPU programs
finish inside the launch)."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.frame_loop import FrameLoop, RankHang
from runtime.ranks.launch import Launch
from runtime.ranks.model import load_model
from runtime.ranks.worker import RankWorker
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.frame import Frame
from runtime.transport.sampling import SamplingParams
from tests.support.checkpoints import write_tiny

PAGE = 16


class SlowEvent:
    """An event that reports done after ``polls`` queries (never when None)."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls

    def query(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.polls = 0


class ScriptedChannel:
    def __init__(self, messages, log) -> None:
        self.messages = list(messages)
        self.log = log
        self.sent: list[Completion] = []

    def recv(self, timeout_ms=None, spin_us=0):
        return self.messages.pop(0) if self.messages else None

    def send(self, message) -> None:
        self.log.append(("sent", message.fence))
        self.sent.append(message)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("loop")
    write_tiny("llama", path, seed=13)
    return path


def make_worker(model_dir) -> RankWorker:
    capacity = CapacityConfig(max_concurrency=2, min_prefill_tokens=64, max_prefill_tokens=64)
    return RankWorker(load_model(model_dir), capacity, num_pages=16, page_size=PAGE)


def frames(worker: RankWorker) -> list[Frame]:
    kinds = {(d.kind, d.batch_capacity): d for d in worker.catalog}
    prefill, decode = kinds[(GraphKind.PREFILL, 1)], kinds[(GraphKind.DECODE, 1)]
    out = [
        Frame(
            1, prefill, slot=[0], generation=[1], phase=[1], position=[0], query_len=[5],
            commits=[1], prompt_start=[0], prompt_tokens=[5, 17, 33, 3, 60], page_count=[4],
            pages=[0, 1, 2, 3], sampling=((0, SamplingParams()),), expected_ns=1_000_000,
        )
    ]  # fmt: skip
    for i in range(3):
        out.append(
            Frame(
                2 + i, decode, slot=[0], generation=[1], phase=[0], position=[5 + i],
                query_len=[1], commits=[1], prompt_start=[0], page_count=[0],
                expected_ns=1_000_000,
            )
        )  # fmt: skip
    return out


def tokens(completions: list[Completion]) -> list[int]:
    return [t for c in completions for t in c.tokens]


def test_the_next_frame_is_packed_while_the_first_runs(model_dir):
    reference = make_worker(model_dir)
    expected = [reference.execute(f) for f in frames(reference)]
    worker = make_worker(model_dir)
    log: list[tuple[str, int]] = []
    start = worker.start

    def slow_start(frame, *args):
        item = start(frame, *args)
        log.append(("started", frame.fence))
        if isinstance(item, Launch):
            item.done = SlowEvent(3)  # the "device" is still busy for three polls
        return item

    worker.start = slow_start
    channel = ScriptedChannel([*frames(worker), Control("shutdown", -1)], log)
    FrameLoop(worker, channel, 0, None).run()
    assert [c.fence for c in channel.sent] == [1, 2, 3, 4]  # fence order
    assert tokens(channel.sent) == tokens(expected)  # pending tokens stayed on the device
    # Frame 2 was checked, packed and launched before frame 1 was answered.
    assert log.index(("started", 2)) < log.index(("sent", 1))
    # Two frames in flight at most (the host buffers are double): frame 3 waits.
    assert log.index(("started", 3)) > log.index(("sent", 1))
    assert all(set(stages) >= {"receive", "validate", "pack", "launch", "wait", "publish"}
               for stages in worker.stages)  # fmt: skip


def test_a_frame_past_its_deadline_is_reported_and_the_rank_stops(model_dir):
    worker = make_worker(model_dir)
    worker.frame_timeout_multiple, worker.frame_timeout_margin_s = 2.0, 0.05
    start = worker.start

    def hung_start(frame, *args):
        item = start(frame, *args)
        if isinstance(item, Launch) and frame.fence == 2:
            item.done = SlowEvent(None)  # never finishes
        return item

    worker.start = hung_start
    channel = ScriptedChannel(frames(worker)[:3], [])
    with pytest.raises(RankHang, match="fence 2"):
        FrameLoop(worker, channel, 0, None).run()
    assert [c.fence for c in channel.sent] == [1, 2]
    error = channel.sent[-1].error
    assert error.startswith("hung: rank 0: frame fence 2") and "expected 1.000 ms" in error
