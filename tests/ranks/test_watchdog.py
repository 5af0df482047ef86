"""A hung frame is reported by the rank, naming the fence and the rank, and the
engine fails the requests it held (FLARE_DEBUG_HANG_FENCE_RANK<r>)."""

from __future__ import annotations

import time

import pytest
import zmq

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from runtime.ranks.watchdog import Watchdog, frame_deadline_ns
from runtime.transport.codec import decode
from runtime.transport.completion import Completion
from tests.support.checkpoints import write_tiny


def test_deadline_is_a_multiple_of_the_expected_time_plus_the_margin():
    assert frame_deadline_ns(2_000_000, 10.0, 0.5) == 520_000_000
    assert frame_deadline_ns(0, 10.0, 0.5) == 500_000_000  # unknown: the margin alone


def test_watchdog_reports_a_missed_deadline_and_not_a_met_one(tmp_path):
    endpoint = f"ipc://{tmp_path}/completions"
    context = zmq.Context.instance()
    pull = context.socket(zmq.PULL)
    pull.bind(endpoint)
    dog = Watchdog(endpoint, rank=1, world_size=2, exit_process=False)
    try:
        dog.arm(fence=4, limit_ns=30_000_000, expected_ns=1_000_000)
        dog.disarm()  # met in time: nothing is sent
        assert pull.poll(200) == 0
        dog.arm(fence=5, limit_ns=30_000_000, expected_ns=1_000_000)
        assert pull.poll(5000), "the watchdog did not report"
        message = decode(pull.recv())
        assert isinstance(message, Completion)
        assert (message.fence, message.rank, message.world_size) == (5, 1, 2)
        assert "fence 5" in message.error and "rank 1" in message.error
        # Where the watched thread (this one, waiting in poll) was stuck.
        assert "stuck in poll (" in message.error, message.error
        assert dog.fired == message.error
    finally:
        dog.close()
        pull.close(linger=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hang")
    write_tiny("llama", path, seed=5)
    return path


@pytest.mark.process
def test_a_hung_rank_fails_the_requests_within_its_timeout(checkpoint, monkeypatch):
    monkeypatch.setenv("FLARE_DEBUG_HANG_FENCE_RANK0", "1")  # the first frame that runs
    config = DeploymentConfig(
        model=str(checkpoint), max_concurrency=4, max_prefill_tokens=64, num_pages=64,
        device="cpu", startup_timeout_s=120, frame_timeout_multiple=2.0,
        frame_timeout_margin_s=2.0,
    )  # fmt: skip
    with LocalDeployment(config) as d:
        start = time.monotonic()
        streams = [d.engine.submit([5, 6, 7, 8], 4), d.engine.submit([9, 10], 4)]
        errors = []
        for stream in streams:  # the engine fails them: "error", and the stream says why
            assert stream.result(timeout=60).finish_reason == "error"
            errors.append(str(stream.error))
        waited = time.monotonic() - start
    assert waited < 30, f"the hang took {waited:.1f} s to report"
    assert any("hung" in e and "fence" in e and "rank 0" in e for e in errors), errors
