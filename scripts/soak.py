"""Soak: rounds of concurrent streaming completions through the HTTP server at TP=2
on CPU, checked token by token against their non-streamed greedy twins, with the
memory of every process and the KV pages watched between rounds.

    python scripts/soak.py                 # 3 rounds x 256 streams, -tp 2, CPU
    python scripts/soak.py --quick         # smoke run: 2 rounds x 32 streams

One ``flare run`` process tree (``-tp 2 --device cpu``, the embedded default model,
``--max-waiting-requests`` at least ``--requests``, ``--num-pages 2048``;
``--server-arg`` passes more flags) on a free loopback port serves every round.  The
pool is small on purpose: round 1's prompts fill it, so the prefix cache evicts in
every round and its index (about 1.3 KB of coordinator memory per cached page) is at
its steady size before the RSS baseline; with the default pool (over 14k pages on
CPU) the index grows by each round's new prompts until the pool is full, which is
bounded growth, not a leak, and showed as 5.3% of the coordinator's RSS.
Each round:

1. ``--requests`` streaming ``/v1/completions`` requests are opened at once (one
   connection each, all in flight together): greedy (``temperature: 0``),
   ``ignore_eos``, ``logprobs: 2``, ``max_tokens`` uniform in
   [``--min-tokens``, ``--max-tokens``], prompts of mixed lengths (most short, about a
   third long, a quarter of them behind one shared preamble so concurrent requests
   share prefix-cache pages), new prompts every round.  ``/health`` is polled
   meanwhile (its slowest answer is reported).
2. Each prompt's twin is sent non-streamed (``--twin-concurrency`` in flight), same
   prompt, same settings.
3. The script waits until the coordinator is idle (``flare_num_requests_running``,
   ``_waiting`` and ``flare_frames_in_flight`` at 0) and reads the KV pages requests
   still hold (``flare_kv_pages_used``: prefix-cache pages no request holds count as
   free), then the RSS of every process of the tree (psutil: the frontend, the
   coordinator, the ranks and any launcher between them).

Checks (each failing one makes the exit code 1):

- every request completes (``data: [DONE]`` after a chunk with a ``finish_reason``)
  or gets an explicit error (an HTTP error status with an OpenAI error body, or an
  SSE error object); anything else (a stream that ends or times out without either)
  is ``incomplete``.  Explicit errors are counted in ``errors`` and fail the run
  beyond ``--max-errors`` (default 0: with a waiting limit above the burst, none is
  expected).
- no token lost or duplicated: a stream's tokens are the per-token strings of its
  chunks' ``logprobs.tokens`` (the server decodes each token id on its own), in
  order; they must equal the twin's list, and so must the concatenated text, and
  both must hold ``max_tokens`` entries.  The decoded string of a token id is unique
  for every id of the default tokenizer but its byte tokens (which all show as
  U+FFFD); the script counts the compared positions that fall on such an ambiguous
  string (``ambiguous_positions``; there a token is identified by its string and
  its log probability).  A pair that differs is ``mismatched``; when the first
  difference is a position where the twin's top two log probabilities are within
  ``--tie-margin`` nats, the two runs chose between near-equal logits, which batch
  composition (floating-point summation order) can flip, and the pair is also
  counted in ``near_tie_mismatches`` and shown as an example; mismatches that are
  not near ties fail the run, near ties only with ``--strict-ties``.
- RSS: for every process alive after both round 1 and the last round, the growth
  from after round 1 to after the last round is at most ``--rss-tolerance-pct``
  (default 5; allocators keep freed memory, so round 1, not the idle server, is the
  baseline).  A process that appeared or vanished between them also fails.
- no page leak: after each round, once idle, ``flare_kv_pages_used`` is 0 and every
  cached page is idle (``flare_kv_pages_cached`` equals
  ``flare_kv_pages_cached_idle``).  ``leaked_pages`` is the most pages found held.

Prints a table per round and one for the processes' memory, then as the LAST line
one JSON object with ``requests``, ``completed``, ``errors``, ``mismatched_streams``,
``rss_growth_max_pct`` and ``leaked_pages`` plus more figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from runtime.loadgen.launcher import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
REPLACEMENT = "\ufffd"  # how a byte token decodes on its own
WORDS = (
    "river", "stone", "cloud", "light", "sand", "forest", "window", "garden", "silver",
    "morning", "harbor", "bridge", "candle", "winter", "summer", "valley", "meadow", "thunder",
    "lantern", "orchard", "copper", "marble", "feather", "engine", "signal", "number",
    "letter", "question", "answer", "market", "village", "castle", "station",
)  # fmt: skip
PREAMBLE = " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(48))


# ------------------------------------------------------------------ requests


@dataclass(frozen=True)
class Job:
    index: int
    prompt: str
    max_tokens: int


@dataclass
class Result:
    """One response as received: per-token strings, text, finish, usage, error."""

    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    done: bool = False
    error: str = ""  # an explicit error from the server
    broken: str = ""  # neither a completion nor an explicit error
    completion_tokens: int | None = None

    @property
    def completed(self) -> bool:
        return not self.error and not self.broken and self.finish is not None and self.done


def make_jobs(round_index: int, count: int, args: argparse.Namespace) -> list[Job]:
    """``count`` prompts of mixed lengths, distinct per round, and their max_tokens."""
    rng = random.Random(args.seed * 1000 + round_index)
    jobs = []
    for i in range(count):
        n = rng.randint(60, 200) if rng.random() < 0.3 else rng.randint(3, 40)
        words = " ".join(rng.choice(WORDS) for _ in range(n))
        prompt = f"{PREAMBLE} {words}" if rng.random() < 0.25 else words
        prompt = f"r{round_index} q{i}: {prompt}"
        jobs.append(Job(i, prompt, rng.randint(args.min_tokens, args.max_tokens)))
    return jobs


def payload(job: Job, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _error_text(status: int, raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error")
        message = error.get("message") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = raw.decode(errors="replace")[:300]
    return f"HTTP {status}: {message}"


def _take_choice(result: Result, choice: dict[str, Any]) -> None:
    result.text += choice.get("text") or ""
    lp = choice.get("logprobs")
    if lp:
        result.tokens += lp["tokens"]
        result.logprobs += lp["token_logprobs"]
        result.top += lp["top_logprobs"]
    if choice.get("finish_reason") is not None:
        result.finish = choice["finish_reason"]


async def stream_one(http: Any, job: Job) -> Result:
    import httpx

    result = Result()
    try:
        async with http.stream("POST", "/v1/completions", json=payload(job, True)) as response:
            if response.status_code != 200:
                result.error = _error_text(response.status_code, await response.aread())
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {chunk['error']}"
                    continue
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    _take_choice(result, choice)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.broken = f"{type(exc).__name__}: {exc}"
    if not result.error and not result.broken and not result.completed:
        result.broken = "the stream ended without a finish_reason and [DONE]"
    return result


async def twin_one(http: Any, job: Job, gate: asyncio.Semaphore) -> Result:
    import httpx

    result = Result(done=True)
    async with gate:
        try:
            response = await http.post("/v1/completions", json=payload(job, False))
        except (httpx.HTTPError, OSError) as exc:
            result.broken = f"{type(exc).__name__}: {exc}"
            return result
    if response.status_code != 200:
        result.error = _error_text(response.status_code, response.content)
        return result
    out = response.json()
    _take_choice(result, out["choices"][0])
    result.completion_tokens = out["usage"]["completion_tokens"]
    if result.finish is None:
        result.broken = "no finish_reason"
    return result


async def health_probe(base: str, stop: asyncio.Event, seen: list[tuple[float, int]]) -> None:
    """(seconds, status) of /health every 0.5 s until ``stop``."""
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        while not stop.is_set():
            started = time.monotonic()
            try:
                status = (await http.get("/health")).status_code
            except httpx.HTTPError:
                status = 0
            seen.append((time.monotonic() - started, status))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


async def run_round(base: str, jobs: Sequence[Job], args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=60.0)
    health: list[tuple[float, int]] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as http:
        probe = asyncio.create_task(health_probe(base, stop, health))
        started = time.monotonic()
        streams = await asyncio.gather(*(stream_one(http, job) for job in jobs))
        stream_s = time.monotonic() - started
        stop.set()
        await probe
        gate = asyncio.Semaphore(args.twin_concurrency)
        started = time.monotonic()
        twins = await asyncio.gather(*(twin_one(http, job, gate) for job in jobs))
        twin_s = time.monotonic() - started
    return {
        "streams": streams,
        "twins": twins,
        "stream_s": stream_s,
        "twin_s": twin_s,
        "health_max_s": max((s for s, _ in health), default=None),
        "health_not_ok": sum(1 for _, status in health if status != 200),
    }


# ------------------------------------------------------------------ comparison


@dataclass(frozen=True)
class Verdict:
    mismatched: bool
    near_tie: bool
    position: int | None  # the first differing token (None: none or lengths only)
    detail: str


def compare(job: Job, stream: Result, twin: Result, tie_margin: float) -> Verdict:
    """A completed stream against its completed twin (see the module docstring)."""
    want = job.max_tokens
    same = stream.tokens == twin.tokens and stream.text == twin.text
    counted = stream.completion_tokens == want and twin.completion_tokens == want
    if same and counted and len(twin.tokens) == want:
        return Verdict(False, False, None, "")
    position = next((i for i, (a, b) in enumerate(zip(stream.tokens, twin.tokens)) if a != b), None)
    if position is None and stream.tokens == twin.tokens:  # an ambiguous string differed?
        position = next(
            (
                i
                for i, (a, b) in enumerate(zip(stream.logprobs, twin.logprobs))
                if stream.tokens[i] == REPLACEMENT and abs(a - b) > tie_margin
            ),
            None,
        )
    near_tie = False
    margin = None
    if position is not None and position < len(twin.top):
        values = sorted(twin.top[position].values(), reverse=True)
        if len(values) >= 2:
            margin = values[0] - values[1]
            near_tie = margin <= tie_margin
    detail = (
        f"request {job.index} (max_tokens {want}): stream {len(stream.tokens)} tokens, "
        f"twin {len(twin.tokens)}, usage {stream.completion_tokens}/{twin.completion_tokens}; "
        f"first difference at token {position}"
    )
    if position is not None:
        lo = max(0, position - 2)
        detail += (
            f": stream {stream.tokens[lo : position + 2]!r} vs twin "
            f"{twin.tokens[lo : position + 2]!r}; twin's top-2 there "
            f"{twin.top[position] if position < len(twin.top) else None} "
            f"(margin {margin if margin is None else f'{margin:.2e}'})"
        )
    return Verdict(True, near_tie, position, detail)


def ambiguous_strings(model_dir: Path) -> set[str]:
    """Token strings that more than one token id decodes to (alone)."""
    from runtime.frontend.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer.from_dir(model_dir)
    seen: dict[str, int] = {}
    for token in range(tokenizer.vocab_size):
        text = tokenizer.decode([token], skip_special_tokens=False)
        seen[text] = seen.get(text, 0) + 1
    return {text for text, count in seen.items() if count > 1}


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
        tmp_prefix="flare-soak-",
    )


def server_rss(server: ServerProcess) -> dict[int, tuple[str, int]]:
    """pid -> (a short name, RSS bytes) of the server and all its descendants."""
    import psutil

    root = psutil.Process(server.proc.pid)
    out: dict[int, tuple[str, int]] = {}
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            name = _short_name(proc.cmdline())
            if name == "ranks":
                name = f"rank {proc.environ().get('RANK', '?')}"
            out[proc.pid] = (name, proc.memory_info().rss)
    return out


def _short_name(cmdline: Sequence[str]) -> str:
    for i, part in enumerate(cmdline):
        if part == "-m" and i + 1 < len(cmdline):
            module = cmdline[i + 1]
            if module == "runtime.cli":
                return "frontend"
            return module.removeprefix("runtime.")
    return Path(cmdline[0]).name if cmdline else "?"


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics summed over its labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def settle(base: str, timeout: float) -> tuple[dict[str, float], float]:
    """The metrics once the coordinator is idle (or at ``timeout``), and the wait."""
    started = time.monotonic()
    while True:
        m = metrics(base)
        idle = all(
            m.get(name, 0.0) == 0
            for name in (
                "flare_num_requests_running",
                "flare_num_requests_waiting",
                "flare_frames_in_flight",
                "flare_kv_pages_used",
            )
        )
        if idle or time.monotonic() - started > timeout:
            return m, time.monotonic() - started
        time.sleep(0.25)


def has_flag(flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "run", "--help"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=False,
    )
    return flag in out.stdout


# ------------------------------------------------------------------ report


ROUND_COLUMNS = (
    ("round", "round"),
    ("requests", "requests"),
    ("completed", "completed"),
    ("errors", "errors"),
    ("incomplete", "incomplete"),
    ("mismatched", "mismatched"),
    ("near_tie", "near-tie"),
    ("tokens", "tokens"),
    ("stream_s", "streams s"),
    ("tokens_per_s", "tok/s"),
    ("twin_s", "twins s"),
    ("health_max_s", "health max s"),
    ("settle_s", "settle s"),
    ("pages_used", "pages held"),
    ("pages_cached", "cached"),
    ("pages_cached_idle", "cached idle"),
    ("evicted", "evicted"),
    ("frames", "frames"),
    ("engine_cancelled", "cancelled"),
    ("rss_mb", "RSS MB (all)"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [list(header), *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds x 32 streams")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default: 3)")
    p.add_argument("--requests", type=int, default=256, help="streams per round (default: 256)")
    p.add_argument("--min-tokens", type=int, default=8, help="least max_tokens (default: 8)")
    p.add_argument("--max-tokens", type=int, default=48, help="most max_tokens (default: 48)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=2, help="(default: 2)")
    p.add_argument("--device", default="cpu", help="flare run --device (default: cpu)")
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="flare run --max-waiting-requests (default: --requests)",
    )
    p.add_argument(
        "--server-arg", action="append", default=[], help="another flare run flag (repeatable)"
    )
    p.add_argument(
        "--num-pages",
        type=int,
        default=2048,
        help="flare run --num-pages; 0: the server's default (default: 2048, which round 1 "
        "fills, so the prefix cache is at its steady size before the RSS baseline)",
    )
    p.add_argument("--twin-concurrency", type=int, default=64, help="twins in flight (64)")
    p.add_argument("--seed", type=int, default=0, help="prompt generator seed (default: 0)")
    p.add_argument("--tie-margin", type=float, default=1e-3, help="nats (default: 1e-3)")
    p.add_argument("--strict-ties", action="store_true", help="near-tie mismatches fail too")
    p.add_argument("--max-errors", type=int, default=0, help="explicit errors allowed (0)")
    p.add_argument("--rss-tolerance-pct", type=float, default=5.0, help="(default: 5)")
    p.add_argument("--settle-timeout", type=float, default=60.0, help="seconds to idle (60)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to /health")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="SIGTERM grace seconds")
    p.add_argument("--request-timeout", type=float, default=900.0, help="httpx read timeout")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.requests = 2, 32
    if args.rounds < 2 or args.requests < 1:
        p.error("--rounds must be >= 2 (RSS compares round 1 with the last) and --requests >= 1")
    if not 1 <= args.min_tokens <= args.max_tokens:
        p.error("--min-tokens and --max-tokens: need 1 <= min <= max")
    if args.twin_concurrency < 1:
        p.error("--twin-concurrency must be >= 1")
    if args.max_waiting_requests is None:
        args.max_waiting_requests = args.requests
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from runtime.ranks.model import default_model_dir

    failures: list[str] = []
    ambiguous = ambiguous_strings(Path(default_model_dir()))
    flags = ["-tp", str(args.tensor_parallel_size), "--device", args.device]
    if args.num_pages:
        flags += ["--num-pages", str(args.num_pages)]
    flags += args.server_arg
    waiting_flag = has_flag("--max-waiting-requests")
    if waiting_flag:
        flags += ["--max-waiting-requests", str(args.max_waiting_requests)]
    else:
        failures.append("flare run has no --max-waiting-requests: ran without a waiting limit")
    print(f"[soak] starting flare run {' '.join(flags)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        server = start_server(flags, args.start_timeout, args.stop_timeout)
    except RuntimeError as exc:
        print(f"[soak] server failed to start: {exc}", file=sys.stderr, flush=True)
        print(json.dumps({"requests": 0, "completed": 0, "errors": 0, "mismatched_streams": 0,
                          "rss_growth_max_pct": None, "leaked_pages": None,
                          "failures": [f"server failed to start: {exc}"]}))  # fmt: skip
        return 1
    print(f"[soak] healthy after {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)

    rows: list[list[Any]] = []
    rss_after: list[dict[int, tuple[str, int]]] = []
    totals = dict(requests=0, completed=0, errors=0, incomplete=0, mismatched=0, near_tie=0,
                  twin_errors=0, ambiguous_positions=0, tokens=0)  # fmt: skip
    leaked = 0
    examples: list[str] = []
    health_max = 0.0
    health_not_ok = 0
    pages_total = 0
    try:
        before = metrics(server.base)
        for r in range(1, args.rounds + 1):
            jobs = make_jobs(r, args.requests, args)
            print(f"[soak] round {r}: {len(jobs)} streams", file=sys.stderr, flush=True)
            out = asyncio.run(run_round(server.base, jobs, args))
            m, settle_s = settle(server.base, args.settle_timeout)
            rss_after.append(server_rss(server))
            count = dict.fromkeys(totals, 0)
            for job, stream, twin in zip(jobs, out["streams"], out["twins"]):
                count["requests"] += 1
                if stream.error:
                    count["errors"] += 1
                    examples.append(f"round {r} request {job.index}: {stream.error}")
                elif stream.broken:
                    count["incomplete"] += 1
                    examples.append(f"round {r} request {job.index}: {stream.broken}")
                else:
                    count["completed"] += 1
                    count["tokens"] += len(stream.tokens)
                if not twin.completed:
                    count["twin_errors"] += 1
                    examples.append(f"round {r} twin {job.index}: {twin.error or twin.broken}")
                if not stream.completed or not twin.completed:
                    continue
                verdict = compare(job, stream, twin, args.tie_margin)
                count["ambiguous_positions"] += sum(1 for t in twin.tokens if t in ambiguous)
                if verdict.mismatched:
                    count["mismatched"] += 1
                    count["near_tie"] += verdict.near_tie
                    kind = "near tie" if verdict.near_tie else "MISMATCH"
                    examples.append(f"round {r} {kind}: {verdict.detail}")
            for key, value in count.items():
                totals[key] += value
            held = int(m.get("flare_kv_pages_used", 0.0))
            cached_held = int(
                m.get("flare_kv_pages_cached", 0.0) - m.get("flare_kv_pages_cached_idle", 0.0)
            )
            leaked = max(leaked, held, cached_held)
            cancelled = m.get("flare_engine_requests_cancelled_total", 0.0) - before.get(
                "flare_engine_requests_cancelled_total", 0.0
            )
            evicted = m.get("flare_prefix_cache_evicted_pages_total", 0.0) - before.get(
                "flare_prefix_cache_evicted_pages_total", 0.0
            )
            pages_total = int(m.get("flare_kv_pages_total", 0.0))
            frames = m.get("flare_frames_total", 0.0) - before.get("flare_frames_total", 0.0)
            before = m
            health_max = max(health_max, out["health_max_s"] or 0.0)
            health_not_ok += out["health_not_ok"]
            tokens_per_s = count["tokens"] / out["stream_s"] if out["stream_s"] else None
            rows.append([r, count["requests"], count["completed"], count["errors"],
                         count["incomplete"], count["mismatched"], count["near_tie"],
                         count["tokens"], out["stream_s"], tokens_per_s, out["twin_s"],
                         out["health_max_s"], settle_s, held,
                         int(m.get("flare_kv_pages_cached", 0.0)),
                         int(m.get("flare_kv_pages_cached_idle", 0.0)), int(evicted), int(frames),
                         int(cancelled),
                         sum(rss for _, rss in rss_after[-1].values()) / 2**20])  # fmt: skip
            print(table(rows[-1:], [h for _, h in ROUND_COLUMNS]), file=sys.stderr, flush=True)
    finally:
        code = server.stop()
    print(f"[soak] server stopped (exit code {code})", file=sys.stderr, flush=True)

    first, last = (rss_after[0], rss_after[-1]) if rss_after else ({}, {})
    rss_rows = []
    growth_max: float | None = None
    for pid in sorted(set(first) | set(last)):
        name = (first.get(pid) or last.get(pid))[0]
        a, b = first.get(pid, (name, None))[1], last.get(pid, (name, None))[1]
        growth = None if a is None or b is None else (b - a) / a * 100.0
        if growth is None:
            failures.append(f"process {pid} ({name}) is not in both the first and the last round")
        else:
            growth_max = growth if growth_max is None else max(growth_max, growth)
        by_round = [rss.get(pid, (name, None))[1] for rss in rss_after]
        rss_rows.append([pid, name, *[None if v is None else v / 2**20 for v in by_round], growth])

    print("\nPer round (streams; tokens: streamed tokens of completed streams)")
    print(table(rows, [h for _, h in ROUND_COLUMNS]))
    print("\nRSS of every process after each round")
    rounds_mb = [f"round {i} MB" for i in range(1, len(rss_after) + 1)]
    growth_head = f"growth % 1->{len(rss_after)}"
    print(table(rss_rows, ["pid", "process", *rounds_mb, growth_head]))
    if examples:
        print(f"\n{len(examples)} notes (first 10):")
        for line in examples[:10]:
            print(f"  {line}")

    hard_mismatches = totals["mismatched"] - (0 if args.strict_ties else totals["near_tie"])
    if totals["incomplete"]:
        failures.append(f"{totals['incomplete']} streams neither completed nor got an error")
    if totals["errors"] > args.max_errors:
        failures.append(f"{totals['errors']} explicit errors (allowed: {args.max_errors})")
    if totals["twin_errors"]:
        failures.append(f"{totals['twin_errors']} twins did not complete")
    if hard_mismatches:
        failures.append(f"{hard_mismatches} streams differ from their greedy twins")
    if growth_max is not None and growth_max > args.rss_tolerance_pct:
        failures.append(f"RSS grew {growth_max:.2f}% (> {args.rss_tolerance_pct}%)")
    if leaked:
        failures.append(f"{leaked} KV pages still held once idle")
    if code != 0:
        failures.append(f"the server exited with code {code}")
    for line in failures:
        print(f"FAILED: {line}")
    summary = {
        "requests": totals["requests"],
        "completed": totals["completed"],
        "errors": totals["errors"],
        "mismatched_streams": totals["mismatched"],
        "rss_growth_max_pct": None if growth_max is None else round(growth_max, 3),
        "leaked_pages": leaked,
        "incomplete": totals["incomplete"],
        "near_tie_mismatches": totals["near_tie"],
        "twin_errors": totals["twin_errors"],
        "ambiguous_positions": totals["ambiguous_positions"],
        "streamed_tokens": totals["tokens"],
        "rounds": args.rounds,
        "requests_per_round": args.requests,
        "max_tokens_range": [args.min_tokens, args.max_tokens],
        "tensor_parallel_size": args.tensor_parallel_size,
        "max_waiting_requests": args.max_waiting_requests if waiting_flag else None,
        "kv_pages_total": pages_total,
        "health_max_s": round(health_max, 3),
        "health_not_ok": health_not_ok,
        "server_exit_code": code,
        "passed": not failures,
    }
    print(json.dumps(summary), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
