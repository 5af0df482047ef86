"""tests/conftest.py: a test that starts a process without the ``process`` mark fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing  # noqa: F401 - here, so pytester's runs never import it anew

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py").read_text()
HEADER = """
import multiprocessing, os, subprocess, threading
import pytest
import torch.multiprocessing

@pytest.fixture
def server():
    subprocess.run(['true'])
"""
# Each way to start a process, in an unmarked test (the fixture fails the setup).
UNMARKED = {
    "subprocess": "subprocess.run(['true'])",
    "swallowed": "try:\n        subprocess.run(['true'])\n    except Exception:\n        pass",
    "thread": "t = threading.Thread(target=subprocess.run, args=(['true'],))\n"
    "    t.start()\n    t.join()",
    "spawn": "multiprocessing.get_context('spawn').Process(target=print).start()",
    "fork": "multiprocessing.get_context('fork').Process(target=print).start()",
    "torch": "torch.multiprocessing.get_context('spawn').Process(target=print).start()",
    "os_fork": "os.fork()",
    "os_system": "os.system('true')",
}


def test_an_unmarked_test_that_starts_a_process_fails_naming_the_mark(pytester):
    pytester.makeconftest(CONFTEST)
    tests = [f"def test_{kind}():\n    {body}\n" for kind, body in UNMARKED.items()]
    tests.append("def test_fixture(server):\n    pass\n")
    pytester.makepyfile("\n\n".join([HEADER, *tests]))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=len(UNMARKED), errors=1, warnings=1)  # the thread's
    for kind in [*UNMARKED, "fixture"]:
        result.stdout.re_match_lines(
            [rf".*::test_{kind} (started|tried to start) a process .*'process'.*"],
            consecutive=False,
        )


@pytest.mark.process
def test_a_marked_test_may_start_processes_and_an_unmarked_one_may_not(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        f"""{HEADER}
@pytest.mark.process
def test_marked(server):
    subprocess.run(['true'], check=True)

def test_plain():
    assert True
"""
    )
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)
