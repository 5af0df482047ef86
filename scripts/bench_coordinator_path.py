"""The coordinator's whole path per frame in the real runtime: plan, commit, build, apply.

    cd TREE && python /work/main/scripts/bench_coordinator_path.py   # TREE's runtime

Imports ``runtime`` from the current directory, so one copy of this script
measures any checkout of the same engine (run it from the tree to measure).
One LocalDeployment of the embedded default model with its trained draft
(``--draft-model default``, ``--speculative-selection adaptive``), TP
``--tp`` on ``--device``, the live trace on (``flare run --trace FILE``).  For
each concurrency c: one warm-up round (the scheduler measures its programs),
then ``--rounds`` measured rounds, each c requests at once, every request a
distinct ``--prompt-tokens`` window of the held-out ``pydoc_data.topics`` text
(no prefix-cache hits between rounds), ``--max-tokens`` greedy tokens with
``ignore_eos``.  Output tokens/s: the median over the rounds of all output
tokens over the wall time from the first submission to the last completion.

Per frame of the measured rounds, pooled (the engine thread, ``time.monotonic_ns``;
timers wrap the engine's own methods on the instances, and the trace gives the
rest, joined by fence):

* plan: the ``scheduler.plan()`` call that returned the frame's plan (the
  dispatch loop's calls that returned None are summed apart, per frame:
  ``plan_none``);
* commit_send: from that ``plan()`` returning to ``channel.publish(frame)``
  returning: building the wire frame (``engine._frame``: lane residency, page
  tables, ``build_frame``), ``scheduler.commit``, the Dispatch record and the
  publication; its parts ``build``, ``commit``, ``publish``; the trace's own
  ``sent_ns - plan_ns`` (plan + build + commit, before publication) is
  ``trace_plan_to_sent``;
* apply: from the last rank's completion arriving (the trace's ``arrived_ns``,
  stamped once the message is received and decoded) to ``engine._apply``
  returning: execution timing, token checks, the scheduler's ``complete*``
  (``sched_complete``, its part), rank metrics, the trace hook, streaming the
  tokens, the engine's stats;
* path: plan + commit_send + apply of the same frame;
* device: the trace's ``device_ns`` (the largest rank interval), for scale;
* plan_cpu, commit_cpu, sched_complete_cpu: the engine thread's own CPU time
  (``time.thread_time_ns``) in ``plan()``, ``commit()`` and the scheduler's
  ``complete*``.  On a machine whose cores the CPU ranks also use, the wall
  times above include waiting for a core (and the GIL); these do not.

Prints a table, then as the LAST line one JSON object with every figure
(``c{N}_plan_us_median``, ``c{N}_commit_send_us_p90``, ``c{N}_apply_us_median``,
``c{N}_path_us_median``, ``c{N}_device_us_median``, ``c{N}_tokens_per_s`` ...).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())  # the tree to measure: the current directory's runtime

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from runtime.ranks.model import default_draft_dir, default_model_dir
from runtime.speculation import SpeculationConfig
from runtime.trace.writer import TraceOptions

HELD_OUT = ("typesseq", "typesseq-mutable", "unary", "while", "with", "yield")
now_ns = time.monotonic_ns  # the engine's and the trace's clock
cpu_ns = time.thread_time_ns  # the engine thread's own CPU time


def prompt_windows(tokens: int) -> list[list[int]]:
    """Consecutive ``tokens``-long windows of the held-out topics' text, all distinct."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    ids: list[int] = []
    for key in HELD_OUT:
        ids += tok.encode(topics.get(key, "")).ids
    return [ids[i : i + tokens] for i in range(0, len(ids) - tokens + 1, tokens)]


class Recorder:
    """Timers around the engine thread's per-frame calls, keyed by fence."""

    def __init__(self, engine) -> None:
        self.frames: dict[int, dict] = {}
        self.plan_none_ns = 0
        self._pending: tuple[int, int, int] | None = None
        sched, channel = engine.scheduler, engine._channel
        plan, commit, publish = sched.plan, sched.commit, channel.publish
        frame, apply, complete = engine._frame, engine._apply, engine._complete

        def timed_plan():
            t0, c0 = now_ns(), cpu_ns()
            result = plan()
            t1 = now_ns()
            if result is None:
                self.plan_none_ns += t1 - t0
            else:
                self._pending = (t0, t1, cpu_ns() - c0)
            return result

        def timed_frame(p, fence):
            t0 = now_ns()
            result = frame(p, fence)
            start, end, cpu = self._pending or (t0, t0, 0)
            self.frames[fence] = {
                "plan_start": start, "plan_end": end, "plan_cpu": cpu, "build": now_ns() - t0,
            }  # fmt: skip
            return result

        def timed_commit(p, fence):
            t0, c0 = now_ns(), cpu_ns()
            commit(p, fence)
            if fence in self.frames:
                self.frames[fence]["commit"] = now_ns() - t0
                self.frames[fence]["commit_cpu"] = cpu_ns() - c0

        def timed_publish(message):
            t0 = now_ns()
            result = publish(message)
            t1 = now_ns()
            entry = self.frames.get(getattr(message, "fence", None))
            if entry is not None and "publish_end" not in entry:
                entry["publish"], entry["publish_end"] = t1 - t0, t1
            return result

        def timed_apply(dispatch):
            t0 = now_ns()
            apply(dispatch)
            entry = self.frames.get(dispatch.fence)
            if entry is not None:
                entry["apply_start"], entry["apply_end"] = t0, now_ns()

        def timed_complete(dispatch, records, timing):
            t0, c0 = now_ns(), cpu_ns()
            result = complete(dispatch, records, timing)
            entry = self.frames.get(dispatch.fence)
            if entry is not None:
                entry["sched_complete"] = now_ns() - t0
                entry["sched_complete_cpu"] = cpu_ns() - c0
            return result

        sched.plan, sched.commit, channel.publish = timed_plan, timed_commit, timed_publish
        engine._frame, engine._apply, engine._complete = timed_frame, timed_apply, timed_complete

    def reset(self) -> None:
        self.frames.clear()
        self.plan_none_ns = 0


NAMES = ("plan", "commit_send", "apply", "path", "device", "build", "commit", "publish",
         "sched_complete", "trace_plan_to_sent", "plan_cpu", "commit_cpu",
         "sched_complete_cpu")  # fmt: skip


def trace_frames(path: Path) -> dict[int, dict]:
    """The trace file's frame lines (and rotated ones), by fence."""
    out: dict[int, dict] = {}
    for p in sorted(path.parent.glob(path.name + "*"), reverse=True):
        for text in p.read_text().splitlines():
            line = json.loads(text)
            if line.get("event") == "frame":
                out[line["fence"]] = line
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def one_round(engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    start = time.perf_counter()
    streams = [engine.submit(p, max_tokens, ignore_eos=True) for p in prompts]
    tokens = sum(len(s.result(timeout=3600).token_ids) for s in streams)
    return tokens, time.perf_counter() - start


def measure(engine, rec: Recorder, trace_path: Path, prompts, c: int, args) -> dict:
    one_round(engine, prompts[:c], args.max_tokens)  # warm-up: the programs measured
    rec.reset()
    rates, tokens, wall = [], 0, 0.0
    for k in range(1, args.rounds + 1):  # every round its own prompts
        n, seconds = one_round(engine, prompts[k * c : (k + 1) * c], args.max_tokens)
        rates.append(n / seconds)
        tokens, wall = tokens + n, wall + seconds
    assert engine.trace is not None and engine.trace.writer.flush(30.0)
    lines = trace_frames(trace_path)
    rows = []
    for fence, t in sorted(rec.frames.items()):
        line = lines.get(fence)
        if line is None or "apply_end" not in t or "publish_end" not in t:
            continue
        arrived = max((r.get("arrived_ns") or 0) for r in line.get("ranks", [])) or t["apply_start"]
        row = {
            "plan": t["plan_end"] - t["plan_start"],
            "commit_send": t["publish_end"] - t["plan_end"],
            "build": t["build"],
            "commit": t.get("commit", 0),
            "publish": t["publish"],
            "apply": t["apply_end"] - arrived,
            "sched_complete": t.get("sched_complete", 0),
            "plan_cpu": t["plan_cpu"],
            "commit_cpu": t.get("commit_cpu", 0),
            "sched_complete_cpu": t.get("sched_complete_cpu", 0),
            "trace_plan_to_sent": line["sent_ns"] - line["plan_ns"],
            "device": line.get("device_ns", 0),
        }
        row["path"] = row["plan"] + row["commit_send"] + row["apply"]
        row["kind"] = line.get("kind", "")
        row["queued"] = bool(line.get("queued"))
        rows.append(row)
    out: dict = {"frames": len(rows), "tokens": tokens, "wall_s": wall}
    out["tokens_per_s"] = statistics.median(rates)
    out["tokens_per_s_runs"] = [round(x, 1) for x in rates]
    for name in NAMES:
        values = [r[name] / 1e3 for r in rows]
        out[f"{name}_us_median"] = statistics.median(values) if values else 0.0
        out[f"{name}_us_p90"] = quantile(values, 0.9) if values else 0.0
    out["plan_none_us_per_frame"] = rec.plan_none_ns / 1e3 / max(1, len(rows))
    out["path_share_of_wall"] = sum(r["path"] for r in rows) / 1e9 / wall
    out["speculative_frames"] = sum(1 for r in rows if r["kind"] == "speculative")
    out["queued_frames"] = sum(1 for r in rows if r["queued"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per concurrency")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    args = p.parse_args(argv)
    prompts = prompt_windows(args.prompt_tokens)
    need = (args.rounds + 1) * sum(args.concurrency)
    if len(prompts) < need:
        raise SystemExit(f"{len(prompts)} distinct prompts, {need} needed: lower the sizes")
    spec = SpeculationConfig("draft", str(default_draft_dir()),
                             num_speculative_tokens=args.num_speculative_tokens,
                             selection="adaptive")  # fmt: skip
    cfg = DeploymentConfig(tensor_parallel_size=args.tp, max_concurrency=max(args.concurrency),
                           device=args.device, speculation=spec, startup_timeout_s=600)  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    tree = f"{os.getcwd()} @ {head.stdout.strip() or '?'}"
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="flare-bench-path-") as tmp:
        trace_path = Path(tmp) / "trace.jsonl"
        d = LocalDeployment(cfg)
        d.engine.enable_trace(TraceOptions(str(trace_path), max_bytes=1 << 30))
        with d:
            rec = Recorder(d.engine)
            offset = 0
            for c in args.concurrency:
                results[c] = measure(d.engine, rec, trace_path, prompts[offset:], c, args)
                offset += (args.rounds + 1) * c
                r = results[c]
                note = f"  c={c}: {r['frames']} frames, {r['tokens_per_s']:.1f} tok/s"
                print(note, file=sys.stderr, flush=True)

    print(f"coordinator path per frame, {tree} (us; median / p90)")
    names = NAMES
    print(f"{'':>20} " + " ".join(f"{'c=' + str(c):>17}" for c in args.concurrency))
    for name in names:
        cells = [
            f"{r[f'{name}_us_median']:8.0f} /{r[f'{name}_us_p90']:7.0f}" for r in results.values()
        ]
        print(f"{name:>20} " + " ".join(f"{cell:>17}" for cell in cells))
    for label, key, fmt in (("plan (None) /frame", "plan_none_us_per_frame", "{:17.0f}"),
                            ("path share of wall", "path_share_of_wall", "{:17.3f}"),
                            ("frames", "frames", "{:17d}"),
                            ("speculative frames", "speculative_frames", "{:17d}"),
                            ("queued frames", "queued_frames", "{:17d}"),
                            ("output tokens/s", "tokens_per_s", "{:17.1f}")):  # fmt: skip
        print(f"{label:>20} " + " ".join(fmt.format(r[key]) for r in results.values()))
    flat: dict = {"tree": tree, "tp": args.tp, "device": args.device,
                  "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}  # fmt: skip
    for c, r in results.items():
        for key, value in r.items():
            flat[f"c{c}_{key}"] = round(value, 3) if isinstance(value, float) else value
    print(json.dumps(flat, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
