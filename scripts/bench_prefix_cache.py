"""Prefix caching over the HTTP server: multi-turn chat and a shared system prompt,
cache on vs off.

    python scripts/bench_prefix_cache.py             # 4 users x 6 turns; 32 shared-prompt users
    python scripts/bench_prefix_cache.py --quick     # smoke run: 2 users x 2 turns, 4 shared users

Each configuration is its own ``flare run`` process tree (the embedded default model,
``--device cpu`` unless ``--device`` says otherwise) on a free loopback port:
``cache_on`` is the server's default (prefix caching is on by default, as in vLLM),
``cache_off`` adds ``--no-enable-prefix-caching``.  ``--server-arg`` passes more flags
to both.  The script waits for ``/health``, sends one warm-up request (its own text,
as long as the longest workload prompt, so first-use costs of long prefills do not
land on the workloads), runs the two workloads, then stops the server (SIGTERM, then
SIGKILL to its process group after ``--stop-timeout`` s).  A server that fails to
start (e.g. a ``flare run`` that does not know ``--no-enable-prefix-caching`` yet) or
fails the warm-up is reported with its log's tail; its figures are null and the
script exits 1 after printing the JSON line.  Requests that fail during the workloads
are counted in the ``errors`` figures and left out of the others.

Workloads (both over ``/v1/chat/completions``, ``stream: true`` with
``stream_options.include_usage``, ``temperature: 0``, ``ignore_eos: true`` so every
reply is ``max_tokens`` long):

- multi-turn: ``--users`` users run concurrently, each ``--turns`` sequential turns.
  Turn 1 is a short system message plus a user message of ``--first-tokens`` tokens;
  each later turn appends the assistant's reply (the streamed text received) and a new
  user message of ``--turn-tokens`` tokens, and resends the whole conversation.
  ``--max-tokens`` output tokens per turn.  User text: consecutive words of
  ``pydoc_data.topics`` paragraphs, distinct per user and turn, the same in both
  configurations.
- shared: ``--shared-users`` requests, each the same ``--system-tokens``-token system
  prompt plus a distinct ``--question-tokens``-token user question, at most
  ``--concurrency`` in flight; ``--shared-max-tokens`` output tokens.

Figures, per request:

- TTFT: wall time from just before the request is sent to the arrival of the first
  stream chunk whose ``delta.content`` is non-empty (the client's view: HTTP,
  tokenization, queueing, prefill and the first decode step).
- prompt tokens: the final usage chunk's ``usage.prompt_tokens``.
- cached tokens: ``usage.prompt_tokens_details.cached_tokens``.  A server that does not
  send it (no prefix caching yet) counts as 0; the table shows "n/r (0)" and a note.
- computed tokens: prompt tokens - cached tokens (prompt tokens the server prefilled).
- new tokens (multi-turn, turns >= 2): the turn's prompt tokens beyond the longest
  common token prefix with (the previous turn's prompt token ids + the previous turn's
  output token ids).  Token ids come from the server's own code run in this process
  (``runtime.frontend``: the model's tokenizer and chat template, rendered and encoded
  exactly as ``parse_chat`` does; the rendered length is checked against
  ``usage.prompt_tokens``).  Output token ids: the reply text received, re-tokenized
  without special tokens (the chat API does not return token ids; a re-tokenized
  reply can differ from the sampled ids, which the common-prefix definition tolerates).
  Turn 1 has no previous turn: its new tokens are its whole prompt, and it is
  reported on its own row, outside the computed/new ratio.

Multi-turn figures (``multiturn_*``) are over turns >= 2, the turns that resend a
conversation; turn 1 is ``multiturn_turn1_*``.  computed/new is the sum of computed
tokens over the sum of new tokens.  Percentiles interpolate linearly between the
closest ranks (numpy's default).

Goals (the issue's): on multi-turn, computed/new <= 1.2 with the cache on, and the
TTFT p50 with the cache off at least 3x the one with it on.

Prints a table, then as the LAST line one JSON object with every figure (flat keys),
including ``multiturn_ttft_ms_p50_cache_on``, ``multiturn_ttft_ms_p50_cache_off``,
``multiturn_prompt_tokens_computed_over_new`` (cache on), ``multiturn_ttft_p50_speedup``
(off / on) and the goal booleans ``goal_multiturn_computed_over_new_met`` and
``goal_multiturn_ttft_speedup_met``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from runtime.loadgen.launcher import ServerProcess

CONFIGS = {"cache_on": (), "cache_off": ("--no-enable-prefix-caching",)}
GOAL_COMPUTED_OVER_NEW = 1.2
GOAL_TTFT_SPEEDUP = 3.0
SUMMARY_KEYS = (
    "requests",
    "errors",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "prompt_tokens",
    "cached_tokens",
    "cached_tokens_reported",
    "computed_tokens",
    "new_tokens",
    "computed_over_new",
)
SYSTEM_MESSAGE = "You are a helpful assistant who answers questions about Python."

# ------------------------------------------------------------------ pure parts


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token-id sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def new_tokens(
    prompt_ids: Sequence[int],
    prev_prompt_ids: Sequence[int] | None,
    prev_output_ids: Sequence[int] = (),
) -> int:
    """Prompt tokens beyond the longest common prefix with the previous turn's prompt
    plus output; the whole prompt when there is no previous turn."""
    if prev_prompt_ids is None:
        return len(prompt_ids)
    return len(prompt_ids) - common_prefix_len(prompt_ids, [*prev_prompt_ids, *prev_output_ids])


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Record:
    """One request's figures."""

    workload: str  # "multiturn" or "shared"
    user: int
    turn: int  # 1-based; 1 for shared
    ttft_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not report it
    completion_tokens: int = 0
    new_tokens: int | None = None  # multi-turn only
    rendered_tokens: int | None = None  # our own count of the prompt, multi-turn only
    error: str = ""

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - (self.cached_tokens or 0)


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """The figures of one workload's (successful) records."""
    ok = [r for r in records if not r.error]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    news = [r.new_tokens for r in ok if r.new_tokens is not None]
    out: dict[str, Any] = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_ms_p50": _round(percentile(ttfts, 50)),
        "ttft_ms_p99": _round(percentile(ttfts, 99)),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "cached_tokens_reported": bool(ok) and all(r.cached_tokens is not None for r in ok),
        "computed_tokens": sum(r.computed_tokens for r in ok),
        "new_tokens": sum(news) if news else None,
    }
    new = out["new_tokens"]
    out["computed_over_new"] = _round(out["computed_tokens"] / new, 3) if new else None
    return out


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def groups(records: Sequence[Record]) -> dict[str, list[Record]]:
    """Records by table row: multi-turn turns >= 2, multi-turn turn 1, shared."""
    return {
        "multiturn": [r for r in records if r.workload == "multiturn" and r.turn >= 2],
        "multiturn_turn1": [r for r in records if r.workload == "multiturn" and r.turn == 1],
        "shared": [r for r in records if r.workload == "shared"],
    }


def figures(
    runs: dict[str, list[Record] | None], errors: dict[str, str] | None = None
) -> dict[str, Any]:
    """Every figure as one flat dict: ``{group}_{figure}_{config}`` for each
    configuration's records (None: it did not run), plus speedups and goals."""
    errors = errors or {}
    out: dict[str, Any] = {}
    for config in CONFIGS:
        records = runs.get(config)
        for group, members in groups(records or []).items():
            summary = summarize(members) if records is not None else None
            for key in SUMMARY_KEYS:
                out[f"{group}_{key}_{config}"] = None if summary is None else summary[key]
        out[f"server_error_{config}"] = errors.get(config, "")
    on, off = out["multiturn_ttft_ms_p50_cache_on"], out["multiturn_ttft_ms_p50_cache_off"]
    ratio = out["multiturn_computed_over_new_cache_on"]
    out["multiturn_prompt_tokens_computed_over_new"] = ratio
    out["multiturn_ttft_p50_speedup"] = _round(off / on, 3) if on and off is not None else None
    son, soff = out["shared_ttft_ms_p50_cache_on"], out["shared_ttft_ms_p50_cache_off"]
    out["shared_ttft_p50_speedup"] = _round(soff / son, 3) if son and soff is not None else None
    out["goal_multiturn_computed_over_new"] = GOAL_COMPUTED_OVER_NEW
    out["goal_multiturn_ttft_speedup"] = GOAL_TTFT_SPEEDUP
    out["goal_multiturn_computed_over_new_met"] = (
        ratio is not None and ratio <= GOAL_COMPUTED_OVER_NEW
    )
    speedup = out["multiturn_ttft_p50_speedup"]
    out["goal_multiturn_ttft_speedup_met"] = speedup is not None and speedup >= GOAL_TTFT_SPEEDUP
    return out


def table(flat: dict[str, Any]) -> str:
    """The human-readable table of :func:`figures`' output."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    header = ("config", "workload", "reqs", "TTFT p50", "TTFT p99", "prompt", "cached")
    header += ("computed", "new", "comp/new")
    rows = [header]
    notes = []
    for config in CONFIGS:
        if flat.get(f"server_error_{config}"):
            rows.append((config, "(server failed)", *["-"] * (len(header) - 2)))
            continue
        for group, label in (
            ("multiturn_turn1", "multi-turn turn 1"),
            ("multiturn", "multi-turn turns>=2"),
            ("shared", "shared system prompt"),
        ):
            v = {k: flat.get(f"{group}_{k}_{config}") for k in SUMMARY_KEYS}
            cached = cell(v["cached_tokens"])
            if v["requests"] and not v["cached_tokens_reported"]:
                cached = "n/r (0)"
                if config == "cache_on":
                    notes.append(
                        f"{config} {label}: usage.prompt_tokens_details.cached_tokens "
                        "not reported by the server; counted as 0"
                    )
            reqs = cell(v["requests"])
            if v["errors"]:
                reqs += f" ({v['errors']} failed)"
            rows.append(
                (config, label, reqs, cell(v["ttft_ms_p50"]), cell(v["ttft_ms_p99"]),
                 cell(v["prompt_tokens"]), cached, cell(v["computed_tokens"]),
                 cell(v["new_tokens"]), cell(v["computed_over_new"]))
            )  # fmt: skip
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("(TTFT in ms; token columns are totals over the row's requests)")
    lines += [f"note: {n}" for n in notes]
    ratio, speedup = (
        flat["multiturn_prompt_tokens_computed_over_new"],
        flat["multiturn_ttft_p50_speedup"],
    )
    lines.append("")
    lines.append("goals:")
    lines.append(
        f"  multi-turn computed/new (cache on) {cell(ratio)} <= {GOAL_COMPUTED_OVER_NEW}: "
        f"{'met' if flat['goal_multiturn_computed_over_new_met'] else 'NOT met'}"
    )
    lines.append(
        f"  multi-turn TTFT p50 cache off / cache on {cell(speedup)} "
        f"({cell(flat['multiturn_ttft_ms_p50_cache_off'])} / "
        f"{cell(flat['multiturn_ttft_ms_p50_cache_on'])} ms) >= {GOAL_TTFT_SPEEDUP}: "
        f"{'met' if flat['goal_multiturn_ttft_speedup_met'] else 'NOT met'}"
    )
    for config in CONFIGS:
        if err := flat.get(f"server_error_{config}"):
            lines.append(f"{config}: server failed: {err}")
    return "\n".join(lines)


# ------------------------------------------------------------------ text and tokens


class Chat:
    """The server's tokenizer and chat template, run in this process: the prompt ids
    ``parse_chat`` gives a conversation, and a reply's ids."""

    def __init__(self, model_dir: Path) -> None:
        from runtime.frontend.chat import load_chat_template
        from runtime.frontend.tokenizer import ModelTokenizer

        self.tokenizer = ModelTokenizer.from_dir(model_dir)
        self.template = load_chat_template(model_dir, self.tokenizer)

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        from runtime.frontend.chat import ChatMessage

        text = self.template.render([ChatMessage(m["role"], m["content"]) for m in messages])
        return self.tokenizer.encode(text, add_special_tokens=self.template.add_special_tokens)

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


class TextSource:
    """Consecutive words of ``pydoc_data.topics`` paragraphs, handed out in pieces of
    about n tokens (the fewest words whose text is at least n tokens)."""

    def __init__(self, count: Callable[[str], int]) -> None:
        from pydoc_data.topics import topics

        self.count = count
        self.words: Iterator[str] = (
            word
            for key in sorted(topics)
            for para in topics[key].split("\n\n")
            for word in para.split()
        )

    def take(self, tokens: int) -> str:
        out: list[str] = []
        while True:
            try:
                out.append(next(self.words))
            except StopIteration:
                raise SystemExit(
                    "pydoc_data.topics ran out of text: ask for fewer tokens"
                ) from None
            text = " ".join(out)
            # A token is at least one character here: count only once that many.
            if len(text) >= tokens and self.count(text) >= tokens:
                return text


@dataclass
class Workload:
    """Every text of a run, the same for both configurations."""

    first: list[str]  # user's turn-1 message
    later: list[list[str]]  # [user][turn - 2] messages
    system_prompt: str
    questions: list[str]
    warmup: str = "Warm up: say anything."
    system_message: str = SYSTEM_MESSAGE


def make_workload(chat: Chat, args: argparse.Namespace) -> Workload:
    src = TextSource(lambda t: len(chat.text_ids(t)))
    first = [src.take(args.first_tokens) for _ in range(args.users)]
    later = [[src.take(args.turn_tokens) for _ in range(args.turns - 1)] for _ in range(args.users)]
    system = src.take(args.system_tokens)
    questions = [
        f"Question {i + 1}: what does this mean? {src.take(args.question_tokens)}"
        for i in range(args.shared_users)
    ]
    # Its own text, as long as the longest prompt, so first-use costs of long (chunked)
    # prefills fall on it, not on the workloads.
    warmup = src.take(max(args.system_tokens, args.first_tokens) + args.question_tokens)
    return Workload(first, later, system, questions, warmup)


# ------------------------------------------------------------------ the client


async def stream_chat(http, base: str, body: dict[str, Any]) -> tuple[float | None, str, dict]:
    """Send one streaming chat request: (TTFT ms, reply text, usage)."""
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict = {}
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter()
                    text.append(content)
    ttft = None if first is None else (first - sent) * 1000.0
    return ttft, "".join(text), usage


def fill_usage(record: Record, usage: dict) -> None:
    record.prompt_tokens = int(usage.get("prompt_tokens", 0))
    record.completion_tokens = int(usage.get("completion_tokens", 0))
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    record.cached_tokens = int(cached) if cached is not None else None


def body_for(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def multiturn_user(
    http, base: str, chat: Chat, work: Workload, user: int, args: argparse.Namespace
) -> list[Record]:
    messages = [
        {"role": "system", "content": work.system_message},
        {"role": "user", "content": work.first[user]},
    ]
    records: list[Record] = []
    prev_prompt: list[int] | None = None
    prev_output: list[int] = []
    for turn in range(1, args.turns + 1):
        if turn > 1:
            messages.append({"role": "user", "content": work.later[user][turn - 2]})
        record = Record("multiturn", user, turn)
        records.append(record)
        ids = chat.prompt_ids(messages)
        record.rendered_tokens = len(ids)
        record.new_tokens = new_tokens(ids, prev_prompt, prev_output)
        try:
            record.ttft_ms, reply, usage = await stream_chat(
                http, base, body_for(messages, args.max_tokens)
            )
        except Exception as exc:  # a failed turn ends this user's conversation
            record.error = f"{type(exc).__name__}: {exc}"
            break
        fill_usage(record, usage)
        prev_prompt, prev_output = ids, chat.text_ids(reply)
        messages.append({"role": "assistant", "content": reply})
    return records


async def shared_request(
    http, base: str, work: Workload, i: int, args: argparse.Namespace, gate: asyncio.Semaphore
) -> Record:
    messages = [
        {"role": "system", "content": work.system_prompt},
        {"role": "user", "content": work.questions[i]},
    ]
    record = Record("shared", i, 1)
    async with gate:
        try:
            record.ttft_ms, _, usage = await stream_chat(
                http, base, body_for(messages, args.shared_max_tokens)
            )
            fill_usage(record, usage)
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
    return record


async def run_workloads(base: str, chat: Chat, work: Workload, args) -> list[Record]:
    import httpx

    limits = httpx.Limits(max_connections=max(args.users, args.concurrency) + 4)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as http:
        # Warm-up: one request sharing nothing with the workloads but the template.
        warm = [{"role": "user", "content": work.warmup}]
        await stream_chat(http, base, body_for(warm, 4))
        per_user = await asyncio.gather(
            *(multiturn_user(http, base, chat, work, u, args) for u in range(args.users))
        )
        gate = asyncio.Semaphore(args.concurrency)
        shared = await asyncio.gather(
            *(shared_request(http, base, work, i, args, gate) for i in range(args.shared_users))
        )
    return [r for rs in per_user for r in rs] + list(shared)


# ------------------------------------------------------------------ the server


def start_server(flags: Sequence[str], start_timeout: float, stop_timeout: float) -> ServerProcess:
    """``flare run`` as its own process group on a free port (runtime.loadgen.launcher):
    ``stop()`` sends SIGTERM, then SIGKILL to its group after ``stop_timeout`` s (or to
    anything of the group left once the server has exited)."""
    from runtime.loadgen.launcher import ServerProcess

    return ServerProcess(
        flags,
        start_timeout_s=start_timeout,
        stop_timeout_s=stop_timeout,
        tmp_prefix="flare-bench-prefix-",
    )


def run_config(name: str, chat: Chat, work: Workload, args) -> tuple[list[Record] | None, str]:
    flags = [*CONFIGS[name], "--device", args.device, *args.server_arg]
    if args.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len is not None:
        flags += ["--max-model-len", str(args.max_model_len)]
    print(f"[{name}] starting flare run {' '.join(flags)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        server = start_server(flags, args.start_timeout, args.stop_timeout)
    except RuntimeError as exc:
        print(f"[{name}] server failed to start: {exc}", file=sys.stderr, flush=True)
        return None, str(exc)
    try:
        print(
            f"[{name}] healthy after {time.monotonic() - started:.1f} s; running workloads",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.monotonic()
        records = asyncio.run(run_workloads(server.base, chat, work, args))
        print(f"[{name}] workloads took {time.monotonic() - t0:.1f} s", file=sys.stderr)
    except Exception as exc:  # the warm-up failed: the server is not usable
        err = f"{type(exc).__name__}: {exc}; server log: {server.tail()}"
        print(f"[{name}] the warm-up request failed: {err}", file=sys.stderr, flush=True)
        return None, err
    finally:
        code = server.stop()
        print(f"[{name}] server stopped (exit code {code})", file=sys.stderr, flush=True)
    for r in records:
        if r.error:
            print(f"[{name}] {r.workload} user {r.user} turn {r.turn}: {r.error}", file=sys.stderr)
    mismatched = [
        r for r in records if not r.error and r.rendered_tokens not in (None, r.prompt_tokens)
    ]
    if mismatched:
        r = mismatched[0]
        print(
            f"[{name}] warning: {len(mismatched)} multi-turn prompts rendered here to a length "
            f"other than usage.prompt_tokens (e.g. {r.rendered_tokens} vs {r.prompt_tokens}): "
            "new-token counts may be off",
            file=sys.stderr,
        )
    return records, ""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 users x 2 turns, 4 shared")
    p.add_argument("--users", type=int, default=4, help="multi-turn users (default: 4)")
    p.add_argument("--turns", type=int, default=6, help="turns per user (default: 6)")
    p.add_argument("--first-tokens", type=int, default=300, help="turn-1 user message tokens")
    p.add_argument("--turn-tokens", type=int, default=75, help="later user message tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="multi-turn output tokens")
    p.add_argument("--shared-users", type=int, default=32, help="shared-prompt requests")
    p.add_argument("--system-tokens", type=int, default=1000, help="shared system prompt tokens")
    p.add_argument("--question-tokens", type=int, default=20, help="shared user question tokens")
    p.add_argument("--concurrency", type=int, default=8, help="shared requests in flight")
    p.add_argument("--shared-max-tokens", type=int, default=16, help="shared output tokens")
    p.add_argument("--configs", default="cache_on,cache_off", help="which to run, in order")
    p.add_argument("--device", default="cpu", help="flare run --device (default: cpu)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="flare run --max-num-seqs")
    p.add_argument("--max-model-len", type=int, default=None, help="flare run --max-model-len")
    p.add_argument(
        "--server-arg", action="append", default=[], help="another flare run flag (repeatable)"
    )
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to /health")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="SIGTERM grace seconds")
    p.add_argument("--request-timeout", type=float, default=600.0, help="httpx timeout")
    args = p.parse_args(argv)
    if args.quick:
        args.users, args.turns, args.shared_users = 2, 2, 4
        args.first_tokens, args.turn_tokens, args.system_tokens = 200, 50, 1000
        args.max_tokens, args.shared_max_tokens, args.concurrency = 8, 4, 4
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        p.error(f"--configs takes {', '.join(CONFIGS)}; got {unknown or 'none'}")
    if args.users < 1 or args.turns < 1 or args.shared_users < 0 or args.concurrency < 1:
        p.error("--users, --turns and --concurrency must be >= 1, --shared-users >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from runtime.ranks.model import default_model_dir

    chat = Chat(Path(default_model_dir()))
    work = make_workload(chat, args)
    runs: dict[str, list[Record] | None] = {c: None for c in CONFIGS}
    errors: dict[str, str] = {}
    for name in args.configs:
        runs[name], err = run_config(name, chat, work, args)
        if err:
            errors[name] = err
    flat = figures(runs, errors)
    flat.update(
        users=args.users,
        turns=args.turns,
        max_tokens=args.max_tokens,
        shared_users=args.shared_users,
        concurrency=args.concurrency,
        system_tokens=args.system_tokens,
        quick=args.quick,
    )
    print(table(flat))
    print(json.dumps(flat, sort_keys=True), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
