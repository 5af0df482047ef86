"""Honest intervals and cross-rank agreement at TP=2 on CPU (gloo), real processes.

* A slow host (FLARE_DEBUG_LAUNCH_DELAY_NS_RANK1: rank 1 launches late) makes
  rank 0 wait at the first collective; that wait is reported as launch wait and
  stays out of the scheduler's cost estimate.
* A slow device (FLARE_DEBUG_DELAY_NS_RANK1: inside rank 1's timed region)
  stays in it.
* With check_ranks, a rank whose sampled tokens differ (FLARE_DEBUG_PERTURB_*)
  fails the engine, naming the rank and the fence.
"""

from __future__ import annotations

import pytest

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from tests.support.checkpoints import write_tiny

pytestmark = pytest.mark.process

DELAY = 100_000_000  # ns: well above a frame here (about 15 ms at TP=2 on two cores)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("intervals")
    write_tiny("llama", path, seed=23)
    return path


def run(path, **config) -> tuple[list, dict, object]:
    deployment = LocalDeployment(
        DeploymentConfig(
            model=str(path), tensor_parallel_size=2, max_concurrency=4, max_prefill_tokens=64,
            num_pages=64, device="cpu", startup_timeout_s=120, **config,
        )
    )  # fmt: skip
    with deployment as d:
        stream = d.engine.submit([5, 17, 33, 3, 60, 9], 6, ignore_eos=True)
        result = stream.result(timeout=300)
        frames = d.engine.stats.frames()
        estimates = dict(d.engine.scheduler.catalog.estimates())
    return frames, estimates, (result, stream)


def test_a_late_launch_stays_out_of_the_estimate_and_a_slow_device_stays_in(
    checkpoint, monkeypatch
):
    frames, base, _ = run(checkpoint)
    used = {f.graph for f in frames}
    assert used and all(base[g] > 0 for g in used), base

    monkeypatch.setenv("FLARE_DEBUG_LAUNCH_DELAY_NS_RANK1", str(DELAY))
    frames, late, _ = run(checkpoint)
    # Rank 0 waited for rank 1 inside its interval...
    assert sum(f.rank_device_ns[0] >= DELAY * 0.8 for f in frames) >= len(frames) // 2
    # ...and the estimates left it out: uncorrected they would exceed DELAY.
    assert all(late[g] < DELAY * 0.75 for g in used), (late, base)
    monkeypatch.delenv("FLARE_DEBUG_LAUNCH_DELAY_NS_RANK1")

    monkeypatch.setenv("FLARE_DEBUG_DELAY_NS_RANK1", str(DELAY))
    frames, slow, _ = run(checkpoint)
    assert all(slow[g] >= DELAY for g in used), slow


def test_ranks_that_disagree_fail_the_engine_naming_the_rank_and_fence(checkpoint, monkeypatch):
    _, _, (result, _) = run(checkpoint, check_ranks=True)
    assert result.finish_reason != "error" and len(result.token_ids) == 6
    monkeypatch.setenv("FLARE_DEBUG_PERTURB_FENCE_RANK1", "1")
    _, _, (result, stream) = run(checkpoint, check_ranks=True)
    assert result.finish_reason == "error"
    message = str(stream.error)
    assert "rank 1" in message and "fence" in message and "disagree" in message, message
