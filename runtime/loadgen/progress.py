"""``flare bench``'s progress: a bar on a terminal, a line every few seconds elsewhere.

A bar redrawn with carriage returns is noise in a CI log or a file, and
tqdm shows nothing at all when stderr is not a terminal (``disable=None``).
:class:`ProgressLines` writes one line per interval instead, whether or not a
request completed meanwhile, and a last one at the end::

    flare bench: 40/100 requests done (0 failed), 8.0 req/s, 5.0 s elapsed
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TextIO, TypeVar

from runtime.loadgen.client import RequestRecord

PROGRESS_INTERVAL_S = 5.0

T = TypeVar("T")


class ProgressLines:
    """Counts completed requests; :meth:`line` writes where the run stands."""

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        self.clock = clock
        self.started = clock()
        self.done = 0
        self.failed = 0

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.success

    def text(self) -> str:
        elapsed = max(self.clock() - self.started, 0.0)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (
            f"flare bench: {self.done}/{self.total} requests done ({self.failed} failed), "
            f"{rate:.1f} req/s, {elapsed:.1f} s elapsed"
        )

    def line(self) -> None:
        print(self.text(), file=self.stream, flush=True)

    async def run(self, work: Awaitable[T]) -> T:
        """Await ``work``, writing a line every interval meanwhile and one at the end."""
        ticker = asyncio.create_task(self._tick())
        try:
            return await work
        finally:
            ticker.cancel()
            self.line()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.line()
