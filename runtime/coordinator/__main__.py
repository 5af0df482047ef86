"""Coordinator process of an HTTP deployment: ``python -m runtime.coordinator``.

``flare run`` (serving) starts it with its own command-line flags plus
``--api-requests`` / ``--api-outputs``, the endpoints the frontend bound.  The
flags are runtime/cli/coordinator_process.py's; the process body (the engine,
the ranks, the frontend bridge) is runtime/coordinator/engine/main.py's.
"""

import sys

from runtime.cli.coordinator_process import main

if __name__ == "__main__":
    sys.exit(main())
