"""The ``process`` marker, enforced.

A test that starts a process (a subprocess, a multiprocessing or
torch.multiprocessing process of any start method, a fork, a server, rank
processes) must be marked ``process``: ``python -m pytest -m "not process"`` is
then the fast loop.  For a test without the mark, starting a process raises
``ProcessNotMarked`` (in its setup, call and teardown), and the test fails even
where the code under test swallowed that error.  Only the test's own threads
are refused (the main thread and threads started while it runs): a marked
test's servers still starting in a background thread are left alone.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# Fixtures every test module may ask for by name.
pytest_plugins = ["tests.support.paths"]

MARK = "process"
# os functions that start a process without going through subprocess.Popen.
OS_STARTERS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")


class ProcessNotMarked(RuntimeError):
    pass


TAG = "_started_by_an_unmarked_test"


def _refuse(nodeid: str, what: str, seen: list[str], original: Any) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        thread = threading.current_thread()
        if thread is not threading.main_thread() and not getattr(thread, TAG, False):
            return original(*args, **kwargs)  # not this test's: a marked test's server
        seen.append(what)
        raise ProcessNotMarked(
            f"{nodeid} started a process ({what}) but is not marked {MARK!r}: "
            f"add @pytest.mark.{MARK} (or pytestmark = pytest.mark.{MARK} in its module)"
        )

    return refuse


def _tagging(original: Any) -> Callable[..., Any]:
    def start(self: threading.Thread) -> None:
        setattr(self, TAG, True)
        original(self)

    return start


@contextlib.contextmanager
def _no_processes(nodeid: str) -> Iterator[list[str]]:
    """Every way to start a process refuses while inside; yields what was tried."""
    seen: list[str] = []
    starters: list[tuple[object, str, str]] = [
        (subprocess.Popen, "_execute_child", "subprocess.Popen"),
        (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start"),
    ]
    starters += [(os, name, f"os.{name}") for name in OS_STARTERS if hasattr(os, name)]
    patches = [
        (owner, name, _refuse(nodeid, what, seen, getattr(owner, name)))
        for owner, name, what in starters
    ]
    patches.append((threading.Thread, "start", _tagging(threading.Thread.start)))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, refuse in patches:
        setattr(owner, name, refuse)
    try:
        yield seen
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _guarded(item: pytest.Item, phase: str) -> Iterator[None]:
    if item.get_closest_marker(MARK) is not None:
        return (yield)
    with _no_processes(item.nodeid) as seen:
        result = yield
    if seen:
        pytest.fail(
            f"{item.nodeid} tried to start a process in its {phase} ({', '.join(seen)}) "
            f"without the {MARK!r} marker"
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item, "teardown"))
