"""Both schedulers satisfy the engine's one stated interface (runtime.coordinator.interface).

Statically shaped: every member of :class:`EngineScheduler` exists on
:class:`Scheduler` and :class:`DirectScheduler` with a compatible signature
(same parameters, in order, with the same kinds and defaults), properties are
properties, data members are set on an instance; and at run time
``isinstance`` holds (the Protocol is ``runtime_checkable``).  The engine calls
nothing else on its scheduler.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.interface import EngineScheduler
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from runtime.direct.scheduler import DirectScheduler

ENGINE = Path(__file__).resolve().parents[2] / "runtime" / "coordinator" / "engine"
CATALOG = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.DECODE, 1),
    GraphDescriptor(GraphKind.DECODE, 4),
)
SCHEDULERS = (Scheduler, DirectScheduler)
# Read by make_scheduler on the coordinator's Scheduler it has just built (typed as
# such), never through the interface.
BUILDER_ONLY = {"speculation"}
# Read-only in the Protocol (a property there, so each scheduler may keep its own
# catalog type), a plain attribute on the schedulers: checked on an instance.
READ_ONLY_ATTRIBUTES = {"catalog"}


def protocol_members() -> tuple[dict[str, object], set[str], set[str]]:
    """The Protocol's methods (by name), properties and data members."""
    methods: dict[str, object] = {}
    properties: set[str] = set()
    for name, value in vars(EngineScheduler).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            properties.add(name)
        elif inspect.isfunction(value):
            methods[name] = value
    return methods, properties, set(EngineScheduler.__annotations__)


def test_the_interface_names_the_spec_completion_methods() -> None:
    methods, properties, data = protocol_members()
    for name in (
        "complete",
        "complete_with_survival",
        "complete_packed_round",
        "complete_packed_round_with_survival",
    ):
        assert name in methods
    assert {"in_flight", "running", "waiting", "free_pages", "catalog"} <= properties
    assert {"config", "executions", "execution_ns"} <= data


@pytest.mark.parametrize("cls", SCHEDULERS, ids=lambda c: c.__name__)
def test_every_method_exists_with_a_compatible_signature(cls: type) -> None:
    methods, properties, _ = protocol_members()
    for name, wanted in methods.items():
        have = getattr(cls, name, None)
        assert callable(have), f"{cls.__name__} lacks {name}()"
        want_params = list(inspect.signature(wanted).parameters.values())
        have_params = list(inspect.signature(have).parameters.values())
        assert [(p.name, p.kind) for p in have_params] == [(p.name, p.kind) for p in want_params], (
            f"{cls.__name__}.{name}{inspect.signature(have)} != {inspect.signature(wanted)}"
        )
        for want, got in zip(want_params, have_params):
            assert got.default == want.default, f"{cls.__name__}.{name}: {got.name}'s default"
    for name in properties - READ_ONLY_ATTRIBUTES:
        assert isinstance(inspect.getattr_static(cls, name, None), property), (
            f"{cls.__name__}.{name} is not a property"
        )


@pytest.mark.parametrize("cls", SCHEDULERS, ids=lambda c: c.__name__)
def test_an_instance_is_an_engine_scheduler(cls: type) -> None:
    scheduler = cls(CATALOG, SchedulerConfig(max_slots=4, page_size=16, num_pages=64))
    assert isinstance(scheduler, EngineScheduler)
    _, properties, data = protocol_members()
    for name in data | properties:
        assert hasattr(scheduler, name), f"{cls.__name__} has no {name}"
    assert isinstance(scheduler.config, SchedulerConfig)
    assert isinstance(scheduler.catalog.estimates(), dict)
    assert isinstance(scheduler.memory_stats(), dict)


def test_direct_mode_answers_what_it_has_no_notion_of_plainly() -> None:
    scheduler = DirectScheduler(CATALOG, SchedulerConfig(max_slots=4, page_size=16, num_pages=64))
    assert scheduler.memory_stats() == {}
    handle = scheduler.admit(RequestSpec(4, 2))
    assert scheduler.generation_start(handle) is None


def test_a_plain_object_is_no_engine_scheduler() -> None:
    assert not isinstance(object(), EngineScheduler)


def scheduler_attributes(path: Path) -> set[str]:
    """Attributes the engine module reads on ``scheduler`` or ``self.scheduler``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "scheduler") or (
            isinstance(base, ast.Attribute)
            and base.attr == "scheduler"
            and isinstance(base.value, ast.Name)
            and base.value.id == "self"
        ):
            found.add(node.attr)
    return found


def test_the_engine_uses_only_the_interface() -> None:
    methods, properties, data = protocol_members()
    allowed = set(methods) | properties | data | BUILDER_ONLY
    used = set().union(*(scheduler_attributes(p) for p in sorted(ENGINE.glob("*.py"))))
    assert used, "the scan found no scheduler calls in the engine"
    assert used <= allowed, f"the engine reaches past EngineScheduler: {sorted(used - allowed)}"
