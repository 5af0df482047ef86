"""Short temporary directories: an ``ipc://`` socket path must fit in about 107
bytes, and pytest's ``tmp_path`` (longer under pytest-xdist, which adds the
worker's ``popen-gwN/``) leaves too little room for a run directory's sockets."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory directly in the system's temporary directory, removed after."""
    path = Path(tempfile.mkdtemp(prefix="flare-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
