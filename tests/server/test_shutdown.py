"""SIGTERM with a drain period (``--drain-timeout``): new requests get 503 with
Retry-After while the open ones finish; one still open when the period ends
ends as "abort"; the server exits 0 and no process of the run survives.
Without a drain period (everything aborted at once) and the other reliability
checks: tests/frontend/test_reliability.py."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.support.processes import all_gone, tree, wait_for
from tests.support.server import Server, Stream

pytestmark = pytest.mark.process

DRAIN_S = 4.0
# The endless stream's length: the context's worth (4,096 positions), several
# times what a fast machine decodes within the drain period.
ENDLESS_TOKENS = 4000


def test_sigterm_with_a_drain_period_lets_open_requests_finish_then_exits_0():
    s = Server("--drain-timeout", str(DRAIN_S))
    try:
        procs = tree(s.proc.pid)
        assert len(procs) >= 3  # frontend, coordinator, rank
        endless = Stream(s.base, max_tokens=ENDLESS_TOKENS)  # open when the period ends
        assert wait_for(lambda: len(endless.lines) >= 2, 60)
        short = Stream(s.base, max_tokens=24)
        assert wait_for(lambda: len(short.lines) >= 1, 60)
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        # Draining: /health and new requests get 503 with Retry-After.
        assert wait_for(lambda: httpx.get(f"{s.base}/health", timeout=5).status_code == 503, 5)
        r = httpx.post(f"{s.base}/v1/completions", json={"prompt": "x"}, timeout=5)
        assert r.status_code == 503 and 1 <= int(r.headers["retry-after"]) <= DRAIN_S
        assert "draining" in r.json()["error"]["message"]
        # The short request finishes normally; the endless one ends as aborted at the end
        # of the drain period, not before.
        short.join(DRAIN_S)
        assert not short.is_alive() and short.error is None
        assert short.finish_reasons() == ["length"] and short.lines[-1] == "[DONE]"
        endless.join(DRAIN_S + 10)
        assert not endless.is_alive() and endless.error is None
        assert endless.finish_reasons() == ["abort"] and endless.lines[-1] == "[DONE]"
        assert endless.ended_at - signalled >= DRAIN_S - 0.5
        # Exit 0 within the drain period plus a margin, every process of the run gone.
        assert s.proc.wait(timeout=max(1.0, signalled + DRAIN_S + 20 - time.monotonic())) == 0
        assert wait_for(lambda: all_gone(procs), 30), [p.pid for p in procs if p.is_running()]
    finally:
        s.stop()
