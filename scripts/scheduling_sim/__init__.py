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
from scripts.scheduling_sim.engine import Simulation
from scripts.scheduling_sim.workload import Arrival, WorkloadConfig, make_workload

__all__ = [
    "PROFILES",
    "AdditiveProfile",
    "Arrival",
    "CostProfile",
    "RooflineProfile",
    "Simulation",
    "WorkloadConfig",
    "build_catalog",
    "make_workload",
]
