"""A load generator for any OpenAI-compatible HTTP endpoint (this project's server,
vLLM, ...): seeded workloads, a streaming client that times every chunk, and the
usual serving metrics (throughput, TTFT, TPOT, ITL, goodput).

Run it with ``python scripts/bench_serving.py --help``.
"""
