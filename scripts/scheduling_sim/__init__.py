"""Discrete-event simulator that drives the production scheduler, unchanged.

``python -m scripts.scheduling_sim --help`` for the command line; tests import
:class:`Simulation` directly.
"""

from scripts.scheduling_sim.catalogs import (
    PROFILES,
    AdditiveProfile,
    CopyProposerProfile,
    CostProfile,
    RooflineProfile,
    build_catalog,
    profile_for,
)
from scripts.scheduling_sim.engine import RequestStats, Simulation, solo_latency_ns
from scripts.scheduling_sim.workload import (
    ACCEPTANCE,
    AcceptanceProfile,
    Arrival,
    LogNormal,
    Uniform,
    WorkloadConfig,
    assign_acceptance,
    burst,
    chat,
    long_prompt_contention,
    make_workload,
    two_tenants,
)

__all__ = [
    "ACCEPTANCE",
    "PROFILES",
    "AcceptanceProfile",
    "AdditiveProfile",
    "Arrival",
    "CopyProposerProfile",
    "CostProfile",
    "LogNormal",
    "RequestStats",
    "RooflineProfile",
    "Simulation",
    "Uniform",
    "WorkloadConfig",
    "assign_acceptance",
    "build_catalog",
    "burst",
    "chat",
    "long_prompt_contention",
    "make_workload",
    "profile_for",
    "solo_latency_ns",
    "two_tenants",
]
