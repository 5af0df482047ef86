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

from runtime.loadgen.client import PATHS, ClientConfig, model_card, run_benchmark
from runtime.loadgen.progress import ProgressLines
from runtime.loadgen.report import format_table, per_request, summarize
from runtime.loadgen.workload import (
    EMBEDDED_TOKENS_PER_WORD,
    TOKEN_ID_RANGE,
    Distribution,
    WorkloadSpec,
    arrival_offsets,
    build_requests,
    parse_distribution,
    token_id_range_for,
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


def _tokenizer_vocab(path: str) -> int:
    """The vocabulary size (added tokens included) of a ``tokenizer.json``, or of the
    one in a model directory."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    try:
        return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # tokenizers raises its own exception types
        raise argparse.ArgumentTypeError(f"cannot load {file}: {exc}") from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help states it already
    or there is none (as ``flare run --help``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default in (None, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action) or help_text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flare bench",
        description=__doc__.splitlines()[0],
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--base-url",
        metavar="URL",
        type=_base_url,
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
        "--num-requests", metavar="N", type=_positive_int, default=100, help="requests to send"
    )
    arrival = p.add_mutually_exclusive_group()
    arrival.add_argument(
        "--request-rate",
        metavar="RATE",
        type=_rate,
        default=math.inf,
        help="Poisson arrivals in requests/s; inf sends everything at once",
    )
    arrival.add_argument(
        "--concurrency",
        metavar="N",
        type=_positive_int,
        help="keep N requests in flight, no waits (default: --request-rate)",
    )
    dist_help = "N, uniform:LO:HI or normal:MEAN:STD[:LO:HI] (clamped)"
    p.add_argument(
        "--prompt-len",
        metavar="DIST",
        type=_distribution,
        default="128",
        help=f"prompt lengths (words, or tokens with token-id prompts): {dist_help}",
    )
    p.add_argument(
        "--output-len",
        metavar="DIST",
        type=_distribution,
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
        type=_id_range,
        default=None,
        help="token ids of token-id prompts; default: the middle of the served "
        "model's vocabulary (vocab_size from /v1/models, or --tokenizer), "
        f"else {TOKEN_ID_RANGE[0]}:{TOKEN_ID_RANGE[1]}",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        type=_tokenizer_vocab,
        help="a model directory or tokenizer.json: its vocabulary bounds token-id prompts "
        "(for servers whose /v1/models gives no vocab_size, such as vLLM; default: none)",
    )
    p.add_argument(
        "--prompts-file",
        metavar="FILE",
        type=_prompts_file,
        help="explicit prompts, one a line, used in order instead of generated ones "
        "(default: generated)",
    )
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
        type=_positive_ms,
        help="goodput: TTFT limit (default: none)",
    )
    p.add_argument(
        "--tpot-slo-ms",
        metavar="MS",
        type=_positive_ms,
        help="goodput: TPOT limit (default: none)",
    )
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_seconds,
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
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    token_ids = args.prompt_kind == "token-ids" and not args.prompts_file
    if token_ids and args.endpoint == "chat":
        parser.error("argument --prompt-kind: token-ids prompts need --endpoint completions")
    model, card = args.model, {}
    if model is None or (token_ids and args.tokenizer is None):
        try:
            card = model_card(args.base_url, args.api_key, args.timeout)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            if model is None:
                print(f"error: no model from {args.base_url}/v1/models: {exc}", file=sys.stderr)
                return 1
        model = model or str(card["id"])
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

    spec = WorkloadSpec(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        prompt_kind=args.prompt_kind,
        prompts=args.prompts_file or (),
        seed=args.seed,
        token_id_range=token_range,
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
    requests = build_requests(spec)
    if sys.stderr.isatty():
        with tqdm(total=args.num_requests, unit="req") as bar:
            records, duration = asyncio.run(
                run_benchmark(config, requests, offsets, args.concurrency, lambda _: bar.update())
            )
    else:  # a log or a pipe: a line every few seconds, not a bar
        lines = ProgressLines(args.num_requests)
        work = run_benchmark(config, requests, offsets, args.concurrency, lines.update)
        records, duration = asyncio.run(lines.run(work))

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
        "token_id_range": f"{token_range[0]}:{token_range[1]}" if token_ids else None,
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
