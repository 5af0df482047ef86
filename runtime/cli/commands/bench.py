"""Benchmark an OpenAI-compatible server: throughput, TTFT, TPOT, ITL, goodput.

Sends a seeded workload (see ``runtime.loadgen.workload``) over HTTP, streaming.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --num-requests 200 --request-rate 8 --prompt-len uniform:64:256 \\
        --output-len 128 --ignore-eos --ttft-slo-ms 500 --tpot-slo-ms 50

Prints a table, writes ``--result-json`` (configuration, summary and one entry
per request) and ends stdout with one JSON line: the configuration and every
figure of the table.  Exits 0 unless no request succeeded.  This module reads
the flags; :func:`runtime.loadgen.bench.run_bench` runs the benchmark.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import httpx

from runtime.cli.converters import (
    base_url,
    bench_seconds,
    distribution,
    expected_positive_int,
    id_range,
    positive_ms,
    prompts_file,
    request_rate,
    tokenizer_vocab,
)
from runtime.cli.parsing import HelpFormatter
from runtime.loadgen.bench import BenchSettings, run_bench
from runtime.loadgen.client import PATHS, ClientConfig, model_card
from runtime.loadgen.workload import (
    EMBEDDED_TOKENS_PER_WORD,
    TOKEN_ID_RANGE,
    WorkloadSpec,
    token_id_range_for,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flare bench",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--base-url",
        metavar="URL",
        type=base_url,
        default="http://127.0.0.1:8000",
        help="the server, http(s)://HOST:PORT (the API is under /v1)",
    )
    p.add_argument(
        "--endpoint",
        choices=sorted(PATHS),
        default="completions",
        help="the route: completions (/v1/completions) or chat (/v1/chat/completions)",
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        help="the model field of every request (default: the first model GET /v1/models lists)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="sent as 'Authorization: Bearer KEY' (default: none)",
    )
    p.add_argument(
        "--num-requests",
        metavar="N",
        type=expected_positive_int,
        default=100,
        help="requests to send",
    )
    arrival = p.add_mutually_exclusive_group()
    arrival.add_argument(
        "--request-rate",
        metavar="RATE",
        type=request_rate,
        default=math.inf,
        help="Poisson arrivals in requests/s; inf sends everything at once",
    )
    arrival.add_argument(
        "--concurrency",
        metavar="N",
        type=expected_positive_int,
        help="keep N requests in flight, no waits (default: --request-rate)",
    )
    _add_workload_flags(p)
    _add_measurement_flags(p)
    return p


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The prompts and the output lengths."""
    dist_help = "N, uniform:LO:HI or normal:MEAN:STD[:LO:HI] (clamped)"
    p.add_argument(
        "--prompt-len",
        metavar="DIST",
        type=distribution,
        default="128",
        help=f"prompt lengths (words, or tokens with token-id prompts): {dist_help}",
    )
    p.add_argument(
        "--output-len",
        metavar="DIST",
        type=distribution,
        default="128",
        help=f"max_tokens of each request: {dist_help}",
    )
    p.add_argument(
        "--prompt-kind",
        choices=["words", "token-ids"],
        default="words",
        help="random common words (--prompt-len counts words; measured "
        f"{EMBEDDED_TOKENS_PER_WORD} tokens per word with the embedded default model, "
        "the server's usage reports the real count), or token-id lists, exact lengths "
        "(completions only); default: words",
    )
    p.add_argument(
        "--token-id-range",
        metavar="LO:HI",
        type=id_range,
        default=None,
        help="token ids of token-id prompts; default: the middle of the served "
        "model's vocabulary (vocab_size from /v1/models, or --tokenizer), "
        f"else {TOKEN_ID_RANGE[0]}:{TOKEN_ID_RANGE[1]}",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        type=tokenizer_vocab,
        help="a model directory or tokenizer.json: its vocabulary bounds token-id prompts "
        "(for servers whose /v1/models gives no vocab_size, such as vLLM; default: none)",
    )
    p.add_argument(
        "--prompts-file",
        metavar="FILE",
        type=prompts_file,
        help="explicit prompts, one a line, used in order instead of generated ones "
        "(default: generated)",
    )


def _add_measurement_flags(p: argparse.ArgumentParser) -> None:
    """Seeds, SLOs, the timeout and the result file."""
    p.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=0,
        help="seeds the prompts, the lengths and the arrival times",
    )
    p.add_argument("--ignore-eos", action="store_true", help="vLLM extra: exact output lengths")
    p.add_argument(
        "--ttft-slo-ms",
        metavar="MS",
        type=positive_ms,
        help="goodput: TTFT limit (default: none)",
    )
    p.add_argument(
        "--tpot-slo-ms",
        metavar="MS",
        type=positive_ms,
        help="goodput: TPOT limit (default: none)",
    )
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=bench_seconds,
        default=300.0,
        help="connect/read timeout of each request",
    )
    p.add_argument(
        "--result-json",
        metavar="FILE",
        type=Path,
        help="write the full result here: configuration, summary, one entry per request "
        "(default: none)",
    )


def _model(args: argparse.Namespace, token_ids: bool) -> tuple[str | None, dict]:
    """The model name and the server's model card (``{}`` when not needed or not
    read); None: no model, and the error was printed."""
    model, card = args.model, {}
    if model is None or (token_ids and args.tokenizer is None):
        try:
            card = model_card(args.base_url, args.api_key, args.timeout)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            if model is None:
                print(f"error: no model from {args.base_url}/v1/models: {exc}", file=sys.stderr)
                return None, card
        model = model or str(card["id"])
    return model, card


def _token_range(
    args: argparse.Namespace, parser: argparse.ArgumentParser, card: dict, token_ids: bool
) -> tuple[int, int]:
    """The token ids of token-id prompts: the flag, else the middle of the vocabulary."""
    vocab, vocab_from = args.tokenizer, "--tokenizer"
    if vocab is None and type(card.get("vocab_size")) is int and card["vocab_size"] >= 2:
        vocab, vocab_from = card["vocab_size"], "/v1/models"
    token_range = args.token_id_range
    if token_range is None:
        token_range = TOKEN_ID_RANGE if vocab is None else token_id_range_for(vocab)
        if token_ids and vocab is None:
            print(
                f"note: the vocabulary size is unknown (no vocab_size in /v1/models, no "
                f"--tokenizer): token ids drawn from {token_range[0]}:{token_range[1]}",
                file=sys.stderr,
            )
    elif token_ids and vocab is not None and token_range[1] > vocab:
        parser.error(
            f"argument --token-id-range: {token_range[0]}:{token_range[1]} reaches past the "
            f"vocabulary of {vocab} tokens ({vocab_from})"
        )
    return token_range


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    token_ids = args.prompt_kind == "token-ids" and not args.prompts_file
    if token_ids and args.endpoint == "chat":
        parser.error("argument --prompt-kind: token-ids prompts need --endpoint completions")
    model, card = _model(args, token_ids)
    if model is None:
        return 1
    token_range = _token_range(args, parser, card, token_ids)
    spec = WorkloadSpec(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        prompt_kind=args.prompt_kind,
        prompts=args.prompts_file or (),
        seed=args.seed,
        token_id_range=token_range,
    )
    client = ClientConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        timeout=args.timeout,
    )
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
        "token_id_range": f"{token_range[0]}:{token_range[1]}" if token_ids else None,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "timeout_s": args.timeout,
    }
    return run_bench(
        spec,
        client,
        BenchSettings(
            request_rate=args.request_rate,
            concurrency=args.concurrency,
            ttft_slo_ms=args.ttft_slo_ms,
            tpot_slo_ms=args.tpot_slo_ms,
            result_json=args.result_json,
            config=settings,
        ),
    )
