"""Benchmark an OpenAI-compatible server: throughput, TTFT, TPOT, ITL, goodput.

Sends a seeded workload (see ``runtime.loadgen.workload``) over HTTP, streaming.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --num-requests 200 --request-rate 8 --prompt-len uniform:64:256 \\
        --output-len 128 --ignore-eos --ttft-slo-ms 500 --tpot-slo-ms 50

Prints a table, writes ``--result-json`` (configuration, summary and one entry
per request) and ends stdout with one JSON line: the configuration and every
figure of the table.  Exits 0 unless no request succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from runtime.loadgen.client import PATHS, ClientConfig, first_model, run_benchmark
from runtime.loadgen.report import format_table, per_request, summarize
from runtime.loadgen.workload import (
    TOKEN_ID_RANGE,
    Distribution,
    WorkloadSpec,
    arrival_offsets,
    build_requests,
    parse_distribution,
)


def _checked(
    convert: Callable[[str], Any], ok: Callable[[Any], bool], need: str
) -> Callable[[str], Any]:
    """An argparse type: ``convert`` the text, then require ``ok`` of the value."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {need}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {need}, got {text!r}")
        return value

    return parse


_positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
_positive_ms = _checked(float, lambda v: 0 < v < math.inf, "a positive number of ms")
_seconds = _checked(float, lambda v: 0 < v < math.inf, "a positive number of seconds")
_rate = _checked(float, lambda v: v > 0, "a positive rate in requests/s, or inf")
_base_url = _checked(
    lambda t: t.rstrip("/"), lambda v: v.startswith(("http://", "https://")), "an http(s) URL"
)


def _distribution(text: str) -> Distribution:
    try:
        return parse_distribution(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prompts_file(path: str) -> tuple[str, ...]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {exc.strerror}") from None
    prompts = tuple(line for line in lines if line.strip())
    if not prompts:
        raise argparse.ArgumentTypeError(f"{path!r} holds no prompts")
    return prompts


def _id_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        low, high = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI integers, got {text!r}") from None
    if not 0 <= low < high:
        raise argparse.ArgumentTypeError(f"need 0 <= LO < HI, got {text!r}")
    return low, high


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flare bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", type=_base_url, default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=sorted(PATHS), default="completions")
    p.add_argument("--model", help="default: the first model GET /v1/models lists")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-requests", type=_positive_int, default=100)
    arrival = p.add_mutually_exclusive_group()
    arrival.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="Poisson arrivals in requests/s; inf sends everything at once",
    )
    arrival.add_argument(
        "--concurrency", type=_positive_int, help="keep N requests in flight, no waits"
    )
    dist_help = "N, uniform:LO:HI or normal:MEAN:STD[:LO:HI] (clamped)"
    p.add_argument("--prompt-len", type=_distribution, default="128", help=dist_help)
    p.add_argument("--output-len", type=_distribution, default="128", help=dist_help)
    p.add_argument(
        "--prompt-kind",
        choices=["words", "token-ids"],
        default="words",
        help="random words (about one token each), or token-id lists (completions only)",
    )
    p.add_argument(
        "--token-id-range",
        type=_id_range,
        default=f"{TOKEN_ID_RANGE[0]}:{TOKEN_ID_RANGE[1]}",
        help="LO:HI, token ids of token-id prompts (inside the model's vocabulary)",
    )
    p.add_argument(
        "--prompts-file",
        type=_prompts_file,
        help="explicit prompts, one a line, used in order instead of generated ones",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="vLLM extra: exact output lengths")
    p.add_argument("--ttft-slo-ms", type=_positive_ms, help="goodput: TTFT limit")
    p.add_argument("--tpot-slo-ms", type=_positive_ms, help="goodput: TPOT limit")
    p.add_argument("--timeout", type=_seconds, default=300.0, help="connect/read timeout (s)")
    p.add_argument("--result-json", type=Path, help="write the full result here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_kind == "token-ids" and args.endpoint == "chat" and not args.prompts_file:
        parser.error("argument --prompt-kind: token-ids prompts need --endpoint completions")
    model = args.model
    if model is None:
        try:
            model = first_model(args.base_url, args.api_key, args.timeout)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            print(f"error: no model from {args.base_url}/v1/models: {exc}", file=sys.stderr)
            return 1

    spec = WorkloadSpec(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        prompt_kind=args.prompt_kind,
        prompts=args.prompts_file or (),
        seed=args.seed,
        token_id_range=args.token_id_range,
    )
    config = ClientConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        timeout=args.timeout,
    )
    rate = math.inf if args.concurrency else args.request_rate
    offsets = arrival_offsets(args.num_requests, rate, args.seed)
    with tqdm(total=args.num_requests, unit="req", disable=None) as bar:
        records, duration = asyncio.run(
            run_benchmark(
                config, build_requests(spec), offsets, args.concurrency, lambda _: bar.update()
            )
        )

    summary = summarize(records, duration, args.ttft_slo_ms, args.tpot_slo_ms)
    settings = {
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "num_requests": args.num_requests,
        "request_rate": None if args.concurrency else str(args.request_rate),
        "concurrency": args.concurrency,
        "prompt_len": None if args.prompts_file else str(args.prompt_len),
        "output_len": str(args.output_len),
        "prompt_kind": "file" if args.prompts_file else args.prompt_kind,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "timeout_s": args.timeout,
    }
    result = {"config": settings, **summary}
    print(format_table(summary))
    if args.result_json is not None:
        full = {**result, "requests": per_request(records)}
        args.result_json.write_text(json.dumps(full, indent=2, allow_nan=False) + "\n")
    print(json.dumps(result, allow_nan=False), flush=True)
    return 0 if summary["completed"] else 1
