"""The scheduling simulator runs requests with images (flare with a feature
storage: RunConfig.vision, workload.vision_chat; docs/vision.md, "Scheduling")."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphKind
from runtime.image_spans import VisionStorage
from scripts.scheduling_sim.runner import RunConfig, simulate, vision_shapes
from scripts.scheduling_sim.workload import vision_chat


def test_vision_requests_complete_in_the_simulator():
    cfg = RunConfig(max_slots=8, vision=VisionStorage(4, 1152), max_seconds=60)
    report, sim = simulate(cfg, vision_chat(requests=8, seed=3))
    assert sim.done and report["finished"] == 8
    assert any(name.startswith("vision") for name in sim.frames_by_graph)


def test_vision_shapes_and_baselines():
    kinds = [(d.kind, d.batch_capacity) for d in vision_shapes(4)]
    assert kinds == [
        (GraphKind.VISION, 1), (GraphKind.VISION, 2), (GraphKind.VISION, 4),
        (GraphKind.SNAPSHOT, 1), (GraphKind.RESTORE, 1),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="vision applies to flare"):
        RunConfig(scheduler="vllm", vision=VisionStorage(2, 64))
