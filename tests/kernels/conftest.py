"""Kernel tests run under the Triton interpreter on CPU.

TRITON_INTERPRET is read when a kernel is decorated and again when it runs. It is
set here while the kernel modules are imported (before any test module imports
them), then restored, and set again around each test of this folder only, so
that no other test (nor a subprocess one spawns) inherits it.
"""

import os

import pytest

_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    # Imported for the side effect: their kernels are decorated interpreted.
    import kernels.triton.kv_write
    import kernels.triton.paged_decode_attention
    import kernels.triton.paged_prefill_attention  # noqa: F401
finally:
    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
