"""``python -m runtime.cli ...``: the same as ``flare ...``."""

import sys

from runtime.cli import main

sys.exit(main())
