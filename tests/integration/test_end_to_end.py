"""The whole runtime on CPU: coordinator engine + rank processes (gloo at TP=2),
real sockets, against transformers' greedy tokens."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.local import DeploymentConfig, LocalDeployment

ROOT = Path(__file__).resolve().parents[2]
NEW = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(21)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, eos_token_id=127, bos_token_id=126, tie_word_embeddings=False,
    )  # fmt: skip
    hf = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("e2e")
    hf.save_pretrained(path)
    rng = random.Random(4)
    prompts = [[rng.randrange(120) for _ in range(rng.randint(3, 90))] for _ in range(16)]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                pad_token_id=0,
            )
            expected.append(out[0, len(prompt) :].tolist())
    return path, prompts, expected


def deployment(path, tp: int) -> LocalDeployment:
    return LocalDeployment(
        DeploymentConfig(
            model=str(path), tensor_parallel_size=tp, max_concurrency=16,
            max_prefill_tokens=64, num_pages=256, device="cpu", startup_timeout_s=120,
        )
    )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_sixteen_concurrent_requests_match_transformers(reference, tp):
    path, prompts, expected = reference
    with deployment(path, tp) as d:
        streams = [d.engine.submit(p, NEW, ignore_eos=True) for p in prompts]
        got = [s.result(timeout=300).token_ids for s in streams]
        stats = d.engine.stats.summary()
    assert got == expected
    assert stats["frames"] > 0 and stats["host_overhead_ratio"] >= 1.0


def test_each_request_alone_matches_the_batched_run(reference):
    """Batch invariance: the same greedy tokens alone as among sixteen."""
    path, prompts, expected = reference
    with deployment(path, 1) as d:
        for prompt, want in list(zip(prompts, expected))[:6]:
            assert (
                d.engine.submit(prompt, NEW, ignore_eos=True).result(timeout=120).token_ids == want
            )


def test_flare_run_cli_generates_with_the_embedded_model(tmp_path):
    env = dict(os.environ, FLARE_HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "run", "--prompt", "Hello", "--max-tokens", "5",
         "--device", "cpu", "--tensor-parallel-size", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("Hello")
    assert "TP=2" in done.stderr and "5 generated tokens" in done.stderr
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert summary["frames"] >= 5


def test_flare_run_rejects_bad_flags_naming_them():
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "run", "--tensor-parallel-size", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--tensor-parallel-size" in done.stderr
