"""The reference selection (issue 25): the scheduler's selection as it stood
before it was made fast, with the spec-exactness fixes, kept slow on purpose.

``policy``, ``rounds``, ``state_ops``, ``projection``, ``learning`` and
``refresh`` are frozen copies of the ``runtime/coordinator`` modules of the same
names at that point (their imports of each other point here; the shared
arithmetic, ``utility``, ``prerequisites``, ``service``, ``cost`` and the
request state stay the runtime's).  :func:`planning.reference_plan` is
``Scheduler.plan()`` over them.  ``tests/coordinator/test_selection_reference.py``
holds the fast path to it: the same graph, cohort, lane order, query lengths or
ceilings, prompt row and reason, the score equal to 1e-9 relative.

Change these files only to fix a departure from the spec, together with the
runtime, and with a test that fails on the code before.
"""
