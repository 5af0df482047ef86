"""Frame fuzzing against a live rank process (issue 15): one real rank, TP=1,
the embedded default model, driven over real sockets by a bare coordinator
channel (with its heartbeat thread, so the rank keeps its coordinator).

About a hundred broken messages are published on the frames socket, each
followed by an ``inspect`` control as a barrier: valid frames of the rank's own
catalog broken at the byte level (bit flips, truncation, extension, ...) and at
the field level (junk of every type, NaN, negative numbers, keys deleted or
added), messages of the wrong direction or version, multipart messages, and
hand-made near-valid frames the rank must refuse.  Every one is answered,
exactly as its kind demands (never silence):

* a message too broken to carry a fence (undecodable, wrong version, wrong
  type or direction): ``Control("error", rank 0, reason)`` saying why;
* a decodable frame: a completion of its fence, an error completion
  ("rejected: ...") when the rank refuses it.

The rank keeps serving throughout: afterwards a fresh request gets exactly the
tokens it got before the fuzzing, and the process is still alive.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.deploy.launch import spawn_ranks, stop_ranks
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.codec import decode, encode
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.fields import MAX_ERROR_CHARS, ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import MAX_SLOTS, FrameLane
from runtime.transport.inspection import RankStatus
from runtime.transport.liveness import CoordinatorLiveness, LivenessConfig
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams
from tests.support.fuzz_strategies import VALID, envelope, field_mutations, mutate_bytes, pack

WAIT_S = 60.0  # per answer; the machine is shared and slow
STARTUP_S = 240.0
PROMPT = [11, 42, 7, 99, 5, 3, 250, 17]
DECODES = 3


class LiveRank:
    """A bare coordinator channel, its heartbeat thread and one real rank process."""

    def __init__(self, home: str) -> None:
        self.channel = CoordinatorChannel(1, heartbeat=True)
        self.procs: list = []
        self.gone: list[str] = []
        self.liveness = CoordinatorLiveness(
            self.channel.take_heartbeat_socket(),
            1,
            LivenessConfig(1.0, 120.0),
            lambda rank, reason: self.gone.append(reason),
        )
        self.liveness.start()
        args = [
            "--device",
            "cpu",
            "--max-concurrency",
            "2",
            "--max-prefill-tokens",
            "64",
            "--num-pages",
            "32",
        ]
        try:
            self.procs = spawn_ranks(
                self.channel.endpoints, 1, args, env=dict(os.environ, FLARE_HOME=home)
            )
            self.channel.handshake(timeout_s=STARTUP_S)
            report = self.channel.recv(timeout_ms=int(STARTUP_S * 1000))
            assert isinstance(report, CatalogReport), report
        except BaseException:
            self.close()
            raise
        self.report = report
        self.fence = 0
        self.nonce = 0
        self.generation = 0
        self.status: RankStatus | None = None  # the answer to the last barrier

    def program(self, kind: GraphKind) -> GraphDescriptor:
        return min(
            (d for d in self.report.descriptors if d.kind is kind),
            key=lambda d: (d.batch_capacity, d.prompt_capacity),
        )

    def next_fence(self) -> int:
        self.fence += 1
        return self.fence

    def expect(self, fence: int | None, what: str) -> list[Any]:
        """Publish an inspect barrier; every message until its answer, plus (when
        ``fence``) the completion of ``fence``, which may come after the barrier."""
        self.nonce += 1
        self.channel.publish(Control("inspect", nonce=self.nonce))
        got: list[Any] = []
        deadline = time.monotonic() + WAIT_S
        barrier = done = False
        while not (barrier and done):
            left = deadline - time.monotonic()
            assert left > 0, f"no answer within {WAIT_S:g} s to {what}: got {got}"
            assert self.procs[0].poll() is None, f"the rank exited after {what}: {got}"
            message = self.channel.recv(timeout_ms=int(min(left, 1.0) * 1000))
            if message is None:
                continue
            if isinstance(message, RankStatus) and message.nonce == self.nonce:
                self.status = message
                barrier = True
                done = done or fence is None
                continue
            got.append(message)
            done = fence is None or (isinstance(message, Completion) and message.fence == fence)
        return got

    def generate(self, prompt: list[int], new: int) -> list[int]:
        """A fresh request in slot 0 (every slot released first): its greedy tokens."""
        empty = Frame(
            self.next_fence(), self.program(GraphKind.DECODE), release_slots=tuple(range(MAX_SLOTS))
        )
        self.channel.publish(empty)
        (done,) = self.expect(empty.fence, "an empty frame")
        assert done.error is None, done.error
        self.generation += 1
        pages = tuple(range(-(-(len(prompt) + new) // self.report.page_size)))
        lane = FrameLane(
            0, self.generation, "prefill", 0, tuple(prompt), 0, pages, 1, SamplingParams()
        )
        frames = [Frame.from_lanes(self.next_fence(), self.program(GraphKind.PREFILL), [lane])]
        tokens = []
        for i in range(new):
            if i:
                decode_lane = FrameLane(
                    0, self.generation, "decode", 0, (), len(prompt) + i - 1, (), 1
                )
                program = self.program(GraphKind.DECODE)
                frames.append(Frame.from_lanes(self.next_fence(), program, [decode_lane]))
            self.channel.publish(frames[-1])
            (done,) = self.expect(frames[-1].fence, "a valid frame")
            assert done.error is None, done.error
            tokens += list(done.tokens)
        return tokens

    def close(self) -> list[int | None]:
        """Shutdown to the rank; its exit code (killed after 30 s), then the channel."""
        self.channel.shutdown_ranks()
        codes = stop_ranks(self.procs, timeout_s=30.0)
        self.liveness.close()
        self.channel.close()
        return codes


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveRank, list[int]]]:
    rank = LiveRank(str(tmp_path_factory.mktemp("flare-home")))
    try:
        baseline = rank.generate(PROMPT, DECODES)
        assert len(baseline) == DECODES
        yield rank, baseline
    finally:
        codes = rank.close()
    assert codes == [0], codes  # it left on shutdown, not before


def _bases(rank: LiveRank) -> list[Frame]:
    """Valid frames of the rank's own catalog (the corpus the mutations start from)."""
    prefill, decode_program = rank.program(GraphKind.PREFILL), rank.program(GraphKind.DECODE)
    lane = FrameLane(1, 7, "prefill", 0, (3, 4, 5), 0, (20, 21), 1, SamplingParams(top_k=5))
    return [
        Frame.from_lanes(900_001, prefill, [lane], expected_ns=1_000_000),
        Frame(900_002, decode_program, release_slots=(1, 2)),
        Frame.from_lanes(900_003, decode_program, [FrameLane(1, 7, "decode", 0, (), 3, (), 1)]),
    ]


def _near_valid(rank: LiveRank) -> list[Frame]:
    """Decodable frames this rank must refuse (each answered by an error completion):
    a replayed fence, then fences far ahead, which a refused frame must not claim
    (the next valid frame, behind them, still runs)."""
    prefill, decode_program = rank.program(GraphKind.PREFILL), rank.program(GraphKind.DECODE)
    unknown = GraphDescriptor(GraphKind.DECODE, 16)  # not in the catalog
    vocab, pool = rank.report.vocab_size, rank.report.num_pages
    new = FrameLane(2, 1, "prefill", 0, (1, 2), 0, (0,), 1, SamplingParams())
    ahead = iter(range(rank.fence + 10**6, rank.fence + 10**7, 10**6))
    return [
        Frame(rank.fence, decode_program),  # the last frame it ran, again
        Frame.from_lanes(next(ahead), unknown, [FrameLane(2, 1, "decode", 0, (), 0, (), 1)]),
        Frame.from_lanes(next(ahead), decode_program, [FrameLane(5, 9, "decode", 0, (), 4, (), 1)]),
        Frame.from_lanes(
            next(ahead),
            prefill,
            [FrameLane(2, 1, "prefill", 0, (1, vocab), 0, (0,), 1, SamplingParams())],
        ),
        Frame.from_lanes(
            next(ahead),
            prefill,
            [FrameLane(2, 1, "prefill", 0, (1, 2), 0, (pool,), 1, SamplingParams())],
        ),
        Frame.from_lanes(
            next(ahead),
            prefill,
            [FrameLane(2, 1, "prefill", 0, (1,) * 40, 0, (0,), 1, SamplingParams())],
        ),
        Frame.from_lanes(next(ahead), prefill, [new], copies=((pool + 3, 0),)),
    ]


@st.composite
def plausible_frame(draw: st.DrawFn, rank: LiveRank) -> Frame:
    """A frame that decodes: lanes of this rank's programs (or one it lacks) with
    slots, generations, positions, token ids and pages near and past the limits."""
    vocab, pool = rank.report.vocab_size, rank.report.num_pages
    programs = [*rank.report.descriptors, GraphDescriptor(GraphKind.DECODE, 16)]
    program = draw(st.sampled_from(programs))
    pages = st.lists(st.integers(0, pool + 1), min_size=0, max_size=3, unique=True)
    lanes = []
    if program.kind is GraphKind.PREFILL:
        position = draw(st.integers(0, 40))
        tokens = draw(st.lists(st.integers(0, vocab + 1), min_size=1, max_size=40))
        lanes.append(
            FrameLane(
                draw(st.integers(0, 4)),
                draw(st.integers(1, 3)),
                "prefill",
                position,
                tuple(tokens),
                position,
                tuple(draw(pages.filter(bool))),
                1,
                SamplingParams(),
            )
        )
    elif program.kind is GraphKind.DECODE:
        slots = draw(st.lists(st.integers(0, 4), max_size=program.batch_capacity, unique=True))
        for slot in slots:
            lanes.append(
                FrameLane(
                    slot,
                    draw(st.integers(1, 3)),
                    "decode",
                    0,
                    (),
                    draw(st.integers(0, 40)),
                    tuple(draw(pages)),
                    1,
                )
            )
    released = draw(st.lists(st.integers(5, 10), max_size=3, unique=True))
    return Frame.from_lanes(draw(st.integers(1, 2**40)), program, lanes, release_slots=released)


@st.composite
def junk(draw: st.DrawFn, bases: list[Frame], rank: LiveRank) -> list[bytes]:
    """One broken message (a list of parts: more than one is a multipart message)."""
    base = draw(st.sampled_from(bases))
    kind = draw(
        st.sampled_from(
            ["bytes", "bytes", "field", "field", "plausible", "plausible", "other", "multipart"]
        )
    )
    if kind == "plausible":
        return [encode(draw(plausible_frame(rank)))]
    if kind == "bytes":
        rng = random.Random(draw(st.integers(0, 2**32 - 1)))
        return [mutate_bytes(encode(base), rng, draw(st.integers(1, 3)))]
    if kind == "field":
        tree = msgpack.unpackb(encode(base), raw=False)
        _, tree, _ = draw(field_mutations(tree=tree))
        data = pack(tree)
        return [data if data is not None else b"\xc1"]
    if kind == "multipart":
        return [encode(base), draw(st.binary(max_size=8))]
    other = draw(st.sampled_from(VALID))
    version = draw(st.sampled_from([None, 0, 7, 9, "8", 8.0]))
    if version is None:  # a valid message of another type or direction
        return [encode(other)]
    return [envelope(type(other).__name__, other.to_wire(), version)]


def _expected(parts: list[bytes]) -> tuple[str, int | None, str]:
    """What the rank must answer: ("error", None, reason) for an error control
    saying ``reason``, ("frame", fence, "") for a completion of ``fence`` (refused
    or run), ("none", None, "") for a control from the coordinator this test
    leaves out."""
    if len(parts) != 1:
        return "error", None, f"multipart message ({len(parts)} parts)"
    try:
        message = decode(parts[0])
    except ProtocolError as exc:
        return "error", None, str(exc)
    if isinstance(message, Frame):
        return "frame", message.fence, ""
    if isinstance(message, Control):
        if message.rank < 0 and message.command != "ready":
            return "none", None, ""  # ping, inspect, profile, heartbeat, shutdown: not junk
        return "error", None, f"Control {message.command!r} from rank {message.rank}"
    return "error", None, f"unexpected {type(message).__name__} on this channel"


def _check_answer(
    rank: LiveRank, kind: str, fence: int | None, got: list[Any], reason: str = ""
) -> str:
    """Check the answer to a message of ``kind``: "error", "ran" or "refused"."""
    if kind == "error":
        assert len(got) == 1, (reason, got)
        (answer,) = got
        assert isinstance(answer, Control) and answer.command == "error", (reason, answer)
        assert answer.rank == 0 and answer.reason == reason[:MAX_ERROR_CHARS], (reason, answer)
        return "error"
    (answer,) = (m for m in got if isinstance(m, Completion) and m.fence == fence)
    assert len(got) == 1, got
    assert answer.rank == 0
    assert answer.error is None or answer.error.startswith("rejected: "), answer.error
    if answer.error is not None:
        return "refused"
    rank.fence = max(rank.fence, answer.fence)  # it ran: later fences must be greater
    return "ran"


def _assert_unchanged(before: RankStatus | None, after: RankStatus | None) -> None:
    """The rank's state (slots, frames run, last fence) as the barrier before saw it."""
    assert before is not None and after is not None
    assert after.slots() == before.slots()
    assert (after.frames, after.last_fence) == (before.frames, before.last_fence)


@pytest.mark.process
def test_near_valid_frames_are_refused_with_an_error_completion_naming_the_fence(
    live: tuple[LiveRank, list[int]],
) -> None:
    rank, baseline = live
    for frame in _near_valid(rank):
        before = rank.status
        rank.channel.publish(frame)
        got = rank.expect(frame.fence, f"near-valid frame {frame.fence}")
        _check_answer(rank, "frame", frame.fence, got)
        _assert_unchanged(before, rank.status)
        (answer,) = got
        assert answer.error is not None and answer.error.startswith("rejected: "), answer
        assert not answer.num_lanes
    assert rank.generate(PROMPT, DECODES) == baseline


@pytest.mark.process
def test_a_hundred_broken_messages_are_each_answered_and_the_rank_keeps_serving(
    live: tuple[LiveRank, list[int]],
) -> None:
    rank, baseline = live
    bases = _bases(rank)
    kinds: dict[str, int] = {}

    @settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=100,
        phases=[Phase.explicit, Phase.generate],  # one live rank: no shrinking replays
        suppress_health_check=list(HealthCheck),
    )
    @given(parts=junk(bases, rank))
    def run(parts: list[bytes]) -> None:
        kind, fence, reason = _expected(parts)
        if kind == "none":
            return
        before = rank.status
        if len(parts) == 1:
            rank.channel._pub.send(parts[0])
        else:
            rank.channel._pub.send_multipart(parts)
        got = rank.expect(fence, f"{kind} {parts[0][:64]!r}")
        answer = _check_answer(rank, kind, fence, got, reason)
        kinds[answer] = kinds.get(answer, 0) + 1
        if answer != "ran":
            _assert_unchanged(before, rank.status)

    run()
    print(f"answers to the broken messages: {kinds}")
    assert kinds.get("error", 0) >= 30 and kinds.get("refused", 0) >= 10, kinds
    assert rank.generate(PROMPT, DECODES) == baseline
    assert rank.procs[0].poll() is None and not rank.gone


# ---------------------------------------------------------------- the rank worker in-process


@st.composite
def worker_frames(draw: st.DrawFn, catalog: list[GraphDescriptor], vocab: int, pool: int) -> Frame:
    """Frames of every program of ``catalog`` (and one it lacks): lanes on a few
    slots with generations, positions, token ids, pages, copies, restore records
    and settings near and past the limits, so that some run and most are refused."""
    program = draw(st.sampled_from([*catalog, GraphDescriptor(GraphKind.DECODE, 16)]))
    slots = st.lists(st.integers(0, 5), min_size=0, max_size=min(4, program.batch_capacity),
                     unique=True)  # fmt: skip
    pages = st.lists(st.integers(0, pool + 1), min_size=0, max_size=3, unique=True)
    generation, position = st.integers(1, 3), st.sampled_from([0, 0, 1, 15, 16, 40, 70])
    settings_ = st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.0, 0.7]),
        top_k=st.sampled_from([-1, 5]),
        logprobs=st.sampled_from([-1, 0, 3]),
        repetition_penalty=st.sampled_from([1.0, 1.3]),
        logit_bias=st.sampled_from([(), ((vocab + 3, 5.0),), ((7, -100.0),)]),
    )
    known = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40).map(tuple)
    lanes = []
    if program.kind is GraphKind.PREFILL:
        start = draw(position)
        tokens = draw(st.lists(st.integers(0, vocab + 1), min_size=1, max_size=60))
        restore = None
        if draw(st.booleans()):
            sequence = draw(known)
            restore = Restore(sequence, draw(st.integers(0, len(sequence))))
        lanes.append(FrameLane(draw(st.integers(0, 5)), draw(generation), "prefill", start,
                               tuple(tokens), start, tuple(draw(pages)) or (0,),
                               draw(st.integers(0, 1)), draw(settings_), restore))  # fmt: skip
    elif program.kind is GraphKind.DECODE:
        for slot in draw(slots):
            lanes.append(FrameLane(slot, draw(generation), "decode", 0, (), draw(position),
                                   tuple(draw(pages)), 1))  # fmt: skip
    else:  # RESTORE or SNAPSHOT: restore rows and terminal rows
        for slot in draw(slots):
            if program.kind is GraphKind.RESTORE and draw(st.booleans()):
                sequence = draw(known)
                at = draw(st.integers(0, len(sequence) - 1))
                record = Restore(sequence, draw(st.integers(0, len(sequence))))
                lanes.append(FrameLane(slot, draw(generation), "state", at, (), at,
                                       tuple(draw(pages)), 0, draw(settings_), record))  # fmt: skip
            else:
                lanes.append(FrameLane(slot, draw(generation), "state", 0, (), 0, (), 0))
    copies = draw(st.sampled_from([(), ((0, 1),), ((pool, 2),), ((3, pool + 1),)]))
    released = draw(st.lists(st.integers(6, 11), max_size=2, unique=True))
    return Frame.from_lanes(draw(st.integers(1, 2**40)), program, lanes,
                            release_slots=released, copies=copies)  # fmt: skip


def test_the_rank_worker_runs_or_refuses_every_frame_changing_nothing_when_it_refuses() -> None:
    """In-process, a few hundred frames through the rank's own check and launch:
    each runs (a completion of its lanes, token ids inside the vocabulary) or is
    refused with FrameError / ProgramError and the rank's state unchanged; no
    other exception (which would end a rank process) ever escapes."""
    from runtime.ranks.capacity import CapacityConfig
    from runtime.ranks.checked_frame import FrameError
    from runtime.ranks.model import default_model_dir, load_model
    from runtime.ranks.shapes import ProgramError
    from runtime.ranks.worker import RankWorker

    capacity = CapacityConfig(max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=64)
    worker = RankWorker(load_model(default_model_dir()), capacity, num_pages=24, page_size=16)
    vocab = worker.report().vocab_size
    outcomes: dict[str, int] = {}

    @settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=100,
        phases=[Phase.explicit, Phase.generate],  # one worker: no shrinking replays
        suppress_health_check=list(HealthCheck),
    )
    @given(frame=worker_frames(list(worker.catalog), vocab, 24))
    def run(frame: Frame) -> None:
        before = worker.inspect()
        try:
            item = worker.start(frame)
            done = item if isinstance(item, Completion) else worker.finish(item)
        except (FrameError, ProgramError):
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            after = worker.inspect()
            assert after.slots() == before.slots() and after.frames == before.frames
            return
        outcomes["ran"] = outcomes.get("ran", 0) + 1
        assert done.fence == frame.fence and done.error is None
        assert list(done.slot) == list(frame.slot)
        assert all(0 <= t < vocab for t in done.tokens)

    run()
    print(f"frames run or refused by the worker: {outcomes}")
    assert outcomes.get("ran", 0) >= 8 and outcomes.get("refused", 0) >= 40, outcomes
