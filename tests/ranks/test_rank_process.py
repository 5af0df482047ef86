"""Rank processes started as torchrun would start them, driven over real sockets."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.launch import spawn_ranks, stop_ranks
from runtime.transport.channels import CoordinatorChannel
from runtime.transport.schema import CatalogReport, Completion, Frame, FrameLane

PROMPT = [5, 17, 33, 3, 60, 9, 41]
NEW = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        eos_token_id=95,
        bos_token_id=94,
    )
    hf = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(path)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            pad_token_id=0,
        )
    return path, out[0, len(PROMPT) :].tolist()


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


def collect(channel: CoordinatorChannel, kind, count: int, timeout_ms=60_000) -> list:
    got = []
    while len(got) < count:
        message = channel.recv(timeout_ms=timeout_ms)
        assert message is not None, f"timed out waiting for {kind.__name__}"
        if isinstance(message, kind):
            got.append(message)
    return sorted(got, key=lambda m: m.rank)


@pytest.mark.parametrize("world", [1, 2])
def test_rank_processes_generate_transformers_tokens(checkpoint, tmp_path, world):
    model_dir, expected = checkpoint
    channel = CoordinatorChannel(world)
    procs = start_ranks(model_dir, channel, world, tmp_path)
    try:
        channel.handshake(timeout_s=120.0)
        reports = collect(channel, CatalogReport, world, 120_000)
        assert [r.rank for r in reports] == list(range(world))
        assert len({r.descriptors for r in reports}) == 1
        pages = tuple(range(8))
        prefill = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64)
        decode = GraphDescriptor(GraphKind.DECODE, 1)
        frames = [Frame(1, prefill, (FrameLane(0, 1, "prefill", 0, tuple(PROMPT), 0, pages, 1),))]
        for i in range(NEW - 1):
            lane = FrameLane(0, 1, "decode", 0, (), len(PROMPT) + i, pages, 1)
            frames.append(Frame(2 + i, decode, (lane,)))
        tokens = []
        for frame in frames:  # one frame at a time; each needs all ranks' completions
            channel.publish(frame)
            completions = collect(channel, Completion, world)
            assert [c.fence for c in completions] == [frame.fence] * world
            assert all(c.device_ns > 0 for c in completions)
            assert all(not c.lanes for c in completions[1:])  # only rank 0 reports lanes
            tokens += completions[0].lanes[0].tokens
        assert tokens == expected
        channel.shutdown_ranks()
        assert stop_ranks(procs, timeout_s=60) == [0] * world
    finally:
        stop_ranks(procs, timeout_s=0)
        channel.close()
