"""Rank processes started as torchrun would start them, driven over real sockets."""

from __future__ import annotations

import os

import msgpack
import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.deploy.launch import spawn_ranks, stop_ranks
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.completion import Completion
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams
from tests.support.checkpoints import greedy, write_tiny
from tests.support.rank_messages import collect

pytestmark = pytest.mark.process

PROMPT = [5, 17, 33, 3, 60, 9, 41]
NEW = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    model = write_tiny("llama", path, seed=3, vocab=96, max_positions=128, tie=True)
    return path, greedy(model, [PROMPT], NEW)[0]


def start_ranks(model_dir, channel: CoordinatorChannel, world: int, tmp_path) -> list:
    args = [
        "--model",
        str(model_dir),
        "--max-concurrency",
        "2",
        "--max-prefill-tokens",
        "64",
        "--num-pages",
        "16",
        "--device",
        "cpu",
    ]
    return spawn_ranks(
        channel.endpoints, world, args, env=dict(os.environ, FLARE_HOME=str(tmp_path))
    )


@pytest.mark.parametrize("world", [1, 2])
def test_rank_processes_generate_transformers_tokens(checkpoint, tmp_path, world, capfd):
    model_dir, expected = checkpoint
    channel = CoordinatorChannel(world)
    procs = start_ranks(model_dir, channel, world, tmp_path)
    try:
        channel.handshake(timeout_s=120.0)
        reports = collect(channel, CatalogReport, world, 120_000)
        assert [r.rank for r in reports] == list(range(world))
        assert len({r.descriptors for r in reports}) == 1
        pages = tuple(range(8))  # the request's table, on its prefill lane only
        prefill = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
        decode = GraphDescriptor(GraphKind.DECODE, 1)
        first = FrameLane(0, 1, "prefill", 0, tuple(PROMPT), 0, pages, 1, SamplingParams())
        frames = [Frame.from_lanes(1, prefill, [first])]
        for i in range(NEW - 1):
            lane = FrameLane(0, 1, "decode", 0, (), len(PROMPT) + i, (), 1)
            frames.append(Frame.from_lanes(2 + i, decode, [lane]))
        tokens = []
        # The prefill alone, then decode frames two at a time: the second is sent
        # before the first completes, as the coordinator queues them.
        for batch in (frames[:1], frames[1:3], frames[3:]):
            for frame in batch:
                channel.publish(frame)
            completions = collect(channel, Completion, world * len(batch))
            fences = [frame.fence for frame in batch for _ in range(world)]
            assert [c.fence for c in completions] == fences
            assert [c.rank for c in completions] == list(range(world)) * len(batch)
            assert all(c.device_ns > 0 and c.error is None for c in completions)
            for c in completions:
                if c.rank == 0:
                    tokens += c.lane_results()[0].tokens
                else:
                    assert c.num_lanes == 0  # only rank 0 reports lanes
        assert tokens == expected
        # Garbage and a wrong protocol version on the frame socket are logged and
        # skipped by every rank process (raw bytes: the channel itself refuses to
        # build such messages).
        channel._pub.send(b"\x93not a frame")
        channel._pub.send(msgpack.packb({"v": 999, "t": "Frame", "b": {}}))
        # A frame the ranks cannot run (a slot with no state) is answered with an
        # error completion by every rank, and they keep serving.
        bad = Frame.from_lanes(99, decode, [FrameLane(3, 1, "decode", 0, (), 5, (), 1)])
        channel.publish(bad)
        errors = collect(channel, Completion, world)
        assert all(c.fence == 99 and "slot 3" in (c.error or "") for c in errors)
        logged = capfd.readouterr().err
        assert logged.count("version 999") == world, logged[-2000:]
        channel.shutdown_ranks()
        assert stop_ranks(procs, timeout_s=60) == [0] * world
    finally:
        stop_ranks(procs, timeout_s=0)
        channel.close()
