"""Speculative rounds on two rank processes (gloo), driven over real sockets:
every rank computes the same device allocation and acceptance (no broadcast),
which ``--check-ranks`` CRCs prove frame by frame; every rank publishes valid
confidence and survival sidecars, rank 0 alone the lanes; a round queued
behind another (its positions the first round's bound) continues from the
first round's actual end; the tokens are greedy decoding's."""

from __future__ import annotations

import os

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

PROMPTS = [[5, 17, 33, 3, 60, 5, 17, 33, 3, 60, 5, 17], [9, 9, 9, 41, 77, 12, 3, 50, 21]]
NEW = 20
PAGES = 8  # per slot


def test_two_ranks_agree_on_allocation_and_acceptance(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    hf = write_tiny("llama", target, seed=11)
    write_tiny("llama", draft, seed=12)
    expected = greedy(hf, PROMPTS, NEW)
    world = 2
    channel = CoordinatorChannel(world)
    args = [
        "--model", str(target), "--max-concurrency", "2", "--max-prefill-tokens", "64",
        "--num-pages", "16", "--device", "cpu", "--check-ranks", "--proposer", "draft",
        "--draft-model", str(draft), "--speculative-widths", "4", "--device-allocation",
    ]  # fmt: skip
    procs = spawn_ranks(
        channel.endpoints, world, args, env=dict(os.environ, FLARE_HOME=str(tmp_path))
    )
    try:
        channel.handshake(timeout_s=120.0)
        reports = collect(channel, CatalogReport, world, 120_000)
        device = GraphDescriptor(GraphKind.SPECULATIVE, 2, 4, 3, 4, device_allocated=True)
        exact = GraphDescriptor(GraphKind.SPECULATIVE, 2, 4, 3)
        assert all(device in r.descriptors and exact in r.descriptors for r in reports)
        out: dict[int, list[int]] = {0: [], 1: []}
        fence = 0
        prefill = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
        for slot, prompt in enumerate(PROMPTS):
            fence += 1
            pages = tuple(range(slot * PAGES, (slot + 1) * PAGES))
            lane = FrameLane(slot, 1, "prefill", 0, tuple(prompt), 0, pages, 1, SamplingParams())
            channel.publish(Frame.from_lanes(fence, prefill, [lane]))
            (first, _) = collect(channel, Completion, world)
            out[slot] += first.lane_results()[0].tokens
        held = {s: len(p) + 1 for s, p in enumerate(PROMPTS)}  # the pending token at held - 1
        rounds = 0
        while min(len(v) for v in out.values()) < NEW:
            # Two rounds in flight: the second's positions assume the first emits
            # its whole bound (4 tokens per lane), as the coordinator's do.
            batch = []
            bound = dict(held)
            for program in (device, exact):
                fence += 1
                lanes = [FrameLane(s, 1, "decode", 0, (), bound[s] - 1, (), 4) for s in (0, 1)]
                batch.append(Frame.from_lanes(fence, program, lanes))
                bound = {s: bound[s] + 4 for s in bound}
            for frame in batch:
                channel.publish(frame)
            completions = collect(channel, Completion, world * len(batch))
            for f in range(len(batch)):
                zero, one = completions[2 * f], completions[2 * f + 1]
                assert zero.error is None and one.error is None, (zero.error, one.error)
                assert zero.token_crc == one.token_crc >= 0  # the same counts and tokens
                assert one.num_lanes == 0 and set(one.sidecars) == {"confidence", "survival"}
                for c in (zero, one):
                    values = c.sidecars["confidence"].values() + c.sidecars["survival"].values()
                    assert all(0.0 <= v <= 1.0 for v in values)
                if batch[f].program.device_allocated:
                    assert sum(zero.token_count) <= 4  # P = 4 rows for two lanes
                for result in zero.lane_results():
                    out[result.slot] += result.tokens
                    held[result.slot] += len(result.tokens)
            rounds += len(batch)
        assert [v[:NEW] for v in (out[0], out[1])] == expected
        assert rounds >= 2
        channel.shutdown_ranks()
        assert stop_ranks(procs, timeout_s=60) == [0] * world
    finally:
        stop_ranks(procs, timeout_s=0)
        channel.close()
