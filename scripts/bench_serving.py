"""Benchmark: load an OpenAI-compatible server (flare's or vLLM's) over HTTP.

Usage: ``python scripts/bench_serving.py --base-url http://127.0.0.1:8000
[--endpoint completions|chat] [--num-requests 100] [--request-rate 8 |
--concurrency 16] [--prompt-len uniform:64:256] [--output-len 128] [--ignore-eos]
[--ttft-slo-ms 500 --tpot-slo-ms 50] [--result-json out.json]``

See ``runtime.cli.commands.bench`` for every flag; the last stdout line is one JSON
object with every figure printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.cli.commands.bench import main

if __name__ == "__main__":
    sys.exit(main())
