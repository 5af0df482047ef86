"""Run many ``python -m runtime.cli`` command lines, each in its own forked process.

Most of a refused command line's time is interpreter and torch start-up; this
driver pays it once.  It imports the CLI (and torch), then forks one child per
command line: the child gets its own TMPDIR, its stdout and stderr (file
descriptors 1 and 2, so native writes are caught too) go to files, and it runs
``runtime.cli``'s ``__main__`` exactly as ``python -m runtime.cli`` would: an
uncaught exception prints its traceback and exits 1, ``SystemExit`` exits with
its code.  The parent waits for each child and prints one JSON line per
command line: ``{"name", "code", "stdout", "stderr", "seconds"}``.

Input (stdin): a JSON list of ``{"name", "argv", "tmpdir"}``.
Used by tests/cli/test_app.py; run as ``python -m tests.support.flare_forks``.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _child(argv: list[str], tmpdir: Path) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        os.environ["TMPDIR"] = str(tmpdir)
        tempfile.tempdir = None  # recomputed from TMPDIR
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(tmpdir / f".{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = ["runtime.cli", *argv]
        try:
            runpy.run_module("runtime.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def run(cases: list[dict]) -> None:
    for case in cases:
        tmpdir = Path(case["tmpdir"])
        tmpdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(case["argv"], tmpdir)
        _, status = os.waitpid(pid, 0)
        seconds = time.monotonic() - started
        out = {
            "name": case["name"],
            "code": os.waitstatus_to_exitcode(status),
            "stdout": (tmpdir / ".stdout").read_text(errors="replace"),
            "stderr": (tmpdir / ".stderr").read_text(errors="replace"),
            "seconds": seconds,
        }
        for name in (".stdout", ".stderr"):
            (tmpdir / name).unlink()
        print(json.dumps(out), flush=True)


def main() -> None:
    cases = json.load(sys.stdin)
    # What every refusal path imports, once, before the first fork.
    import torch  # noqa: F401

    import runtime.cli.app
    import runtime.cli.commands.run  # noqa: F401

    run(cases)


if __name__ == "__main__":
    main()
