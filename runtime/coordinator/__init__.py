"""The coordinator: scheduling and price state (pure Python, no torch/sockets/clocks)."""

from runtime.catalog import CatalogError, GraphDescriptor, GraphKind
from runtime.coordinator.config import ConfigError, PolicyConfig, SchedulerConfig
from runtime.coordinator.plan import (
    LanePhase,
    LaneWork,
    ScheduledPlan,
    SelectionReason,
    TraceRecord,
)
from runtime.coordinator.records import CompletionRecord, ExecutionTiming, GeneratedToken
from runtime.coordinator.requests import AdmissionError, Phase, RequestHandle, RequestSpec
from runtime.coordinator.scheduler import (
    CommitError,
    CompletionError,
    PublicationError,
    Scheduler,
    SchedulerError,
)

__all__ = [
    "AdmissionError",
    "CatalogError",
    "CommitError",
    "CompletionError",
    "CompletionRecord",
    "ConfigError",
    "ExecutionTiming",
    "GeneratedToken",
    "GraphDescriptor",
    "GraphKind",
    "LanePhase",
    "LaneWork",
    "Phase",
    "PolicyConfig",
    "PublicationError",
    "RequestHandle",
    "RequestSpec",
    "ScheduledPlan",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SelectionReason",
    "TraceRecord",
]
