"""Discrete-event simulator that drives the production scheduler, unchanged.

``python -m scripts.scheduling_sim --help`` for the command line; tests import
:class:`Simulation` directly.
"""

from scripts.scheduling_sim.catalogs import (
    PROFILES,
    AdditiveProfile,
    CostProfile,
    RooflineProfile,
    build_catalog,
)
from scripts.scheduling_sim.engine import RequestStats, Simulation, solo_latency_ns
from scripts.scheduling_sim.workload import (
    Arrival,
    LogNormal,
    Uniform,
    WorkloadConfig,
    burst,
    chat,
    long_prompt_contention,
    make_workload,
    two_tenants,
)

__all__ = [
    "PROFILES",
    "AdditiveProfile",
    "Arrival",
    "CostProfile",
    "LogNormal",
    "RequestStats",
    "RooflineProfile",
    "Simulation",
    "Uniform",
    "WorkloadConfig",
    "build_catalog",
    "burst",
    "chat",
    "long_prompt_contention",
    "make_workload",
    "solo_latency_ns",
    "two_tenants",
]
