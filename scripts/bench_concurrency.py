"""How many request slots: `flare run --max-num-seqs N` under `flare bench` load.

    python scripts/bench_concurrency.py                      # slots 8 16 32 64, 8 and 16 req/s
    python scripts/bench_concurrency.py --slots 8,32 --rates 8,16 --device cpu

For each slot count it starts `flare run` on a free loopback port (the
embedded model unless --model), then runs `flare bench` at each Poisson rate
with short token-id prompts and a fixed output length (so KV residency is not
the limit), and stops the server.  Prints one table; the last line is one JSON
object with every figure.  The measurement behind the default of
`--max-num-seqs` (docs/serving.md, "Default concurrency").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.loadgen.launcher import ServerProcess, ServerStartError  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def start(slots: int, args: argparse.Namespace, log) -> ServerProcess:
    """``flare run --max-num-seqs SLOTS`` healthy on a free port; ``stop()`` sends SIGINT."""
    flags = ["--max-num-seqs", str(slots), "--device", args.device]
    if args.model:
        flags.append(args.model)
    try:
        return ServerProcess(
            flags,
            start_timeout_s=args.startup_timeout,
            stop_timeout_s=60.0,
            stop_signal=signal.SIGINT,
            own_group=False,
            tmp_prefix=None,
            log=log,
            poll_s=0.5,
        )
    except ServerStartError as exc:
        if exc.code is not None:
            raise SystemExit(f"flare run --max-num-seqs {slots} exited with {exc.code}") from None
        raise SystemExit(f"flare run --max-num-seqs {slots} did not become healthy") from None


def bench(base: str, rate: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "runtime.cli", "bench", "--base-url", base,
           "--num-requests", str(args.num_requests), "--request-rate", str(rate),
           "--prompt-kind", "token-ids", "--prompt-len", args.prompt_len,
           "--output-len", str(args.output_len), "--ignore-eos", "--ttft-slo-ms", "500",
           "--tpot-slo-ms", "50", "--seed", str(args.seed), "--result-json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=_ints, default=[8, 16, 32, 64])
    p.add_argument("--rates", type=_ints, default=[8, 16])
    p.add_argument("--model", help="model directory (default: the embedded model)")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--prompt-len", default="uniform:32:256")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="flare-bench-concurrency-") as tmp:
        for slots in args.slots:
            with open(Path(tmp) / f"server-{slots}.log", "w") as log:
                server = start(slots, args, log)
                try:
                    for rate in args.rates:
                        r = bench(server.base, rate, args, Path(tmp) / f"{slots}-{rate}.json")
                        rows.append({"slots": slots, "rate": rate} | {
                            k: r[k] for k in ("request_throughput", "output_throughput",
                                              "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                              "p99_tpot_ms", "request_goodput", "completed")
                        })  # fmt: skip
                finally:
                    server.stop()
    print(f"{'slots':>5} {'rate':>4} {'req/s':>6} {'out tok/s':>9} {'TTFT med/p99 ms':>16} "
          f"{'TPOT med/p99 ms':>16} {'goodput':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['slots']:>5} {r['rate']:>4} {r['request_throughput']:>6.2f} "
            f"{r['output_throughput']:>9.0f} "
            f"{r['median_ttft_ms']:>7.0f} / {r['p99_ttft_ms']:<6.0f} "
            f"{r['median_tpot_ms']:>7.1f} / {r['p99_tpot_ms']:<6.1f} {r['request_goodput']:>8.2f}"
        )
    print(json.dumps({"results": rows, "settings": vars(args)}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
