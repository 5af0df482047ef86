"""``flare run`` as a child process on a free loopback port, for load tests.

The benchmark and soak scripts and the HTTP tests start the whole server this
way: ``python -m runtime.cli run --port PORT FLAGS`` (frontend, coordinator and
ranks), its output in a file (a chatty server never blocks on a full pipe), its
run directories in a private temporary directory, ready once ``/health``
answers 200.  ``stop()`` ends the process tree: the stop signal, then SIGKILL
after a timeout (to the whole process group when it has one of its own).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx

from runtime.deploy.launch import free_port

ROOT = Path(__file__).resolve().parents[2]  # the directory holding the runtime package


class ServerStartError(RuntimeError):
    """``flare run`` exited (``code``) or was not healthy in time (``code`` None);
    ``output``: everything it printed."""

    def __init__(self, message: str, code: int | None, output: str) -> None:
        super().__init__(message)
        self.code = code
        self.output = output


class ServerProcess:
    """``flare run`` started and waited for in the constructor; ``stop()`` ends it.

    ``own_group``: the server gets a session (process group) of its own and
    ``stop()`` kills anything of that group still there once it has exited, or
    the whole group after ``stop_timeout_s``; without it only the server is
    killed after the timeout (its children go with it, as ranks die with their
    parent).  ``tmp_prefix``: a private ``TMPDIR`` for the server's run
    directories (removed on stop), where its log goes unless ``log`` is given;
    ``None`` keeps the inherited ``TMPDIR``.  ``tail_lines``: how much of the log
    a start error quotes (``None``: all of it).
    """

    def __init__(
        self,
        flags: Sequence[str],
        *,
        start_timeout_s: float,
        stop_timeout_s: float = 60.0,
        stop_signal: int = signal.SIGTERM,
        own_group: bool = True,
        tmp_prefix: str | None = "flare-",
        log: IO[str] | None = None,
        poll_s: float = 0.3,
        tail_lines: int | None = 15,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.stop_timeout_s = stop_timeout_s
        self.stop_signal = stop_signal
        self.own_group = own_group
        self.tail_lines = tail_lines
        self.tmp = tempfile.mkdtemp(prefix=tmp_prefix) if tmp_prefix is not None else None
        self._owns_log = log is None
        if log is None:
            path = os.path.join(self.tmp, "server.log") if self.tmp else None
            log = open(path, "w+") if path else tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.log = log
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if self.tmp is not None:
            env["TMPDIR"] = self.tmp
        self.cmd = [sys.executable, "-m", "runtime.cli", "run", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=own_group,  # coordinator and ranks in the server's group
        )
        try:
            self.wait_healthy(start_timeout_s, poll_s)
        except BaseException:
            self.stop()
            raise

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.3) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                message = f"flare run exited with code {code}: {self.tail()}"
                raise ServerStartError(message, code, self.output())
            if self.healthy():
                return
            if time.monotonic() > deadline:
                message = f"flare run not healthy after {timeout_s:g} s: {self.tail()}"
                raise ServerStartError(message, None, self.output())
            time.sleep(poll_s)

    def output(self) -> str:
        """Everything the server printed so far."""
        if self.log.closed or not self.log.readable():
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def tail(self, lines: int | None = None) -> str:
        """The last ``lines`` lines of the output (default ``tail_lines``), joined by " | "."""
        lines = self.tail_lines if lines is None else lines
        kept = self.output().strip().splitlines()
        return " | ".join(kept if lines is None else kept[-lines:])

    def stop(self) -> int | None:
        """The stop signal, SIGKILL after ``stop_timeout_s``; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._kill()
                self.proc.wait()
        if self.own_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, 0)  # anyone of the group still there?
                time.sleep(1.0)
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._owns_log:
            self.log.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.proc.returncode

    def _kill(self) -> None:
        if self.own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.kill()
