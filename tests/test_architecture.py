"""The house's rules, read from the source: no import cycles, no layering leaks, sizes kept.

Every ``import`` in ``runtime/`` and ``kernels/`` counts, wherever it is written:
inside a function, or under ``if TYPE_CHECKING:`` (a cycle there is still a
cycle in the design, and turns real the day someone needs the name at run time).
``from package import name`` is an edge to ``package.name`` when that is a
module, and always to ``package`` itself, whose ``__init__`` Python runs first.

ARCHITECTURE.md states the layers these tests hold; CONTRIBUTING.md says what
to do when one fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "kernels")

# The pure scheduler: what ``runtime/coordinator/*.py`` (not its ``engine/``)
# and everything it imports from the repository may never import.
IMPURE = ("torch", "zmq", "time", "threading")

# The processes that need no torch: the frontend (``flare run`` itself, and
# ``flare run --prompt``'s in-process coordinator) and the coordinator process.
# What their entry modules run at import (their module-level imports, the
# packages above each module) may not reach these; imports inside functions
# (``--device auto`` asking torch for CUDA) are paid only when called.
TORCH_FREE_ENTRIES = (
    "runtime.cli.app",
    "runtime.cli.commands.run",
    "runtime.cli.coordinator_process",
    "runtime.coordinator.engine.main",
    "runtime.frontend.serve",
)
DEVICE_LIBRARIES = ("torch", "triton", "safetensors.torch")

# Shape: files and functions past these sizes want splitting along a concept.
MAX_FILE_LINES = 520
MAX_FUNCTION_LINES = 85


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted (a repository module or an external one)
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _resolve(source: str, path: Path, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


@cache
def imports() -> tuple[Import, ...]:
    known = modules()
    found: list[Import] = []
    for source, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [Import(source, alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(source, path, node.level, node.module)
                found.append(Import(source, base, node.lineno))
                for alias in node.names:
                    if f"{base}.{alias.name}" in known:
                        found.append(Import(source, f"{base}.{alias.name}", node.lineno))
    return tuple(found)


def _internal(target: str) -> str | None:
    """The repository module an import names (``a.b.c`` may name a name in ``a.b``)."""
    known = modules()
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


@cache
def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in modules()}
    for edge in imports():
        target = _internal(edge.target)
        if target is not None and target != edge.source:
            edges[edge.source].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _closure(start: str) -> set[str]:
    edges = graph()
    seen = {start}
    todo = [start]
    while todo:
        for target in edges[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _is_pure_scheduler(module: str) -> bool:
    """A module file directly in runtime/coordinator/ (its subpackages hold the I/O)."""
    path = modules()[module]
    return path.parent == ROOT / "runtime" / "coordinator" and path.stem != "__main__"


def _is_cli(module: str) -> bool:
    return module == "runtime.cli" or module.startswith("runtime.cli.")


def _is_entry_point(module: str) -> bool:
    return module.endswith(".__main__")


def test_the_rules_see_the_house() -> None:
    """The scan reads the real tree (a broken walk would pass every rule below)."""
    names = modules()
    assert "runtime.coordinator.scheduler" in names
    assert "runtime.cli" in names
    assert any(_is_pure_scheduler(name) for name in names)
    assert sum(len(targets) for targets in graph().values()) > 100
    # And the cycle finder finds a cycle that is there.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    cycles = _cycles(graph())
    assert not cycles, "import cycles (each line one cycle's modules):\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_the_pure_scheduler_imports_no_torch_sockets_clocks_or_threads() -> None:
    pure = [name for name in modules() if _is_pure_scheduler(name)]
    reached = set().union(*(_closure(name) for name in pure))
    leaks = [
        f"{edge.source}:{edge.line} imports {edge.target}"
        for edge in imports()
        if edge.source in reached and edge.target.split(".")[0] in IMPURE
    ]
    where = "the pure scheduler (runtime/coordinator/*.py and what it imports) reaches"
    assert not leaks, f"{where}:\n" + "\n".join(leaks)


def test_library_code_does_not_import_the_command_line() -> None:
    leaks = [
        f"{edge.source}:{edge.line} imports {edge.target}"
        for edge in imports()
        if _is_cli(edge.target) and not _is_cli(edge.source) and not _is_entry_point(edge.source)
    ]
    assert not leaks, "library modules importing runtime.cli:\n" + "\n".join(leaks)


def test_entry_points_are_thin() -> None:
    """``python -m runtime.X`` modules parse nothing themselves: they hand argv to runtime.cli."""
    fat = [
        f"{path.relative_to(ROOT)}: {len(path.read_text().splitlines())} lines"
        for name, path in modules().items()
        if _is_entry_point(name) and len(path.read_text().splitlines()) > 40
    ]
    assert not fat, "entry points that do more than call into runtime.cli:\n" + "\n".join(fat)


def test_the_frontend_depends_on_transport_not_on_the_coordinator() -> None:
    frontend = [name for name in modules() if name.startswith("runtime.frontend")]
    reached = set().union(*(_closure(name) for name in frontend))
    coordinator = ("runtime.coordinator", "runtime.direct")
    leaks = sorted(name for name in reached if name.startswith(coordinator))
    assert not leaks, f"runtime.frontend reaches coordinator modules: {leaks}"


# ARCHITECTURE.md's layers, bottom up: a module may import its own layer or a
# lower one, never a higher one.  The first prefix that a module name starts
# with places it (so ``runtime.coordinator.engine`` before ``runtime.coordinator``).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("runtime.catalog", "runtime.identity", "runtime.image_spans", "runtime.logs",
     "runtime.private_files", "runtime.speculation"),  # shared leaves
    ("runtime.transport",),
    ("runtime.coordinator",),  # the pure scheduler
    ("runtime.coordinator.engine", "runtime.direct", "runtime.ranks", "kernels",
     "runtime.trace"),
    ("runtime.deploy",),
    ("runtime.frontend", "runtime.loadgen", "runtime.replay", "runtime.local"),
    ("runtime.cli",),
)  # fmt: skip
# The top of a process: what its ``__main__`` runs once the command line is parsed.
# It assembles the process from every layer (the rank's device checks, the
# coordinator's deployment config), and only runtime.cli imports it.
PROCESS_MAINS = ("runtime.ranks.process", "runtime.coordinator.engine.main")


def _layer(module: str) -> int:
    placed = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(f"{prefix}.")
    ]
    assert placed, f"{module} is on no layer of ARCHITECTURE.md (add it to LAYERS)"
    return max(placed)[1]


def test_imports_run_down_the_layers() -> None:
    up = []
    for source, targets in graph().items():
        if _is_entry_point(source) or source in PROCESS_MAINS:
            continue
        for target in sorted(targets):
            if _layer(target) > _layer(source):
                up.append(f"{source} (layer {_layer(source)}) imports {target} "
                          f"(layer {_layer(target)})")  # fmt: skip
    assert not up, "imports that run up ARCHITECTURE.md's layers:\n" + "\n".join(up)


def test_only_the_command_line_imports_a_process_main() -> None:
    importers = sorted(
        f"{source} imports {target}"
        for source, targets in graph().items()
        for target in targets
        if target in PROCESS_MAINS and not _is_cli(source)
    )
    assert not importers, "\n".join(importers)
    assert all(name in modules() for name in PROCESS_MAINS)


def _runs_at_import(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module executes when imported: none inside a function, none
    under ``if TYPE_CHECKING:``."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]


def _import_time_closure(start: str) -> tuple[set[str], list[str]]:
    """The repository modules importing ``start`` runs, and the external modules
    they import (``source:line target``)."""
    known = modules()
    seen: set[str] = set()
    external: list[str] = []
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parent = name.rpartition(".")[0]
        if parent in known:
            todo.append(parent)  # a package's __init__ runs before its modules
        path = known[name]
        for node in _runs_at_import(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, path, node.level, node.module)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                internal = _internal(target)
                if internal is not None:
                    todo.append(internal)
                elif target.split(".")[0] not in PACKAGES:
                    external.append(f"{name}:{node.lineno} {target}")
    return seen, external


@pytest.mark.parametrize("entry", TORCH_FREE_ENTRIES)
def test_the_frontend_and_coordinator_start_without_torch(entry: str) -> None:
    """Importing torch costs ~1.5 s of CPU and ~300 MB per process; only the ranks
    need it."""
    reached, external = _import_time_closure(entry)
    assert "runtime.deploy.local" in reached or entry != "runtime.coordinator.engine.main"
    leaks = [
        line
        for line in external
        if any(line.split()[1] == lib or line.split()[1].startswith(f"{lib}.")
               for lib in DEVICE_LIBRARIES)
    ]  # fmt: skip
    assert not leaks, f"importing {entry} imports a device library:\n" + "\n".join(leaks)


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_files_and_functions_stay_small() -> None:
    big = []
    for path in modules().values():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            big.append(f"{path.relative_to(ROOT)}: {lines} lines (> {MAX_FILE_LINES})")
        for function in _functions(ast.parse(text)):
            length = (function.end_lineno or function.lineno) - function.lineno + 1
            if length > MAX_FUNCTION_LINES:
                where = f"{path.relative_to(ROOT)}:{function.lineno}"
                big.append(f"{where} {function.name}: {length} lines (> {MAX_FUNCTION_LINES})")
    assert not big, "split these along a concept's seam:\n" + "\n".join(sorted(big))


def _test_modules() -> list[Path]:
    return sorted((ROOT / "tests").rglob("*.py"))


@pytest.mark.parametrize("rule", ["tests import only tests.support"])
def test_no_test_module_imports_another(rule: str) -> None:
    """Shared test code lives in tests/support; a test module is imported by pytest alone."""
    leaks = []
    for path in _test_modules():
        if "support" in path.relative_to(ROOT / "tests").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else ["<relative>"]
            for name in names:
                shared = name.startswith("tests.support")
                if name == "<relative>" or (name.startswith("tests") and not shared):
                    leaks.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not leaks, f"{rule}:\n" + "\n".join(leaks)
