"""The engine against fake rank processes over real sockets.

Each fake rank is a spawned process speaking the rank protocol (handshake,
catalog report, one completion per frame, shutdown) with deterministic
"sampling" (``tests/support/fake_rank.py``), so every request's tokens are
known in advance.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from runtime.coordinator.engine import CANCELLED, Engine, EngineConfig, EngineStartError
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.codec import encode
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.security import secure_client
from tests.support import fake_rank
from tests.support.fake_rank import FakeSpec, join_ranks, reference, spawn_ranks

pytestmark = pytest.mark.process

WAIT_S = 20.0


class Served:
    """An engine started against fake rank processes."""

    def __init__(self, world_size: int, spec: FakeSpec, **config: Any) -> None:
        config.setdefault("handshake_timeout_s", WAIT_S)
        config.setdefault("catalog_timeout_s", WAIT_S)
        config.setdefault("completion_timeout_s", WAIT_S)
        self.engine = Engine(EngineConfig(world_size=world_size, **config))
        self.processes = spawn_ranks(
            self.engine.bind(), world_size, spec, keys=self.engine.rank_keys()
        )

    def start(self, thread: bool = True) -> Served:
        self.engine.start()
        if thread:
            self.engine.run_in_thread()
        return self

    def close(self) -> list[int | None]:
        self.engine.stop()
        return join_ranks(self.processes)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[Engine]:
    served = Served(1, FakeSpec(), max_slots=32).start()
    yield served.engine
    assert served.close() == [fake_rank.EXIT_OK]


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(fake_rank.VOCAB) for _ in range(rng.randint(1, 200))], rng.randint(1, 24))
        for _ in range(n)
    ]


def run(engine: Engine, cases: list[tuple[list[int], int]]) -> list[Any]:
    streams = [engine.submit(prompt, max_tokens) for prompt, max_tokens in cases]
    results = [stream.result(timeout=WAIT_S) for stream in streams]
    for (prompt, max_tokens), result in zip(cases, results):
        assert (result.token_ids, result.finish_reason) == reference(prompt, max_tokens)
    return results


def test_handshake_and_catalog(one_rank: Engine) -> None:
    facts = one_rank.facts
    assert facts is not None
    assert facts.descriptors == fake_rank.DESCRIPTORS
    assert (facts.vocab_size, facts.max_context) == (fake_rank.VOCAB, fake_rank.MAX_CONTEXT)
    assert (facts.page_size, facts.num_pages) == (fake_rank.PAGE_SIZE, fake_rank.NUM_PAGES)
    assert one_rank.endpoints.frames.startswith("ipc://")


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_concurrent_requests_get_exactly_their_tokens(one_rank: Engine, concurrency: int) -> None:
    before = one_rank.stats.counters()
    results = run(one_rank, workload(concurrency, seed=concurrency))
    after = one_rank.stats.counters()
    if concurrency == 32:
        assert {r.finish_reason for r in results} == {"stop", "length"}
    sent = after["frames_sent"] - before["frames_sent"]
    assert sent == after["frames_completed"] - before["frames_completed"] > 0
    assert after["tokens_out"] - before["tokens_out"] == sum(len(r.token_ids) for r in results)
    snapshot = one_rank.snapshot()
    assert snapshot["free_pages"] == snapshot["num_pages"]
    assert snapshot["running"] == snapshot["in_flight"] == snapshot["live_requests"] == 0
    summary = one_rank.stats.summary()
    assert summary["frames"] >= sent and summary["host_overhead_ratio"] >= 1.0


def test_round_trip_probe_waits_for_an_empty_window_and_leaves_requests_intact(
    one_rank: Engine,
) -> None:
    cases = workload(6, seed=17)
    streams = [one_rank.submit(prompt, max_tokens) for prompt, max_tokens in cases]
    trips = one_rank.measure_round_trip(25)
    assert len(trips) == 25 and min(trips) > 0
    for stream, (prompt, max_tokens) in zip(streams, cases):
        result = stream.result(timeout=WAIT_S)
        assert (result.token_ids, result.finish_reason) == reference(prompt, max_tokens)
    with pytest.raises(ValueError, match="count"):
        one_rank.measure_round_trip(0)


def test_spinning_engine_serves_the_same_tokens() -> None:
    served = Served(2, FakeSpec(), max_slots=8, poll_spin_us=300).start(thread=False)
    try:
        streams = [served.engine.submit(p, m) for p, m in workload(8, seed=3)]
        assert len(served.engine.measure_round_trip(5)) == 5  # driven by step()
        deadline = time.monotonic() + WAIT_S
        while not all(s.finished for s in streams) and time.monotonic() < deadline:
            served.engine.step(20)
        for stream, (prompt, max_tokens) in zip(streams, workload(8, seed=3)):
            result = stream.result(timeout=0)
            assert (result.token_ids, result.finish_reason) == reference(prompt, max_tokens)
    finally:
        assert served.close() == [fake_rank.EXIT_OK] * 2


def test_external_publication_is_applied_before_the_next_completion() -> None:
    served = Served(1, FakeSpec(), max_slots=4, external_publication=True).start(thread=False)
    engine = served.engine
    try:
        stream = engine.submit([5, 6, 7], 6, ignore_eos=True)
        event = None
        while event is None or not event.token_ids:
            engine.step(20)
            try:
                event = stream.get(timeout=0)
            except TimeoutError:
                event = None
        live = engine._by_request[stream.request_id]
        request = engine.scheduler.request(live.handle)
        assert event.fence in request.unpublished  # nobody published it yet
        assert request.last_visible_ns is None
        seen_at = time.monotonic_ns()
        engine.publish(stream, event.fence, seen_at)
        engine.step(20)  # the publication goes in before anything else
        assert event.fence not in request.unpublished
        assert request.last_visible_ns == seen_at
        # A late or repeated publication is ignored, not fatal.
        engine.publish(stream, event.fence, seen_at + 1)
        while not stream.finished:
            engine.step(20)
        assert stream.result(timeout=0).token_ids == reference([5, 6, 7], 6, ignore_eos=True)[0]
        with pytest.raises(ValueError, match="publish"):
            engine.publish(object(), 1, 1)  # type: ignore[arg-type]
    finally:
        assert served.close() == [fake_rank.EXIT_OK]


def test_mismatched_catalog_is_refused() -> None:
    spec = FakeSpec(per_rank={1: {"num_pages": 256}}, idle_exit_s=WAIT_S)
    served = Served(2, spec, shutdown_grace_s=0.2)
    try:
        match = "ranks disagree on num_pages: rank 0 has 512, rank 1 has 256"
        with pytest.raises(EngineStartError, match=match):
            served.start()
    finally:
        assert served.close() == [fake_rank.EXIT_OK] * 2  # told to shut down


def test_slower_rank_sets_the_estimate_and_malformed_input_is_survived() -> None:
    spec = FakeSpec(per_rank={1: {"sleep_s": 0.004}})
    endpoints = ChannelEndpoints("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    served = Served(2, spec, endpoints=endpoints, max_slots=8).start()
    engine = served.engine
    context = zmq.Context()
    raw = context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    keys = engine.rank_keys()  # a TCP engine made CURVE keys for this run
    assert keys is not None
    secure_client(raw, keys)  # an authenticated peer's garbage reaches the decoder
    try:
        raw.connect(engine.endpoints.completions)
        raw.send(b"garbage")
        raw.send(encode(Control("ready", 1, 5)))  # a late handshake reply: dropped
        raw.send(encode(Completion(10_000, 1, 2, device_ns=1)))  # not in flight
        run(engine, workload(8, seed=11))
        deadline = time.monotonic() + WAIT_S
        while engine.rejected_messages < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.stats.counters()["ignored_messages"] == 1
        frames = engine.stats.frames()
        assert frames and all(f.rank_device_ns[1] >= 4_000_000 for f in frames)
        assert all(f.rank_device_ns[0] < f.rank_device_ns[1] for f in frames)
        catalog = engine.scheduler.catalog
        estimates = [catalog.entry(d).estimate_ns for d in fake_rank.DESCRIPTORS]
        observed = [e for e in estimates if e]
        assert observed and min(observed) >= 4_000_000
    finally:
        raw.close()
        context.term()
        assert served.close() == [fake_rank.EXIT_OK] * 2


def test_cancelled_request_frees_its_slot_for_the_next() -> None:
    served = Served(1, FakeSpec(sleep_s=0.001), max_slots=1).start()
    engine = served.engine
    try:
        first = engine.submit([3, 1, 4, 1, 5], 3000, ignore_eos=True)
        second = engine.submit([9, 2, 6], 5)  # waits for the only slot
        events = [first.get(timeout=WAIT_S) for _ in range(3)]
        assert not any(e.finished for e in events)
        engine.cancel(first)
        result = first.result(timeout=WAIT_S)
        assert result.finish_reason == CANCELLED and len(result.token_ids) < 3000
        tail = list(first)
        assert tail[-1].finished and tail[-1].finish_reason == CANCELLED
        assert (
            result.token_ids
            == reference([3, 1, 4, 1, 5], 3000, ignore_eos=True)[0][: len(result.token_ids)]
        )
        assert second.result(timeout=WAIT_S).token_ids == reference([9, 2, 6], 5)[0]
        assert (second.slot, second.generation) == (first.slot, first.generation + 1)
        assert engine.stats.counters()["requests_cancelled"] == 1
    finally:
        assert served.close() == [fake_rank.EXIT_OK]
