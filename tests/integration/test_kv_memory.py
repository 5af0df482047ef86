"""KV memory through the whole runtime on CPU (coordinator + rank processes, gloo
at TP=2, real sockets, the ranks checking each other's tokens): a pool too small
for every request at once preempts and still gives transformers' greedy tokens;
a request sharing a 1,000-token system prompt computes only its suffix and gives
the same tokens as without the cache; every page comes back."""

from __future__ import annotations

import random

import pytest

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from tests.support.checkpoints import greedy, write_tiny

pytestmark = pytest.mark.process

NEW = 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = write_tiny("llama", path, seed=31, max_positions=1200)
    return path, hf


def deployment(path, tp: int, num_pages: int, caching: bool = True) -> LocalDeployment:
    return LocalDeployment(
        DeploymentConfig(
            model=str(path), tensor_parallel_size=tp, max_concurrency=8,
            max_prefill_tokens=64, num_pages=num_pages, device="cpu", startup_timeout_s=120,
            check_ranks=True, enable_prefix_caching=caching, debug_page_accounting=True,
        )
    )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_preempted_requests_give_the_unpreempted_tokens(model, tp):
    path, hf = model
    rng = random.Random(tp)
    prompts = [[rng.randrange(120) for _ in range(rng.randint(30, 60))] for _ in range(6)]
    expected = greedy(hf, prompts, NEW)
    # 6 requests of up to 100 tokens (7 pages each) in a pool of 20 pages.
    with deployment(path, tp, num_pages=20) as d:
        streams = [d.engine.submit(p, NEW, ignore_eos=True) for p in prompts]
        results = [s.result(timeout=300) for s in streams]
        metrics = d.engine.metrics()
    assert [r.token_ids for r in results] == expected
    assert all(len(r.token_ids) == NEW and r.finish_reason == "length" for r in results)
    assert metrics["preemptions"] >= 1
    assert metrics["kv_pages_held"] == 0


def test_a_shared_system_prompt_is_computed_once(model):
    path, hf = model
    rng = random.Random(9)
    system = [rng.randrange(120) for _ in range(1000)]
    first, second = (system + [rng.randrange(120) for _ in range(n)] for n in (12, 20))
    expected = greedy(hf, [first, second], 8)
    results = {}
    for caching in (True, False):
        with deployment(path, 1, num_pages=256, caching=caching) as d:
            one = d.engine.submit(first, 8, ignore_eos=True)
            one.result(timeout=300)
            before = d.engine.metrics()["prompt_tokens_computed"]
            two = d.engine.submit(second, 8, ignore_eos=True)
            tokens = [one.result(timeout=300).token_ids, two.result(timeout=300).token_ids]
            metrics = d.engine.metrics()
            results[caching] = (tokens, metrics["prompt_tokens_computed"] - before, two, metrics)
    tokens, computed, two, metrics = results[True]
    assert tokens == expected and results[False][0] == expected
    assert two.cached_tokens == 1000
    assert computed == 20  # the suffix only
    assert results[False][1] == len(second)
    assert metrics["kv_pages_held"] == 0 and metrics["kv_pages_cached"] > 0


def test_sixteen_requests_without_max_tokens_are_resident_at_once():
    """The embedded default model, --max-num-seqs 16 and the issue's pool of 1,024
    pages of 16 tokens (4,096-token context): 16 requests whose max_tokens is the
    rest of the context are all resident together (worst-case reservations let
    4 in)."""
    import time

    config = DeploymentConfig(
        max_concurrency=16, num_pages=1024, device="cpu", startup_timeout_s=120
    )
    with LocalDeployment(config) as d:
        facts = d.engine.facts
        assert facts is not None
        streams = []
        for i in range(16):
            prompt = [5 + i, 6, 7, 8, 9, 10, 11, 12]
            streams.append(d.engine.submit(prompt, facts.max_context - len(prompt)))
        deadline = time.monotonic() + 60
        running = 0
        while time.monotonic() < deadline:
            metrics = d.engine.metrics()
            running = int(metrics["running"])
            if running == 16:
                break
            time.sleep(0.05)
        assert running == 16 and metrics["waiting"] == 0
        assert facts.num_pages * facts.page_size < 16 * facts.max_context  # a real test
        for stream in streams:
            d.engine.cancel(stream)
        for stream in streams:
            assert stream.result(timeout=60).finish_reason == "cancelled"
