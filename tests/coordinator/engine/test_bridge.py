"""Admission groups through the engine and the frontend bridge: the choices of one
HTTP request share a group, and residency goes round-robin across groups."""

from __future__ import annotations

import asyncio
import threading

import pytest

from runtime.coordinator.engine import Engine, EngineConfig
from runtime.coordinator.engine.bridge import FrontendBridge, ServingInfo
from runtime.frontend.client import CoordinatorClient
from runtime.transport.sampling import SamplingParams
from tests.support import fake_rank
from tests.support.fake_rank import FakeSpec, join_ranks, spawn_ranks

pytestmark = pytest.mark.process

WAIT_S = 20.0
SPEC = FakeSpec(sleep_s=0.002)


def started_engine() -> tuple[Engine, list]:
    engine = Engine(
        EngineConfig(
            world_size=1,
            max_slots=1,
            handshake_timeout_s=WAIT_S,
            catalog_timeout_s=WAIT_S,
            completion_timeout_s=WAIT_S,
        )
    )
    processes = spawn_ranks(engine.bind(), 1, SPEC)
    engine.start()
    return engine, processes


def first_token_order(streams: dict[str, object]) -> list[str]:
    """Names ordered by when their request's first token was published."""
    first = {}
    for name, stream in streams.items():
        event = stream.get(timeout=WAIT_S)
        assert event.token_ids
        first[name] = event.at_ns
        stream.result(timeout=WAIT_S)
    return sorted(first, key=first.get)


def test_the_engine_admits_groups_round_robin() -> None:
    engine, processes = started_engine()
    try:
        streams = {}  # every submission is queued before the loop admits any
        for i in range(4):
            streams[f"big{i}"] = engine.submit([5, 6, 7], 8, ignore_eos=True, group=1)
        streams["small"] = engine.submit([8, 9], 8, ignore_eos=True, group=2)
        engine.run_in_thread()
        # big0 takes the only slot; then the groups alternate: big1, small, big2, big3.
        assert first_token_order(streams) == ["big0", "big1", "small", "big2", "big3"]
    finally:
        engine.stop()
        assert join_ranks(processes) == [fake_rank.EXIT_OK]


@pytest.mark.parametrize("group", [True, 1.5, "g"])
def test_a_bad_group_is_refused_naming_it(group) -> None:
    engine, processes = started_engine()
    try:
        with pytest.raises(ValueError, match="group"):
            engine.submit([1, 2], 4, group=group)
    finally:
        engine.stop()
        assert join_ranks(processes) == [fake_rank.EXIT_OK]


def test_the_bridge_carries_the_group_from_the_frontend() -> None:
    engine, processes = started_engine()
    client = CoordinatorClient()
    info = ServingInfo(fake_rank.MODEL, fake_rank.VOCAB, fake_rank.MAX_CONTEXT, 1, 1, 4096)
    bridge = FrontendBridge(engine, client.endpoints, info)
    thread = threading.Thread(target=bridge.serve, daemon=True)
    seen = []
    original = engine.submit

    def spy(*args, **kwargs):
        seen.append(kwargs.get("group"))
        return original(*args, **kwargs)

    engine.submit = spy  # type: ignore[method-assign]

    async def go() -> None:
        await client.wait_ready(WAIT_S)
        sampling = SamplingParams(seed=1)
        queues = [client.submit(i, (5, 6), 4, sampling, True, group=7) for i in (1, 2)]
        queues.append(client.submit(3, (5, 6), 4, sampling, True))
        for queue in queues:
            while not (await asyncio.wait_for(queue.get(), WAIT_S)).finished:
                pass
        await client.close()

    engine.run_in_thread()
    thread.start()
    try:
        asyncio.run(go())
        assert seen == [7, 7, None]
    finally:
        bridge.stop()
        thread.join(WAIT_S)
        bridge.close()
        engine.stop()
        assert join_ranks(processes) == [fake_rank.EXIT_OK]
