"""The engine against in-process fake ranks, driven step by step (tests/coordinator).

:class:`Rig` starts an engine and :class:`~tests.support.fake_rank.LocalRanks`
together; :func:`rig_factory` is the fixture that closes every rig a test
made (import it into a test module to use it); :func:`prompts` and
:func:`check` make prompts and compare a stream with the fake model's
reference output.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from runtime.coordinator.engine.config import EngineConfig
from runtime.coordinator.engine.core import Engine
from tests.support import fake_rank
from tests.support.fake_rank import FakeSpec, LocalRanks, reference

WAIT_S = 10.0


class Rig:
    """An engine and in-process fake ranks, started together."""

    def __init__(self, world_size: int = 1, spec: FakeSpec | None = None, **config: Any) -> None:
        config.setdefault("handshake_timeout_s", WAIT_S)
        config.setdefault("catalog_timeout_s", WAIT_S)
        config.setdefault("completion_timeout_s", WAIT_S)
        config.setdefault("shutdown_grace_s", 0)
        self.engine = Engine(EngineConfig(world_size=world_size, **config))
        self.ranks = LocalRanks(self.engine.bind(), world_size, spec or FakeSpec())

    def start(self) -> Rig:
        threads = self.ranks.handshake_in_background()
        self.engine.start()
        for thread in threads:
            thread.join(WAIT_S)
        return self

    def drive(self, streams: list, reverse: bool = False, limit_s: float = WAIT_S) -> None:
        """Step the engine and answer its frames until every stream finished."""
        deadline = time.monotonic() + limit_s
        while not all(s.finished for s in streams):
            assert time.monotonic() < deadline, "streams did not finish"
            self.engine.step(0)
            if not self.ranks.serve(reverse=reverse, timeout_ms=1):
                self.engine.step(5)

    def close(self) -> None:
        self.engine.stop()
        self.ranks.close()


@pytest.fixture
def rig_factory() -> Iterator[Any]:
    rigs: list[Rig] = []

    def make(world_size: int = 1, spec: FakeSpec | None = None, **config: Any) -> Rig:
        rigs.append(Rig(world_size, spec, **config))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


def prompts(n: int, seed: int, lo: int = 1, hi: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(fake_rank.VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def check(stream: Any, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> None:
    tokens, reason = reference(prompt, max_tokens, ignore_eos=ignore_eos)
    result = stream.result(timeout=0)
    assert (result.token_ids, result.finish_reason) == (tokens, reason)
