"""Rank inspection: Control("inspect") answered by every rank process with its
slots in use, programs (capture status), frames run and memory."""

from __future__ import annotations

import os

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.deploy.launch import spawn_ranks, stop_ranks
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.inspection import RankStatus
from runtime.transport.sampling import SamplingParams
from tests.support.checkpoints import write_tiny

pytestmark = pytest.mark.process

PROMPT = [5, 17, 33, 3, 60, 9, 41]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect")
    write_tiny("llama", path, seed=3, vocab=96, max_positions=128)
    return path


def collect(channel, kind, count):
    got = []
    while len(got) < count:
        message = channel.recv(timeout_ms=60_000)
        assert message is not None, f"timed out waiting for {kind.__name__}"
        if isinstance(message, kind):
            got.append(message)
    return sorted(got, key=lambda m: m.rank)


def inspect(channel, world, nonce) -> list[RankStatus]:
    channel.publish(Control("inspect", nonce=nonce))
    statuses = collect(channel, RankStatus, world)
    assert [s.nonce for s in statuses] == [nonce] * world
    return statuses


@pytest.mark.parametrize("world", [1, 2])
def test_every_rank_reports_its_slots_programs_and_memory(checkpoint, tmp_path, world):
    channel = CoordinatorChannel(world)
    args = ["--model", str(checkpoint), "--max-concurrency", "2", "--max-prefill-tokens", "64",
            "--num-pages", "16", "--device", "cpu"]  # fmt: skip
    procs = spawn_ranks(
        channel.endpoints, world, args, env=dict(os.environ, FLARE_HOME=str(tmp_path))
    )
    try:
        channel.handshake(timeout_s=120.0)
        reports = collect(channel, CatalogReport, world)
        before = inspect(channel, world, 1)
        assert all(s.slots() == [] and s.frames == 0 and s.last_fence == -1 for s in before)
        assert before[0].programs == tuple(sorted(d.describe() for d in reports[0].descriptors))
        assert all(list(s.captured) == [0] * len(s.programs) for s in before)  # CPU: eager
        assert all(s.rss_bytes > 0 and s.kv_cache_bytes > 0 for s in before)

        prefill = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
        lane = FrameLane(1, 7, "prefill", 0, tuple(PROMPT), 0, (2, 3), 1, SamplingParams())
        channel.publish(Frame.from_lanes(1, prefill, [lane]))
        collect(channel, Completion, world)
        during = inspect(channel, world, 2)
        for status in during:
            assert status.slots() == [
                {"slot": 1, "generation": 7, "next_position": len(PROMPT), "page_count": 2,
                 "pending": 1, "step": 1}
            ]  # fmt: skip
            assert (status.frames, status.last_fence) == (1, 1)

        channel.publish(Frame(2, GraphDescriptor(GraphKind.DECODE, 1), release_slots=(1,)))
        collect(channel, Completion, world)
        after = inspect(channel, world, 3)
        assert all(s.slots() == [] for s in after)
        channel.shutdown_ranks()
        assert stop_ranks(procs, timeout_s=60) == [0] * world
    finally:
        stop_ranks(procs, timeout_s=0)
        channel.close()
