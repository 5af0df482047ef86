"""The coordinator: scheduling and price state (pure Python, no torch/sockets/clocks).

Each name lives in the module that defines it, for instance
:class:`~runtime.coordinator.scheduler.Scheduler`,
:class:`~runtime.coordinator.config.SchedulerConfig` and
:class:`~runtime.coordinator.requests.RequestSpec`; the process runtime
around the scheduler (channel, threads, clocks) is :mod:`runtime.coordinator.engine`.
"""
