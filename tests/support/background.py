"""Servers a test module needs, started together in the background.

A server's start-up is mostly waiting on its own processes (imports, the model,
the catalog), so the servers of a module's process tests overlap their start-ups
when started at once, as the module's first test begins, instead of one by one
inside each test.  Each test takes its own server and ends it as before.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest


def wanted(request: pytest.FixtureRequest, names: list[str]) -> Counter[str]:
    """How many of the request's module's selected tests use each fixture of ``names``."""
    counts: Counter[str] = Counter()
    for item in request.session.items:
        if item.module is request.module:
            used = getattr(item, "fixturenames", ())
            counts.update(name for name in names if name in used)
    return counts


class BackgroundStarts:
    """``counts[name]`` servers of each kind, each made by ``makers[name][0]`` in a
    thread of its own and ended (if no test took it) by ``makers[name][1]``."""

    def __init__(
        self,
        makers: dict[str, tuple[Callable[[], Any], Callable[[Any], object]]],
        counts: Counter[str],
    ) -> None:
        self.makers = makers
        self.pool = ThreadPoolExecutor(max(1, sum(counts.values())))
        self.starts: dict[str, list[Future]] = {
            name: [self.pool.submit(makers[name][0]) for _ in range(counts[name])]
            for name in makers
        }

    def take(self, name: str) -> Any:
        """A started server of kind ``name``, the taker's to end (a failed start raises)."""
        return self.starts[name].pop().result()

    def close(self) -> None:
        for name, starts in self.starts.items():
            for start in starts:
                with contextlib.suppress(Exception):
                    self.makers[name][1](start.result())
        self.pool.shutdown()
