"""The coordinator engine: the process runtime around the scheduler.

``Engine`` binds the coordinator channel, handshakes with the ranks, checks
that their catalogs agree, builds the :class:`~runtime.coordinator.Scheduler`
and then loops: admit requests, plan/commit/publish frames, apply completions
in fence order, stream tokens.  See :mod:`runtime.coordinator.engine.core`.
"""

from runtime.coordinator.engine.config import EngineConfig, EngineError, EngineStartError
from runtime.coordinator.engine.core import Engine
from runtime.coordinator.engine.startup import ModelFacts, agree
from runtime.coordinator.engine.stats import EngineStats, FrameStat
from runtime.coordinator.engine.stream import (
    ABORTED,
    CANCELLED,
    ERROR,
    RequestStream,
    StreamResult,
    TokenEvent,
)

__all__ = [
    "ABORTED",
    "CANCELLED",
    "ERROR",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStartError",
    "EngineStats",
    "FrameStat",
    "ModelFacts",
    "RequestStream",
    "StreamResult",
    "TokenEvent",
    "agree",
]
