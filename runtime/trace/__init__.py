"""The live plan trace: one JSON line per committed frame, and the tools that read it.

Written in the coordinator process (``flare run --trace FILE``):

* :mod:`runtime.trace.writer`: the file (size limit, rotation, 0600 in 0700
  directories), a bounded queue drained by a writer thread (a drop counter,
  never blocking the engine) and a ring of recent lines for ``/debug/trace``;
* :mod:`runtime.trace.lines`: what a line holds (the scheduler's trace record,
  the lanes, every rank's interval and timestamps, the coordinator's);
* :mod:`runtime.trace.clocks`: each rank's clock offset from frame round trips.

Read back by ``flare trace``:

* :mod:`runtime.trace.files`: a trace file and its rotated predecessors, in order;
* :mod:`runtime.trace.summary`: per-graph and per-rank figures (``flare trace summary``);
* :mod:`runtime.trace.timeline`: Chrome trace / Perfetto JSON (``flare trace timeline``).
"""
