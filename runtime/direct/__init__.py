"""Direct mode (``flare run --direct``): a diagnostic scheduler of its own.

It replaces the coordinator's :class:`~runtime.coordinator.scheduler.Scheduler`
inside the engine with :class:`DirectScheduler`, which shares no selection
code with it: FCFS prefills, value-per-time decode rounds, a 7/8 moving
average of graph costs that reverts to unmeasured after 30 s.  When a fault
persists under direct mode it lies in the ranks; when it goes away, in the
scheduler.  See ``docs/direct-mode.md``.

Modules: :mod:`~runtime.direct.config` (its numbers),
:mod:`~runtime.direct.cost` (the moving averages),
:mod:`~runtime.direct.residency` (requests, FCFS slots and pages),
:mod:`~runtime.direct.selection` (which program, which lanes) and
:mod:`~runtime.direct.scheduler` (plan, commit, complete).
"""

from runtime.direct.config import DirectConfig
from runtime.direct.cost import DirectCatalog, cost_sample_ns
from runtime.direct.scheduler import DirectScheduler

__all__ = ["DirectCatalog", "DirectConfig", "DirectScheduler", "cost_sample_ns"]
