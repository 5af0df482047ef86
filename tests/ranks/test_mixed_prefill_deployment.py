"""The deployment with --mixed-prefill: the scheduler's mixed plans reach the ranks
as mixed frames and every request still gets transformers' greedy tokens."""

from __future__ import annotations

import random
import time

import pytest

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from tests.support.checkpoints import greedy, write_tiny

pytestmark = pytest.mark.process

NEW = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-mixed-deployment")
    rng = random.Random(4)
    prompts = [[rng.randrange(120) for _ in range(rng.randint(3, 90))] for _ in range(12)]
    model = write_tiny("llama", path, seed=21)
    return path, prompts, greedy(model, prompts, NEW)


@pytest.mark.parametrize("tp", [1, 2])
def test_mixed_frames_serve_staggered_requests_with_transformers_tokens(reference, tp):
    path, prompts, expected = reference
    config = DeploymentConfig(
        model=str(path), tensor_parallel_size=tp, max_concurrency=16, max_prefill_tokens=64,
        num_pages=256, device="cpu", startup_timeout_s=120, mixed_prefill=True,
    )  # fmt: skip
    with LocalDeployment(config) as d:
        kinds = {desc.kind.value for desc in d.engine.facts.descriptors}
        assert kinds == {"prefill", "scored_prefill", "decode", "mixed", "restore", "snapshot"}
        streams = []
        for prompt in prompts:  # prompts arrive while earlier requests decode
            streams.append(d.engine.submit(prompt, NEW, ignore_eos=True))
            time.sleep(0.02)
        got = [s.result(timeout=300).token_ids for s in streams]
        frames = d.engine.stats.by_kind()
    assert got == expected
    assert frames.get("mixed", (0, 0))[0] > 0, frames  # mixed programs did run
