"""``python -m runtime.frontend.preprocess``: one preprocessing worker (its frames on
stdin and stdout; :func:`runtime.frontend.preprocess.worker.worker_main`)."""

import sys

from runtime.frontend.preprocess.worker import worker_main

sys.exit(worker_main())
