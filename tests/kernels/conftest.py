"""Kernel tests run under the Triton interpreter on CPU.

TRITON_INTERPRET is read when a kernel is decorated and again when it runs. It is
set here while the kernel modules are imported (before any test module imports
them), then restored, and set again around each test of this folder only, so
that no other test (nor a subprocess one spawns) inherits it.
"""

import importlib
import os
import pkgutil

import pytest

import kernels.triton

_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    # Every kernel module, imported for the side effect: its kernels are
    # decorated interpreted (checks.py holds no kernel).
    for _module in pkgutil.iter_modules(kernels.triton.__path__):
        importlib.import_module(f"kernels.triton.{_module.name}")
finally:
    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
