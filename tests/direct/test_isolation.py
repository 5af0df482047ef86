"""Direct mode shares no selection code with the coordinator's scheduler.

Its modules may import plain data and bookkeeping types only (plans, requests,
records, errors, slots and pages, the scheduler config, the catalog), the
standard library, and each other; never the coordinator's policy, utility,
service, projection, cost, refresh, learning or queue modules, its Scheduler,
torch, sockets or clocks.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

DIRECT = Path(__file__).resolve().parents[2] / "runtime" / "direct"
ALLOWED_RUNTIME = {
    "runtime.catalog",
    "runtime.coordinator.config",
    "runtime.coordinator.errors",
    "runtime.coordinator.plan",
    "runtime.coordinator.records",
    "runtime.coordinator.requests",
    "runtime.coordinator.resources",
}
FORBIDDEN_STDLIB = {"time", "datetime", "socket", "threading", "asyncio", "random"}


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("path", sorted(DIRECT.glob("*.py")), ids=lambda p: p.name)
def test_direct_modules_import_only_data_types_and_the_standard_library(path: Path) -> None:
    for name in imports(path):
        top = name.split(".")[0]
        if name.startswith("runtime.direct") or name == "__future__":
            continue
        if top == "runtime":
            assert name in ALLOWED_RUNTIME, f"{path.name} imports {name}"
        else:
            assert top in sys.stdlib_module_names, f"{path.name} imports {name}"
            assert top not in FORBIDDEN_STDLIB, f"{path.name} imports {name}"


def test_every_module_says_what_it_is() -> None:
    for path in DIRECT.glob("*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), path.name
