"""The engine runs speculative rounds against fake ranks with scripted acceptance
and confidence sidecars (the real ranks' speculative programs are the next step):
host-allocated and device-allocated programs deliver exactly the reference
tokens in fewer frames, and a sidecar that holds no probabilities fails the
engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.engine import ERROR
from tests.support.engine_rig import Rig, check, prompts
from tests.support.fake_rank import DESCRIPTORS, FakeSpec


@pytest.fixture
def make_rig() -> Iterator[Any]:
    rigs: list[Rig] = []

    def make(spec: FakeSpec) -> Rig:
        rigs.append(Rig(1, spec))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


def rounds(widths=(4,), device: tuple[int, int, int] | None = None) -> tuple:
    out = [
        GraphDescriptor(GraphKind.SPECULATIVE, b, token_capacity=w, proposal_depth=w - 1)
        for b in (1, 2, 4, 8)
        for w in widths
    ]
    if device is not None:
        b, w, p = device
        out.append(
            GraphDescriptor(
                GraphKind.SPECULATIVE, b, token_capacity=w, proposal_depth=w - 1,
                target_capacity=p, device_allocated=True,
            )
        )  # fmt: skip
    return (*DESCRIPTORS, *out)


def run(rig: Any, cases: list[tuple[list[int], int]]) -> list:
    rig.start()
    rig.engine.scheduler.speculation.preseed("draft", [0.95, 0.9, 0.85])
    streams = [rig.engine.submit(p, n, ignore_eos=True) for p, n in cases]
    rig.drive(streams)
    return streams


def test_host_allocated_rounds_deliver_the_reference_in_fewer_frames(make_rig):
    rig = make_rig(FakeSpec(descriptors=rounds(), accept=3))
    cases = [(p, 40) for p in prompts(4, seed=3, hi=60)]
    streams = run(rig, cases)
    for stream, (prompt, n) in zip(streams, cases):
        check(stream, prompt, n, ignore_eos=True)
    by_kind = rig.engine.stats.by_kind()
    assert by_kind["speculative"][0] > 0  # frames of complete speculative programs
    frames = rig.engine.stats.counters()["frames_sent"]
    assert frames < 4 * 40 / 2  # four tokens a round instead of one
    metrics = rig.engine.metrics()
    assert metrics["frames_total:speculative"] == by_kind["speculative"][0]
    assert metrics["device_nanoseconds_total:speculative"] > 0


def test_device_allocated_rounds_complete_with_the_confidence_sidecar(make_rig):
    spec = FakeSpec(
        descriptors=rounds(widths=(), device=(4, 4, 8)), accept=2, confidence=(0.9, 0.8, 0.4)
    )
    rig = make_rig(spec)
    cases = [(p, 30) for p in prompts(4, seed=5, hi=60)]
    streams = run(rig, cases)
    for stream, (prompt, n) in zip(streams, cases):
        check(stream, prompt, n, ignore_eos=True)
    assert rig.engine.stats.by_kind()["speculative"][0] > 0
    # The forecasts moved toward the scripted joint prefix probabilities.
    scheduler = rig.engine.scheduler
    assert scheduler.speculation.forecast_prior.means()[0] > 0.5


def test_a_confidence_sidecar_that_is_not_probabilities_fails_the_engine(make_rig):
    spec = FakeSpec(
        descriptors=rounds(widths=(), device=(4, 4, 8)), accept=1, confidence=(1.5, 0.8, 0.4)
    )
    rig = make_rig(spec)
    rig.start()
    rig.engine.scheduler.speculation.preseed("draft", [0.95, 0.9, 0.85])
    stream = rig.engine.submit(prompts(1, seed=7, hi=30)[0], 20, ignore_eos=True)
    try:
        rig.drive([stream])
    except Exception as exc:  # the engine fails in step() and re-raises
        assert "confidence sidecar holds values that are not probabilities" in str(exc)
    assert stream.finish_reason == ERROR
    assert "not probabilities" in str(rig.engine.error)
