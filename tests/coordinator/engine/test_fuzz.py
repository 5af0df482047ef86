"""Forged and broken completions against the engine (issue 15), in-process.

The engine runs against fake ranks in the test's own process over real
sockets; a stranger's PUSH socket on the completions endpoint injects forged
messages while a request's frame is in flight.  Each forgery has one right
outcome, asserted exactly:

* refused: the channel rejects it (undecodable, wrong world size, NaN or
  negative intervals, sidecars of the wrong shape, the wrong direction) or the
  engine ignores it (unknown fence, a duplicate, an error for a fence not in
  flight, start-up messages after start-up), with a logged reason and a count,
  and nothing changes: the fences in flight and the scheduler's occupancy stay
  as they were, and the request finishes with exactly the fake model's tokens;
* fail fast: the forgery is taken as the frame's answer and contradicts it
  (rank 0's lanes do not match the frame, token ids outside the vocabulary,
  log-probability sidecars of the wrong shape, dtype or values, an error
  completion, an error control): the engine raises an EngineError naming what
  was wrong, within a bounded time, and every open request ends with
  finish_reason "error".

Never a stall and never the engine thread dying of an unrelated exception.
Hypothesis runs derandomized: the same examples on every run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.engine import ERROR, Engine, EngineConfig, EngineError
from runtime.transport.codec import decode, encode
from runtime.transport.columns import column
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.fields import INT64_MAX, ProtocolError
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import Tensor
from tests.support import fake_rank
from tests.support.fake_rank import FakeSpec, LocalRanks, reference
from tests.support.fuzz_strategies import junk_values, mutate_bytes

WAIT_S = 10.0
WORLD = 2
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    # One engine serves every example: shrinking would replay on a changed engine.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class Rig:
    """An engine, in-process fake ranks and a stranger's socket on the completions endpoint."""

    def __init__(self, spec: FakeSpec | None = None, world: int = WORLD) -> None:
        config = EngineConfig(
            world_size=world,
            handshake_timeout_s=WAIT_S,
            catalog_timeout_s=WAIT_S,
            completion_timeout_s=WAIT_S,
            shutdown_grace_s=0,
        )
        self.engine = Engine(config)
        self.ranks = LocalRanks(self.engine.bind(), world, spec or FakeSpec())
        threads = self.ranks.handshake_in_background()
        try:
            self.engine.start()
        except BaseException:  # no socket left open (a collected context would hang)
            self.engine.stop()
            self.ranks.close()
            raise
        finally:
            for thread in threads:
                thread.join(WAIT_S)
        self.context = zmq.Context()
        self.raw = self.context.socket(zmq.PUSH)
        self.raw.setsockopt(zmq.LINGER, 0)
        self.raw.connect(self.engine.endpoints.completions)

    def counts(self) -> tuple[int, int, int]:
        """(rejected by the channel, ignored by the engine, completions taken)."""
        counters = self.engine.stats.counters()
        return (
            self.engine.rejected_messages,
            counters["ignored_messages"],
            counters["completion_messages"],
        )

    def step_until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, f"the engine stalled: {what}"
            self.engine.step(5)

    def settle(self) -> None:
        """Answer what is in flight (an idle engine's empty frame releasing slots)."""
        deadline = time.monotonic() + WAIT_S
        while self.engine.in_flight_fences:
            assert time.monotonic() < deadline, "the engine stalled while settling"
            self.engine.step(0)
            self.ranks.serve(timeout_ms=1)

    def first_frame(self, prompt: list[int], max_tokens: int, **kwargs: Any) -> tuple:
        """Submit; once its first frame is out: the stream, the fence, each rank's answer."""
        self.settle()
        stream = self.engine.submit(prompt, max_tokens, **kwargs)
        self.step_until(lambda: bool(self.engine.in_flight_fences), "no frame sent")
        (fence,) = self.engine.in_flight_fences
        answers = self.ranks.take(timeout_ms=int(WAIT_S * 1000))
        assert [len(a) for a in answers] == [1] * WORLD
        return stream, fence, [a[0] for a in answers]

    def answer(self, rank: int, completion: Completion) -> None:
        """Send a rank's true answer through its own channel and wait until it is taken."""
        before = self.counts()[2]
        self.ranks.channels[rank].send(completion)
        self.step_until(lambda: self.counts()[2] > before, f"rank {rank}'s answer not taken")

    def drive(self, streams: list, limit_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + limit_s
        while not all(s.finished for s in streams):
            assert time.monotonic() < deadline, "streams did not finish"
            self.engine.step(0)
            if not self.ranks.serve(timeout_ms=1):
                self.engine.step(5)

    def close(self) -> None:
        self.engine.stop()
        self.ranks.close()
        self.raw.close()
        self.context.term()


@pytest.fixture
def rig_factory() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(spec: FakeSpec | None = None, world: int = WORLD) -> Rig:
        rigs.append(Rig(spec, world))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


def _wire(completion: Completion, **changes: Any) -> bytes:
    """The completion's envelope with body fields replaced (any value, valid or not)."""
    tree = msgpack.unpackb(encode(completion), raw=False)
    tree["b"].update(changes)
    return msgpack.packb(tree, use_bin_type=True)


def _check_tokens(stream: Any, prompt: list[int], max_tokens: int) -> None:
    tokens, reason = reference(prompt, max_tokens)
    result = stream.result(timeout=0)
    assert (result.token_ids, result.finish_reason) == (tokens, reason)


# ---------------------------------------------------------------- refused forgeries

REFUSED_KINDS = (
    "junk",
    "unknown_fence",
    "duplicate",
    "forged_duplicate",
    "world_size",
    "rank_outside_world",
    "lanes_from_rank_1",
    "interval",
    "sidecar",
    "stray_error",
    "startup_message",
    "control_outside_world",
    "wrong_direction",
)


@st.composite
def forgeries(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(REFUSED_KINDS))
    case: dict[str, Any] = {
        "kind": kind,
        "rank": draw(st.integers(0, WORLD - 1)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }
    if kind == "unknown_fence":
        case["offset"] = draw(st.sampled_from([1, 2, 1000, -1, -2, -(10**6)]))
    elif kind == "world_size":
        case["world_size"] = draw(st.sampled_from([1, 3, 4096]))
    elif kind == "interval":
        case["field"] = draw(st.sampled_from(["device_ns", "readiness_delay_ns", "launch_wait_ns"]))
        case["value"] = draw(
            st.one_of(
                st.sampled_from([math.nan, math.inf, -math.inf, -1, -1.0, -(2**63), 2**64 - 1]),
                junk_values,
            ).filter(lambda v: not (type(v) is int and 0 <= v <= INT64_MAX))
        )
    elif kind == "sidecar":
        case["sidecar"] = draw(
            st.sampled_from(
                [
                    {"dtype": "float32", "shape": [2, 3], "data": b"\x00" * 20},
                    {"dtype": "float64", "shape": [1], "data": b"\x00" * 8},
                    {"dtype": "float32", "shape": [-1], "data": b""},
                    {"dtype": "float32", "shape": [1] * 9, "data": b"\x00" * 4},
                    {"dtype": "float32", "shape": [1], "data": [0.0]},
                    {"dtype": "float32", "shape": [1]},
                    [1, 2, 3],
                ]
            )
        )
    return case


def _forge(rig: Rig, case: dict[str, Any], fence: int, answers: list[Completion]) -> list[bytes]:
    """The forged messages of ``case`` for the frame ``fence`` in flight."""
    kind, rank = case["kind"], case["rank"]
    true = answers[rank]
    if kind == "junk":
        rng = random.Random(case["seed"])
        while True:
            data = mutate_bytes(encode(true), rng, rng.randint(1, 3))
            try:
                decode(data)
            except ProtocolError:
                return [data]
    if kind == "unknown_fence":
        return [encode(dataclasses.replace(true, fence=max(0, fence + case["offset"])))]
    if kind in ("duplicate", "forged_duplicate"):
        rig.answer(rank, true)  # the true answer first: the forgery repeats it
        if kind == "duplicate":
            return [encode(true)]
        forged = dataclasses.replace(true, device_ns=true.device_ns + 12_345)
        if rank == 0:  # other tokens: the client must still see the true ones
            forged = dataclasses.replace(forged, tokens=column(t + 1 for t in true.tokens))
        return [encode(forged)]
    if kind == "world_size":
        return [encode(dataclasses.replace(true, world_size=case["world_size"], rank=0))]
    if kind == "rank_outside_world":
        return [_wire(true, rank=WORLD)]
    if kind == "lanes_from_rank_1":  # rank 0's lanes, claimed by rank 1
        return [_wire(answers[0], rank=1)]
    if kind == "interval":
        return [_wire(true, **{case["field"]: case["value"]})]
    if kind == "sidecar":
        return [_wire(true, sidecars={"logprobs": case["sidecar"]})]
    if kind == "stray_error":
        return [encode(Completion(fence + 7, rank, WORLD, 0, error="forged: not your frame"))]
    if kind == "startup_message":
        report = rig.ranks.fakes[rank].report()
        return [encode(report), encode(Control("shutdown", rank=rank))]
    if kind == "control_outside_world":
        return [encode(Control("error", rank=WORLD + 3, reason="forged"))]
    assert kind == "wrong_direction"
    return [encode(Control("ping")), encode(SamplingParams())]


# What each kind raises: (rejected by the channel, ignored by the engine) per message.
EXPECTED = {
    "junk": (1, 0),
    "unknown_fence": (0, 1),
    "duplicate": (0, 1),
    "forged_duplicate": (0, 1),
    "world_size": (1, 0),
    "rank_outside_world": (1, 0),
    "lanes_from_rank_1": (1, 0),
    "interval": (1, 0),
    "sidecar": (1, 0),
    "stray_error": (0, 1),
    "startup_message": (0, 2),
    "control_outside_world": (1, 0),
    "wrong_direction": (2, 0),
}
LOGGED = {
    "unknown_fence": "not in flight",
    "duplicate": "duplicate completion",
    "forged_duplicate": "duplicate completion",
    "world_size": "says world size",
    "rank_outside_world": "Completion.rank",
    "lanes_from_rank_1": "only rank 0 reports lanes",
    "interval": "Completion.",
    "sidecar": "sidecars[logprobs]",
    "stray_error": "not in flight",
    "startup_message": "after start-up",
    "control_outside_world": "of world size 2",
    "wrong_direction": "unexpected",
}


def test_refused_forgeries_change_nothing_and_requests_finish_right(
    rig_factory: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    rig = rig_factory()
    engine = rig.engine
    seen: set[str] = set()

    @settings(FUZZ, max_examples=150)
    @given(case=forgeries())
    def run(case: dict[str, Any]) -> None:
        seen.add(case["kind"])
        rng = random.Random(case["seed"])
        prompt = [rng.randrange(fake_rank.VOCAB) for _ in range(rng.randint(1, 40))]
        max_tokens = rng.randint(1, 4)
        stream, fence, answers = rig.first_frame(prompt, max_tokens, ignore_eos=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            forged = _forge(rig, case, fence, answers)
            before = rig.counts()
            inflight, snapshot = engine.in_flight_fences, engine.snapshot()
            for data in forged:
                rig.raw.send(data)
            rejected, ignored = EXPECTED[case["kind"]]
            want = (before[0] + rejected, before[1] + ignored, before[2])
            rig.step_until(lambda: rig.counts()[:2] == want[:2], f"{case} not refused")
            engine.step(5)  # nothing more comes of it
            assert rig.counts() == want, case
            assert engine.in_flight_fences == inflight == [fence]
            assert engine.snapshot() == {**snapshot, "rejected_messages": want[0]}
            assert not stream.finished
        text = caplog.text
        assert LOGGED.get(case["kind"], "rejected message") in text, (case, text)
        # The true answers (those not sent yet) complete the frame; the request
        # finishes with exactly the fake model's tokens.
        taken = case["kind"] in ("duplicate", "forged_duplicate")
        rig.ranks.send(
            [[a] if not (taken and r == case["rank"]) else [] for r, a in enumerate(answers)]
        )
        rig.drive([stream])
        _check_tokens(stream, prompt, max_tokens)
        assert engine.error is None

    run()
    assert seen == set(REFUSED_KINDS)  # every kind ran
    snapshot = engine.snapshot()
    assert snapshot["live_requests"] == 0 and snapshot["free_pages"] == snapshot["num_pages"]


@st.composite
def timings(draw: st.DrawFn) -> dict[str, Any]:
    """Valid but absurd intervals a (buggy or hostile) rank may report."""
    big = st.sampled_from([0, 1, 2**31, 2**62, INT64_MAX])
    device = draw(st.one_of(big, st.integers(0, INT64_MAX)))
    times = sorted(draw(st.lists(st.integers(0, INT64_MAX), min_size=4, max_size=4)))
    return {
        "device_ns": device,
        "readiness_delay_ns": draw(st.one_of(big, st.integers(0, INT64_MAX))),
        "launch_wait_ns": draw(st.integers(0, device)),
        "host_times": draw(st.sampled_from([(), tuple(times)])),
        "stage_ns": draw(st.sampled_from([(), (INT64_MAX,) * 6, (0, 1, 2, 3, 4, 5)])),
    }


def test_absurd_but_valid_intervals_never_break_the_engine(
    rig_factory: Callable[..., Rig],
) -> None:
    """Intervals pass the schema up to INT64_MAX: the engine takes them as cost
    samples and keeps serving with the right tokens (no overflow, no stall)."""
    rig = rig_factory()

    @settings(FUZZ, max_examples=40)
    @given(rank=st.integers(0, WORLD - 1), timing=timings(), seed=st.integers(0, 2**16))
    def run(rank: int, timing: dict[str, Any], seed: int) -> None:
        rng = random.Random(seed)
        prompt = [rng.randrange(fake_rank.VOCAB) for _ in range(rng.randint(1, 30))]
        stream, _, answers = rig.first_frame(prompt, 3)
        answers[rank] = dataclasses.replace(answers[rank], **timing)
        rig.ranks.send([[a] for a in answers])
        rig.drive([stream])
        _check_tokens(stream, prompt, 3)
        assert rig.engine.error is None
        assert rig.engine.rank_metrics.values()  # the per-rank metrics digest them too

    run()


# ---------------------------------------------------------------- fail fast


def _lanes_of(true: Completion, **changes: Any) -> Completion:
    return dataclasses.replace(true, **changes)


def _logprob_sidecars(values: Tensor, ids: Tensor) -> Callable[[Completion], Completion]:
    def forge(true: Completion) -> Completion:
        return dataclasses.replace(true, sidecars={"logprobs": values, "logprob_token_ids": ids})

    return forge


F32 = Tensor.from_values
LOGPROBS_OK = F32("float32", (1, 3), [-0.5, -1.0, -2.0])
IDS_OK = F32("int32", (1, 2), [3, 4])

# (what the forged rank-0 answer does, the EngineError it must raise)
FAIL_FAST: dict[str, tuple[Callable[[Completion], Completion], str]] = {
    "no_lanes": (
        lambda c: Completion(c.fence, 0, WORLD, device_ns=5),
        r"rank 0's results were refused: fence \d+: 0 records for 1 lanes",
    ),
    "wrong_generation": (
        lambda c: _lanes_of(c, generation=column(g + 1 for g in c.generation)),
        r"results were refused: fence \d+ lane 0: record names slot \d+ generation",
    ),
    "wrong_slot": (
        lambda c: _lanes_of(c, slot=column(s + 1 for s in c.slot)),
        r"results were refused: fence \d+ lane 0: record names slot",
    ),
    "too_many_tokens": (
        lambda c: _lanes_of(c, token_count=column([2]), tokens=column([1, 1])),
        r"results were refused: fence \d+ lane 0: 2 tokens, lane commits exactly 1",
    ),
    "token_outside_vocab": (
        lambda c: _lanes_of(c, tokens=column([fake_rank.VOCAB + 5])),
        rf"rank 0 sent token id {fake_rank.VOCAB + 5} .*outside the vocabulary \[0, "
        rf"{fake_rank.VOCAB}\)",
    ),
    "logprobs_1d": (
        _logprob_sidecars(F32("float32", (3,), [-0.5, -1.0, -2.0]), IDS_OK),
        r"logprob sidecars of shape \[3\] and \[1, 2\] do not fit: both must be matrices",
    ),
    "logprobs_3d": (
        _logprob_sidecars(F32("float32", (1, 3, 1), [-0.5, -1.0, -2.0]), IDS_OK),
        r"logprob sidecars of shape \[1, 3, 1\] and \[1, 2\] do not fit: both must be",
    ),
    "logprobs_too_few_rows": (
        _logprob_sidecars(F32("float32", (0, 3), []), F32("int32", (0, 2), [])),
        r"logprob sidecars .* \[0, 3\] and \[0, 2\] do not fit 1 lanes",
    ),
    "logprobs_wrong_dtype": (
        _logprob_sidecars(F32("int32", (1, 3), [0, -1, -2]), IDS_OK),
        r"logprob sidecars must be float32 values and int32 token ids, got int32 and int32",
    ),
    "logprobs_nan": (
        _logprob_sidecars(F32("float32", (1, 3), [math.nan, -1.0, -2.0]), IDS_OK),
        r"logprob sidecars hold an invalid entry \(logprob: must be a log probability, got nan\)",
    ),
    "logprob_id_outside_vocab": (
        _logprob_sidecars(LOGPROBS_OK, F32("int32", (1, 2), [3, fake_rank.VOCAB])),
        rf"logprob_token_ids sidecar holds token id {fake_rank.VOCAB}, outside the vocabulary",
    ),
    "error_completion": (
        lambda c: Completion(c.fence, 0, WORLD, 0, error="rejected: forged"),
        r"rank 0 could not run frame \d+: rejected: forged",
    ),
}


@pytest.mark.parametrize("case", sorted(FAIL_FAST))
def test_contradicting_answers_fail_fast_naming_what_was_wrong(
    rig_factory: Callable[..., Rig], case: str
) -> None:
    forge, message = FAIL_FAST[case]
    rig = rig_factory()
    stream, fence, answers = rig.first_frame([7, 3, 9, 1], 4, sampling=SamplingParams(logprobs=2))
    other = rig.engine.submit([5, 5, 5], 8)  # waits or runs beside: it must end too
    forged = forge(answers[0])
    rig.raw.send(encode(forged))  # before rank 0's true answer: taken as rank 0's
    rig.ranks.send([[]] + [[a] for a in answers[1:]])
    deadline = time.monotonic() + WAIT_S
    with pytest.raises(EngineError, match=message) as raised:
        while time.monotonic() < deadline:
            rig.engine.step(5)
    assert f"{fence}" in str(raised.value)
    for s in (stream, other):
        assert s.result(timeout=0).finish_reason == ERROR
        assert isinstance(s.error, EngineError)
    assert rig.engine.error is raised.value


def test_an_error_control_from_a_rank_fails_the_frames_in_flight(
    rig_factory: Callable[..., Rig],
) -> None:
    """A rank that could not decode a message says so (``Control("error")``): a
    frame may be lost, so the engine fails at once naming the rank and fences."""
    rig = rig_factory()
    stream, fence, _ = rig.first_frame([1, 2, 3], 4)
    rig.ranks.channels[1].send(Control("error", 1, reason="message: malformed msgpack"))
    deadline = time.monotonic() + WAIT_S
    with pytest.raises(EngineError, match=rf"rank 1 could not decode .*fence\(s\) {fence}"):
        while time.monotonic() < deadline:
            rig.engine.step(5)
    assert stream.result(timeout=0).finish_reason == ERROR


# ---------------------------------------------------------------- speculative sidecars

SPECULATIVE = GraphDescriptor(
    GraphKind.SPECULATIVE,
    4,
    token_capacity=4,
    proposal_depth=3,
    target_capacity=8,
    device_allocated=True,
)


def test_confidence_sidecars_of_every_shape_run_or_fail_fast() -> None:
    """A device-allocated round's confidence sidecar [2, rows >= lanes, depth]:
    rank 0's true values with extra rows of probabilities run on with exactly
    the reference tokens; any other shape fails the engine naming the fence and
    the sidecar."""
    verdicts: set[tuple[str, int]] = set()

    @settings(FUZZ, max_examples=24)
    @given(
        planes=st.sampled_from([2, 2, 2, 1, 3]),
        rows=st.sampled_from([0, 0, 1, -1]),  # beside the true lane count
        depth=st.sampled_from([0, 0, 1, -1]),  # beside the true proposal depth
        filler=st.sampled_from([0.0, 0.5, 1.0]),
    )
    def run(planes: int, rows: int, depth: int, filler: float) -> None:
        verdicts.add(_confidence_case(planes, rows, depth, filler))

    run()
    assert {v for v, _ in verdicts} == {"fits", "wrong"}
    assert ("fits", 1) in verdicts  # an extra row of probabilities is fine


def _confidence_case(planes: int, rows: int, depth: int, filler: float) -> tuple[str, int]:
    rig = Rig(FakeSpec(descriptors=(*fake_rank.DESCRIPTORS, SPECULATIVE), accept=2,
                       confidence=(0.9, 0.8, 0.4)), world=1)  # fmt: skip
    try:
        rig.engine.scheduler.speculation.preseed("draft", [0.95, 0.9, 0.85])
        prompt = [4, 8, 15, 16, 23, 42]
        stream = rig.engine.submit(prompt, 12, ignore_eos=True)
        forged = None
        deadline = time.monotonic() + WAIT_S
        while not stream.finished:
            assert time.monotonic() < deadline, "the engine stalled"
            try:
                rig.engine.step(0)
            except EngineError as exc:
                assert forged is not None and forged[1] != "fits", (forged, exc)
                assert f"fence {forged[0]}" in str(exc) and "confidence" in str(exc), exc
                assert stream.finish_reason == ERROR
                return forged[1], rows
            (answers,) = rig.ranks.take(timeout_ms=1)
            for i, answer in enumerate(answers):
                true = answer.sidecars.get("confidence")
                if true is None or forged is not None:
                    continue
                _, lanes, d = true.shape
                shape = (planes, lanes + rows, d + depth)
                values = true.values()
                if shape[0] == 2 and shape[1] >= lanes and shape[2] == d:  # the true rows first
                    verdict = "fits"
                    halves = [values[k * lanes * d : (k + 1) * lanes * d] for k in (0, 1)]
                    pad = [filler] * ((shape[1] - lanes) * d)
                    flat = [v for half in halves for v in half + pad]
                else:
                    verdict = "wrong"
                    flat = [filler] * math.prod(shape)
                tensor = Tensor.from_values("float32", shape, flat)
                answers[i] = dataclasses.replace(answer, sidecars={"confidence": tensor})
                forged = (answer.fence, verdict)
            rig.ranks.send([answers])
        assert forged is not None and forged[1] == "fits", forged
        _check_tokens_ignoring_eos(stream, prompt, 12)
        return "fits", rows
    finally:
        rig.close()


def _check_tokens_ignoring_eos(stream: Any, prompt: list[int], max_tokens: int) -> None:
    tokens, reason = reference(prompt, max_tokens, ignore_eos=True)
    result = stream.result(timeout=0)
    assert (result.token_ids, result.finish_reason) == (tokens, reason)
