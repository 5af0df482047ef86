"""The engine with ``EngineConfig(direct=True)`` against fake rank processes.

The fake ranks (``tests/support/fake_rank.py``) check every frame against
their slot state and "sample" deterministically, so each request's tokens are
known in advance: direct mode must deliver exactly those, free every page and
slot, and trace every frame.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.coordinator.engine import CANCELLED, Engine, EngineConfig
from runtime.direct import DirectScheduler
from runtime.trace.writer import TraceOptions
from tests.support import fake_rank
from tests.support.fake_rank import FakeSpec, join_ranks, reference, spawn_ranks

pytestmark = pytest.mark.process

WAIT_S = 20.0


class Served:
    def __init__(self, world_size: int, **config) -> None:
        self.engine = Engine(
            EngineConfig(
                world_size=world_size, direct=True, handshake_timeout_s=WAIT_S,
                catalog_timeout_s=WAIT_S, completion_timeout_s=WAIT_S, **config,
            )
        )  # fmt: skip
        self.processes = spawn_ranks(self.engine.bind(), world_size, FakeSpec())

    def close(self) -> list[int | None]:
        self.engine.stop()
        return join_ranks(self.processes)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def served(request, tmp_path_factory) -> Iterator[Served]:
    s = Served(request.param, max_slots=8)
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    s.engine.enable_trace(TraceOptions(str(path)))
    s.engine.start()
    s.engine.run_in_thread()
    s.trace_path = path  # type: ignore[attr-defined]
    yield s
    assert s.close() == [fake_rank.EXIT_OK] * request.param


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(fake_rank.VOCAB) for _ in range(rng.randint(1, 200))], rng.randint(1, 24))
        for _ in range(n)
    ]


def test_direct_mode_delivers_exactly_the_reference_tokens(served: Served) -> None:
    engine = served.engine
    assert isinstance(engine.scheduler, DirectScheduler)
    cases = workload(20, seed=3)
    streams = [engine.submit(prompt, max_tokens) for prompt, max_tokens in cases]
    for stream, (prompt, max_tokens) in zip(streams, cases):
        result = stream.result(timeout=WAIT_S)
        assert (result.token_ids, result.finish_reason) == reference(prompt, max_tokens)
    snapshot = engine.snapshot()
    assert snapshot["free_pages"] == snapshot["num_pages"]
    assert snapshot["running"] == snapshot["in_flight"] == snapshot["live_requests"] == 0
    metrics = engine.metrics()
    assert metrics["executions_total:ordinary"] > 0
    assert metrics["executions_total:discovery"] > 0
    assert any(engine.graph_estimates().values())


def test_cancel_in_direct_mode_frees_the_slot(served: Served) -> None:
    engine = served.engine
    stream = engine.submit([1, 2, 3], 500, ignore_eos=True)
    next(iter(stream))  # the first token arrived: it is decoding
    engine.cancel(stream)
    assert stream.result(timeout=WAIT_S).finish_reason == CANCELLED
    after = engine.submit([4, 5, 6], 5)
    assert after.result(timeout=WAIT_S).token_ids == reference([4, 5, 6], 5)[0]


def test_the_trace_has_one_line_per_frame(served: Served) -> None:
    engine = served.engine
    assert engine.trace.writer.flush()
    earlier = [json.loads(line)["fence"] for line in engine.trace.lines_since(0)]
    stream = engine.submit([9, 8, 7], 4)
    assert stream.result(timeout=WAIT_S).token_ids == reference([9, 8, 7], 4)[0]
    assert engine.trace.writer.flush()
    frames = [json.loads(line) for line in engine.trace.lines_since(max(earlier, default=0))]
    # Alone, the request runs one frame per token: its prompt (the first token), then 3 rounds.
    assert [line["kind"] for line in frames] == ["prefill", "decode", "decode", "decode"]
    assert all(line["requests"] == [frames[0]["requests"][0]] for line in frames)
    assert {line["reason"] for line in frames} <= {"ordinary", "discovery"}
    assert all(line["refresh_credit_ns"] == line["learning_credit_ns"] == 0 for line in frames)
    assert frames[0]["lanes"]["max_tokens"] == [1]
    assert [line["lanes"]["output_start"] for line in frames] == [[0], [1], [2], [3]]
    assert Path(served.trace_path).stat().st_size > 0  # type: ignore[attr-defined]
