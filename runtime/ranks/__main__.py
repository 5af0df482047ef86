"""Rank process entry point: ``torchrun --nproc-per-node N -m runtime.ranks ...``.

The flags are runtime/cli/rank_process.py's; the process body is
runtime/ranks/process.py's (docs/deploy.md).
"""

import sys

from runtime.cli.rank_process import main

if __name__ == "__main__":
    sys.exit(main())
