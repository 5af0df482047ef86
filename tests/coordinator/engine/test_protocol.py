"""The engine against fake ranks living in the test's own process (real sockets).

The test drives both sides step by step, so it controls exactly when and in
which order completions arrive: fence ordering, duplicates, unknown fences,
malformed messages, refused results and timeouts.
"""

# The rig_factory fixture comes from tests.support.engine_rig; tests take it by name.
# ruff: noqa: F811

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pytest
import zmq

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import ConfigError, PolicyConfig
from runtime.coordinator.engine import (
    ABORTED,
    CANCELLED,
    ERROR,
    Engine,
    EngineConfig,
    EngineError,
    EngineStartError,
    agree,
)
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.codec import encode
from runtime.transport.columns import column
from runtime.transport.completion import Completion
from runtime.transport.sampling import SamplingParams
from tests.support import fake_rank
from tests.support.engine_rig import WAIT_S, Rig, check, prompts, rig_factory  # noqa: F401
from tests.support.fake_rank import FakeSpec, LocalRanks, reference

# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": True}, "world_size"),
        ({"max_slots": 65}, "max_slots"),
        ({"max_slots": 0}, "max_slots"),
        ({"policy": "balanced"}, "policy"),
        ({"handshake_timeout_s": 0}, "handshake_timeout_s"),
        ({"catalog_timeout_s": float("nan")}, "catalog_timeout_s"),
        ({"completion_timeout_s": -1}, "completion_timeout_s"),
        ({"shutdown_grace_s": -1}, "shutdown_grace_s"),
        ({"endpoints": "tcp://127.0.0.1:1"}, "endpoints"),
        ({"endpoints": ChannelEndpoints("ipc:///tmp/a", "ipc:///tmp/b")}, "endpoints"),
        ({"endpoints": ChannelEndpoints("tcp://127.0.0.1:1", "tcp://[::1]:2")}, "endpoints"),
        ({"endpoints": ChannelEndpoints("tcp://127.0.0.1:x", "tcp://127.0.0.1:2")}, "endpoints"),
        ({"frame_stats": -1}, "frame_stats"),
        ({"poll_spin_us": -1}, "poll_spin_us"),
        ({"poll_spin_us": 0.5}, "poll_spin_us"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kwargs)


def test_tcp_endpoints_bind_loopback_and_remote_hosts_are_refused() -> None:
    config = EngineConfig(endpoints=ChannelEndpoints("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"))
    with Engine(config) as engine:
        endpoints = engine.bind()
        assert endpoints.frames.startswith("tcp://127.0.0.1:")
        assert not endpoints.frames.endswith(":0")
    remote = EngineConfig(endpoints=ChannelEndpoints("tcp://10.1.2.3:0", "tcp://10.1.2.3:0"))
    with pytest.raises(EngineStartError, match="loopback"):
        Engine(remote).bind()


# ---------------------------------------------------------------- catalog agreement


def reports(world_size: int = 2, **overrides: Any) -> dict:
    spec = FakeSpec(per_rank={1: overrides})
    return {r: fake_rank.FakeRank(spec, r, world_size).report() for r in range(world_size)}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"vocab_size": 102}, "vocab_size"),
        ({"max_context": 2048}, "max_context"),
        ({"page_size": 32}, "page_size"),
        ({"num_pages": 64}, "num_pages"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"weights_digest": "9" * 64}, "weights_digest"),
    ],
)
def test_agreement_names_the_rank_and_field(override: dict, field: str) -> None:
    with pytest.raises(
        EngineStartError, match=rf"ranks disagree on {field}: rank 0 has .*, rank 1 has"
    ):
        agree(reports(**override))
    # The directory's name is for display: it is not compared.
    assert agree(reports(model_name="other")).model_name == fake_rank.MODEL


def test_agreement_names_the_differing_descriptors() -> None:
    fewer = fake_rank.DESCRIPTORS[:-1]
    with pytest.raises(EngineStartError, match=r"descriptors: only on rank 0: decode B=32"):
        agree(reports(descriptors=fewer))
    facts = agree(reports())
    assert facts.descriptors == fake_rank.DESCRIPTORS
    assert facts.max_decode_batch == 32


def test_agreement_needs_prefill_and_decode() -> None:
    spec = FakeSpec(descriptors=fake_rank.DESCRIPTORS[2:])
    with pytest.raises(EngineStartError, match="no prefill program"):
        agree({0: fake_rank.FakeRank(spec, 0, 1).report()})


def test_handshake_timeout_names_the_missing_rank() -> None:
    engine = Engine(EngineConfig(world_size=2, handshake_timeout_s=0.2, shutdown_grace_s=0))
    ranks = LocalRanks(engine.bind(), 1, FakeSpec())  # only rank 0 of 2 shows up
    threads = ranks.handshake_in_background(report=False)
    try:
        with pytest.raises(EngineStartError, match=r"rank\(s\) \[1\].*handshake_timeout_s"):
            engine.start()
        with pytest.raises(EngineError, match="not started"):
            engine.submit([1], 1)
    finally:
        for thread in threads:
            thread.join(WAIT_S)
        engine.stop()
        ranks.close()


def test_catalog_timeout_names_the_silent_rank() -> None:
    engine = Engine(EngineConfig(world_size=1, catalog_timeout_s=0.2, shutdown_grace_s=0))
    ranks = LocalRanks(engine.bind(), 1, FakeSpec())
    threads = ranks.handshake_in_background(report=False)
    try:
        with pytest.raises(EngineStartError, match=r"no catalog report from rank\(s\) \[0\]"):
            engine.start()
    finally:
        for thread in threads:
            thread.join(WAIT_S)
        engine.stop()
        ranks.close()


# ---------------------------------------------------------------- submission


def test_submit_validation_names_the_argument(rig_factory: Any) -> None:
    rig = rig_factory().start()
    engine = rig.engine
    cases = [
        (([], 4), "prompt_token_ids must not be empty"),
        (("abc", 4), "prompt_token_ids must be a sequence"),
        (([1, fake_rank.VOCAB], 4), r"prompt_token_ids\[1\] = 101 is outside the vocabulary"),
        (([1, -1], 4), r"prompt_token_ids\[1\] = -1 is outside"),
        (([1, True], 4), r"prompt_token_ids\[1\] must be an integer"),
        (([1, 2.0], 4), r"prompt_token_ids\[1\] must be an integer"),
        (([1], 0), "max_tokens must be a positive integer"),
        (([1], 2.5), "max_tokens must be a positive integer"),
        (([1] * 4000, 97), r"\+ max_tokens \(97\) = 4097 exceeds the model's max_context 4096"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.submit(*args)
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        engine.submit([1], 1, sampling={"temperature": 0})
    with pytest.raises(ValueError, match="ignore_eos must be a bool"):
        engine.submit([1], 1, ignore_eos=1)
    assert engine.stats.counters()["requests_submitted"] == 0


def test_pages_beyond_the_pool_are_refused(rig_factory: Any) -> None:
    rig = rig_factory(spec=FakeSpec(num_pages=4)).start()  # 64 tokens of KV
    with pytest.raises(ValueError, match="need 5 KV pages of 16 tokens, the ranks hold 4"):
        rig.engine.submit([1] * 60, 5)
    stream = rig.engine.submit([1] * 60, 4)
    rig.drive([stream])
    check(stream, [1] * 60, 4)


# ---------------------------------------------------------------- completions


def test_tokens_follow_the_fake_model_and_ignore_eos(rig_factory: Any) -> None:
    rig = rig_factory(max_slots=8).start()
    # A prompt whose reference stops at eos after a few tokens.
    stopping = next(p for p in prompts(500, seed=5, hi=20) if len(reference(p, 30)[0]) < 30)
    cases = [(stopping, 30, False), (stopping, 30, True)]
    cases += [(p, 12, False) for p in prompts(6, seed=1)]
    streams = [rig.engine.submit(p, n, SamplingParams(), ignore_eos=i) for p, n, i in cases]
    rig.drive(streams)
    for stream, (prompt, n, ignore) in zip(streams, cases):
        check(stream, prompt, n, ignore)
    assert streams[0].finish_reason == "stop" and streams[1].finish_reason == "length"
    assert len(streams[1].token_ids) == 30
    events = list(streams[2])
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    assert [t for e in events for t in e.token_ids] == streams[2].token_ids
    with pytest.raises(EOFError):
        streams[2].get(timeout=0)
    snap = rig.engine.snapshot()
    assert snap["free_pages"] == snap["num_pages"] and snap["live_requests"] == 0
    # Frames release retired slots on the ranks, and once the engine is idle an
    # empty frame releases the last tenant's: nothing is left held.
    last = rig.engine.submit([4, 2], 3)
    rig.drive([last])
    check(last, [4, 2], 3)
    deadline = time.monotonic() + WAIT_S
    while rig.ranks.fakes[0].slots:
        assert time.monotonic() < deadline, "the last tenant's slot was never released"
        rig.engine.step(0)
        rig.ranks.serve(timeout_ms=1)


def test_each_generation_appends_its_pages_as_its_context_grows(rig_factory: Any) -> None:
    """Pages on demand: a generation's lanes append pages as its context grows,
    each page once; its table ends holding its context (prompt + output - 1)."""
    rig = rig_factory(2, max_slots=2).start()
    cases = [(p, 40) for p in prompts(6, seed=9, lo=60, hi=150)]  # chunked prefills
    streams = [rig.engine.submit(p, n, ignore_eos=True) for p, n in cases]
    rig.drive(streams)
    for stream, (prompt, n) in zip(streams, cases):
        check(stream, prompt, n, ignore_eos=True)
    size = fake_rank.PAGE_SIZE
    for fake in rig.ranks.fakes:  # every rank gets the same frames
        by_generation: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        for _, slot, generation, pages in fake.appended:
            by_generation.setdefault((slot, generation), []).append(pages)
        assert len(by_generation) == len(cases)
        assert {slot for slot, _ in by_generation} == {0, 1}  # both slots reused
        tables = []
        for (slot, _), appended in by_generation.items():
            table = [page for pages in appended for page in pages]
            assert len(set(table)) == len(table), (slot, appended)
            assert sum(1 for pages in appended if pages) > 1  # appended as it grew
            tables.append(len(table))
        needed = [-(-(len(p) + n - 1) // size) for p, n in cases]
        assert sorted(tables) == sorted(needed)  # never more than the context needs


def test_completions_are_applied_in_fence_order(rig_factory: Any) -> None:
    # A long fixed interval keeps the head frame "on time", so decode frames queue.
    spec = FakeSpec(device_ns=50_000_000)
    rig = rig_factory(2, spec, max_slots=4).start()
    cases = [(p, 40) for p in prompts(3, seed=2, hi=10)]
    streams = [rig.engine.submit(p, n, ignore_eos=True) for p, n in cases]
    rig.drive(streams, reverse=True)
    for stream, (prompt, n) in zip(streams, cases):
        check(stream, prompt, n, ignore_eos=True)
    assert rig.ranks.reordered > 0  # a later fence arrived complete before an earlier one
    frames = rig.engine.stats.frames()
    assert [f.fence for f in frames] == sorted(f.fence for f in frames)
    assert any(f.queued for f in frames)
    assert rig.engine.stats.counters()["ignored_messages"] == 0


def test_largest_rank_interval_is_the_cost_sample(rig_factory: Any) -> None:
    spec = FakeSpec(per_rank={0: {"device_ns": 1_000_000}, 1: {"device_ns": 3_000_000}})
    rig = rig_factory(2, spec).start()
    streams = [rig.engine.submit(p, 8, ignore_eos=True) for p in prompts(4, seed=3)]
    rig.drive(streams)
    catalog = rig.engine.scheduler.catalog
    observed = [catalog.entry(d).estimate_ns for d in fake_rank.DESCRIPTORS]
    assert any(observed)
    assert set(observed) <= {0, 3_000_000}
    for frame in rig.engine.stats.frames():
        assert frame.rank_device_ns == (1_000_000, 3_000_000)
        assert frame.device_ns == 3_000_000


def test_readiness_delay_is_the_largest_and_reduces_the_sample(rig_factory: Any) -> None:
    spec = FakeSpec(
        device_ns=2_000_000,
        per_rank={0: {"readiness_delay_ns": 100_000}, 1: {"readiness_delay_ns": 500_000}},
    )
    rig = rig_factory(2, spec).start()
    stream = rig.engine.submit([5, 6, 7], 4)
    rig.drive([stream])
    prefill64 = fake_rank.DESCRIPTORS[0]
    assert rig.engine.scheduler.catalog.entry(prefill64).estimate_ns == 1_500_000
    assert {f.readiness_delay_ns for f in rig.engine.stats.frames()} == {500_000}


def test_unknown_fence_duplicate_rank_and_malformed_bytes_are_ignored(
    rig_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rig = rig_factory(2).start()
    engine, ranks = rig.engine, rig.ranks
    prompt = [9, 8, 7, 6]
    stream = engine.submit(prompt, 3)
    while not engine.in_flight_fences:
        engine.step(10)
    (fence,) = engine.in_flight_fences
    rank0, rank1 = ranks.take(timeout_ms=int(WAIT_S * 1000))
    context = zmq.Context()
    raw = context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(engine.endpoints.completions)
        with caplog.at_level(logging.WARNING):
            raw.send(b"\x93not msgpack")
            raw.send(encode(Completion(fence + 100, 1, 2, device_ns=5)))
            ranks.send([[], rank1 + rank1])  # rank 1 answers twice
            deadline = time.monotonic() + WAIT_S
            while engine.stats.counters()["ignored_messages"] < 2:
                assert time.monotonic() < deadline
                engine.step(10)
            assert engine.in_flight_fences == [fence]  # rank 0 has not answered
            ranks.send([rank0, []])
            rig.drive([stream])
    finally:
        raw.close()
        context.term()
    check(stream, prompt, 3)
    assert engine.rejected_messages == 1
    assert engine.stats.counters()["ignored_messages"] == 2
    text = caplog.text
    assert "malformed msgpack" in text
    assert f"fence {fence + 100}: not in flight" in text
    assert f"duplicate completion from rank 1 for fence {fence}" in text


def test_refused_results_fail_the_engine_and_end_the_streams(rig_factory: Any) -> None:
    rig = rig_factory(1).start()
    engine, ranks = rig.engine, rig.ranks
    stream = engine.submit([1, 2, 3], 5)
    while not engine.in_flight_fences:
        engine.step(10)
    ((done,),) = ranks.take(timeout_ms=int(WAIT_S * 1000))
    wrong = column(generation + 1 for generation in done.generation)
    ranks.send([[dataclasses.replace(done, generation=wrong)]])
    with pytest.raises(EngineError, match="rank 0's results were refused"):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            engine.step(10)
    assert stream.result(timeout=0).finish_reason == ERROR
    assert isinstance(stream.error, EngineError)
    with pytest.raises(EngineError, match="failed"):
        engine.submit([1], 1)


def test_an_error_completion_fails_the_engine_at_once(rig_factory: Any) -> None:
    rig = rig_factory(2).start()
    engine, ranks = rig.engine, rig.ranks
    stream = engine.submit([1, 2, 3], 5)
    while not engine.in_flight_fences:
        engine.step(10)
    rank0, (rank1,) = ranks.take(timeout_ms=int(WAIT_S * 1000))
    error = Completion(rank1.fence, 1, 2, 0, error="rejected: slot 0 has no state")
    ranks.send([rank0, [error]])
    with pytest.raises(EngineError, match=r"rank 1 could not run frame .*slot 0 has no state"):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            engine.step(10)
    assert stream.result(timeout=0).finish_reason == ERROR


def test_a_missing_completion_times_out_naming_the_rank(rig_factory: Any) -> None:
    rig = rig_factory(2, completion_timeout_s=0.2).start()
    engine = rig.engine
    stream = engine.submit([1, 2, 3], 5)
    while not engine.in_flight_fences:
        engine.step(10)
    rank0, _ = rig.ranks.take(timeout_ms=int(WAIT_S * 1000))
    rig.ranks.send([rank0, []])
    with pytest.raises(EngineError, match=r"no completion from rank\(s\) \[1\] within 0.2 s"):
        for _ in range(100):
            engine.step(20)
    assert stream.finish_reason == ERROR


def test_cancel_and_stop(rig_factory: Any) -> None:
    rig = rig_factory(1, max_slots=1).start()
    engine = rig.engine
    running = engine.submit([1, 2, 3], 500, ignore_eos=True)
    waiting = engine.submit([4, 5], 500)
    with pytest.raises(TimeoutError, match=r"no token event within 0\.01 s"):
        running.get(timeout=0.01)
    while len(running.token_ids) < 3:
        engine.step(0)
        rig.ranks.serve(timeout_ms=1)
    engine.cancel(waiting)  # never resident: ends at once with no tokens
    engine.step(0)
    assert waiting.result(timeout=0).token_ids == []
    assert waiting.finish_reason == CANCELLED
    late = engine.submit([7, 7, 7], 500)
    engine.step(0)
    rig.ranks.serve(timeout_ms=1)
    engine.stop()
    assert running.finish_reason == ABORTED and late.finish_reason == ABORTED
    assert 3 <= len(running.token_ids) < 500
    with pytest.raises(EngineError, match="stopped"):
        engine.submit([1], 1)
    engine.cancel(running)  # no effect after stop
    engine.stop()  # idempotent


def test_step_refuses_while_the_engine_thread_runs(rig_factory: Any) -> None:
    rig = rig_factory(1).start()
    rig.engine.run_in_thread()
    with pytest.raises(EngineError, match="own thread"):
        rig.engine.step(0)
    with pytest.raises(EngineError, match="already running"):
        rig.engine.run_in_thread()


def test_policy_reaches_the_scheduler(rig_factory: Any) -> None:
    policy = PolicyConfig.preset("throughput")
    rig = rig_factory(1, policy=policy).start()
    assert rig.engine.scheduler.policy is policy
    assert rig.engine.scheduler.config.max_slots == 32  # the largest decode batch
    assert rig.engine.facts.model_name == fake_rank.MODEL
    assert GraphDescriptor(GraphKind.DECODE, 32) in rig.engine.facts.descriptors
