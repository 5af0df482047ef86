"""runtime/logs.py: a flood of one message kind is a burst and one summary line per
interval; other kinds pass; digits and line tails do not make new kinds."""

from __future__ import annotations

import io
import logging
import time

import pytest

from runtime.logs import RateLimitFilter, install_rate_limit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def logger_with(stream: io.StringIO, burst: int, interval_s: float, clock=time.monotonic):
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    flt = RateLimitFilter(burst, interval_s, emit=handler.handle, clock=clock)
    handler.addFilter(flt)
    logger = logging.getLogger(f"test.logs.{id(stream)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, flt


def test_a_flood_is_a_burst_then_one_summary_per_interval():
    out, clock = io.StringIO(), Clock()
    logger, flt = logger_with(out, burst=3, interval_s=10.0, clock=clock)
    for i in range(1000):
        logger.error("accept failed on fd %d", i)
    assert out.getvalue().count("accept failed") == 3
    clock.now += 10.0
    logger.error("accept failed on fd %d", 5000)  # the next interval: the summary first
    lines = out.getvalue().splitlines()
    assert lines[3] == "ERROR suppressed 997 more like: accept failed on fd 3 (in 10.0 s)"
    assert lines[4] == "ERROR accept failed on fd 5000"
    assert flt.suppressed_total == 997


def test_other_kinds_pass_during_a_flood():
    out, clock = io.StringIO(), Clock()
    logger, _ = logger_with(out, burst=2, interval_s=10.0, clock=clock)
    for _ in range(50):
        logger.warning("a flood")
    logger.warning("something else")
    logger.error("a flood")  # another level: another kind
    assert out.getvalue().splitlines() == [
        "WARNING a flood",
        "WARNING a flood",
        "WARNING something else",
        "ERROR a flood",
    ]


def test_preformatted_messages_differing_in_digits_are_one_kind():
    out, clock = io.StringIO(), Clock()
    logger, flt = logger_with(out, burst=2, interval_s=10.0, clock=clock)
    for fd in range(20):
        logger.error(f"socket.accept() out of system resource\nsocket: fd={fd}\nTraceback ...")
    assert out.getvalue().count("socket.accept()") == 2 and flt.suppressed_total == 18


def test_the_summary_comes_when_the_flood_stops():
    out = io.StringIO()
    logger, _ = logger_with(out, burst=1, interval_s=0.2)
    for _ in range(10):
        logger.info("tick")
    deadline = time.monotonic() + 5
    while "suppressed" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)  # a timer writes it: no further record is needed
    assert "INFO suppressed 9 more like: tick" in out.getvalue()


def test_flush_writes_pending_summaries():
    out, clock = io.StringIO(), Clock()
    logger, flt = logger_with(out, burst=1, interval_s=60.0, clock=clock)
    for _ in range(4):
        logger.info("tick")
    flt.flush()
    assert out.getvalue().splitlines()[-1].startswith("INFO suppressed 3 more like: tick")


def test_install_rate_limit_filters_each_handler_once():
    logger = logging.getLogger("test.logs.install")
    first, second = logging.StreamHandler(io.StringIO()), logging.StreamHandler(io.StringIO())
    logger.handlers[:] = [first, second]
    filters = install_rate_limit(logger, burst=5, interval_s=1.0)
    again = install_rate_limit(logger)
    assert len(filters) == 2 and filters == again
    assert [len(h.filters) for h in (first, second)] == [1, 1]
    assert install_rate_limit(first) == [filters[0]]
    logger.handlers[:] = []


@pytest.mark.parametrize(("burst", "interval"), [(0, 1.0), (1, 0.0)])
def test_bad_settings_are_refused(burst, interval):
    with pytest.raises(ValueError):
        RateLimitFilter(burst, interval)


def test_basic_config_leaves_a_host_programs_handlers_alone():
    """In a program that already logs (here pytest, whose capture handlers live for
    the whole session), a flare entry point called in-process must not rate-limit
    the host's handlers: before, a test that ran the coordinator's main() in-process
    left every later test's log capture cut at ten records."""
    from runtime.logs import basic_config

    root = logging.getLogger()
    assert root.handlers  # pytest's
    before = [list(h.filters) for h in root.handlers]
    assert basic_config(logging.INFO, "%(message)s") == []
    assert [list(h.filters) for h in root.handlers] == before
