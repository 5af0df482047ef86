"""Benchmark: a rank's host work per frame, by stage, against the maximum context.

Usage: ``python scripts/bench_rank_host.py [--lanes 8,64] [--contexts 4096,32768,131072]
[--frames 200] [--device auto]``

For each maximum context it writes a random checkpoint of the embedded default
model's shape with that many positions, builds a :class:`RankWorker`, fills
every lane with a short prompt, then times decode frames of each lane count.
The contexts stay short (prompt 64 tokens + the frames decoded), so a host
cost that grows with the maximum context shows as a ratio above 1.

Stages (the names the debugging tools report), median microseconds per frame:

* ``receive``: the frame's bytes decoded and validated (msgpack + schema);
  the socket itself is not included;
* ``validate``: the lanes checked against the slot table;
* ``pack``: the lane columns into the host arena;
* ``launch``: device rows, the input copy and the replay (on CPU, without the
  forward itself, which is ``wait``);
* ``wait``: until the device finishes (on CPU: the eager forward);
* ``publish``: the completion built and encoded.

``host`` is receive + validate + pack + launch + publish.  On CPU the eager
forward runs in the same thread between frames and evicts the caches the host
stages use, which a GPU rank's forward does not; so the script also reports
``host_only``: the same frames with the programs' device work skipped (a
diagnostic of the host path alone, labelled as such, never a substitute for
the figures above).  It also reports the spread of device time across the
sampling variants of one shape (they share one cost entry).  The last line is
one JSON object with every figure; the flat keys ``host_us_l64_ctx4k`` etc.
are the 64-lane host medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from runtime.catalog import GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import load_model
from runtime.ranks.model.default import DEFAULT_CONFIG, write_random_checkpoint
from runtime.ranks.worker import RankWorker
from runtime.transport.codec import decode, encode
from runtime.transport.frame import Frame
from runtime.transport.sampling import SamplingParams

_GENERATIONS = itertools.count(1)  # distinct across drivers sharing a worker
_FENCES = itertools.count(1)
HOST_STAGES = ("receive", "validate", "pack", "launch", "publish")
PROMPT = 64
PAGE = 16


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _label(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


class Driver:
    """Builds frames the way the coordinator does, for one worker."""

    def __init__(self, worker: RankWorker, lanes: int, frames: int) -> None:
        self.w = worker
        self.lanes = lanes
        self.fence = 0
        self.generation = 0
        self.pages_per_lane = -(-(PROMPT + frames + 8) // PAGE)
        self.positions: list[int] = []
        self.decode = next(
            d for d in worker.catalog if d.kind is GraphKind.DECODE and d.batch_capacity >= lanes
        )
        self.prefill = next(
            d for d in worker.catalog if d.kind is GraphKind.PREFILL and d.prompt_capacity >= PROMPT
        )

    def _run(self, frame: Frame) -> dict[str, int]:
        data = encode(frame)
        t0 = time.perf_counter_ns()
        received = decode(data)
        t1 = time.perf_counter_ns()
        launch = self.w.start(received, t1 - t0)
        completion = self.w.finish(launch)
        t2 = time.perf_counter_ns()
        encode(completion)
        launch.stages["publish"] += time.perf_counter_ns() - t2
        return launch.stages

    def fill(self, sampling: SamplingParams) -> None:
        self.generation = next(_GENERATIONS)
        self.positions = []
        for s in range(self.lanes):
            self.fence = next(_FENCES)
            pages = range(s * self.pages_per_lane, (s + 1) * self.pages_per_lane)
            prompt = [(7 * s + 3 * j + 1) % (self.w.vocab - 2) for j in range(PROMPT)]
            self._run(
                Frame(
                    self.fence,
                    self.prefill,
                    slot=[s],
                    generation=[self.generation],
                    phase=[1],
                    position=[0],
                    query_len=[PROMPT],
                    commits=[1],
                    prompt_start=[0],
                    prompt_tokens=prompt,
                    page_count=[len(pages)],
                    pages=list(pages),
                    sampling=((0, sampling),),
                )
            )
            self.positions.append(PROMPT)

    def step(self) -> dict[str, int]:
        self.fence = next(_FENCES)
        n = self.lanes
        frame = Frame(
            self.fence,
            self.decode,
            slot=list(range(n)),
            generation=[self.generation] * n,
            phase=[0] * n,
            position=list(self.positions),
            query_len=[1] * n,
            commits=[1] * n,
            prompt_start=[0] * n,
            page_count=[0] * n,
            expected_ns=1_000_000,
        )
        stages = self._run(frame)
        self.positions = [p + 1 for p in self.positions]
        return stages


def _skip(variant: str, width: int, *extent: int) -> None:
    """A program body that does no device work (the host-only diagnostic)."""


def measure(worker: RankWorker, lanes: int, frames: int, warmup: int) -> dict[str, float]:
    driver = Driver(worker, lanes, frames + warmup)
    driver.fill(SamplingParams())
    for _ in range(warmup):
        driver.step()
    samples = [driver.step() for _ in range(frames)]
    out = {s: statistics.median(x[s] for x in samples) / 1e3 for s in (*HOST_STAGES, "wait")}
    out["host"] = statistics.median(sum(x[s] for s in HOST_STAGES) for x in samples) / 1e3
    out["frame"] = statistics.median(sum(x.values()) for x in samples) / 1e3
    return out


def variant_spread(worker: RankWorker, lanes: int, frames: int) -> dict[str, float]:
    """Median device time per sampling variant of one decode shape."""
    settings = {
        "argmax": SamplingParams(),
        "sample": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        "logprobs": SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=5),
    }
    out = {}
    for variant, params in settings.items():
        driver = Driver(worker, lanes, frames + 3)
        driver.fill(params)
        for _ in range(3):
            driver.step()
        times = []
        for _ in range(frames):
            stages = driver.step()
            times.append(stages["wait"])
        out[variant] = statistics.median(times) / 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lanes", type=_ints, default=(8, 64))
    p.add_argument("--contexts", type=_ints, default=(4096, 32768, 131072))
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    if not use_cuda:  # as a CPU rank does: leave a core to the rest (runtime/ranks/__main__.py)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) - 1))
    results: dict[str, float] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ctx in args.contexts:
            config = dataclasses.replace(DEFAULT_CONFIG, max_position_embeddings=ctx)
            path = write_random_checkpoint(Path(tmp) / f"ctx{ctx}", config, seed=0)
            model = load_model(path, device=device)
            capacity = CapacityConfig(
                max_concurrency=max(args.lanes), min_prefill_tokens=64, max_prefill_tokens=128
            )
            pages = max(args.lanes) * -(-(PROMPT + args.frames + args.warmup + 8) // PAGE)
            worker = RankWorker(model, capacity, num_pages=pages, page_size=PAGE, capture=use_cuda)
            for lanes in args.lanes:
                if ctx == args.contexts[0] and lanes == args.lanes[0]:
                    measure(worker, lanes, args.frames, args.warmup)  # the process's first run
                m = measure(worker, lanes, args.frames, args.warmup)
                rows.append((lanes, ctx, m))
                for key, value in m.items():
                    results[f"l{lanes}_ctx{_label(ctx)}_{key}_us"] = round(value, 2)
                results[f"host_us_l{lanes}_ctx{_label(ctx)}"] = round(m["host"], 2)
            if not use_cuda:  # the host path alone: the forward skipped (see the docstring)
                bodies = {key: program._body for key, program in worker.programs.items()}
                for program in worker.programs.values():
                    program._body = _skip
                m = measure(worker, max(args.lanes), args.frames, args.warmup)
                results[f"host_only_us_l{max(args.lanes)}_ctx{_label(ctx)}"] = round(m["host"], 2)
                for key, program in worker.programs.items():
                    program._body = bodies[key]
            if ctx == args.contexts[0]:
                spread = variant_spread(worker, max(args.lanes), max(20, args.frames // 4))
                low = min(spread.values())
                for variant, value in spread.items():
                    results[f"variant_{variant}_device_us"] = round(value, 2)
                results["variant_cost_spread"] = round((max(spread.values()) - low) / low, 4)
            del worker, model
    print(f"rank host time per decode frame ({device.type}), median us")
    head = f"{'lanes':>5} {'max ctx':>8} " + " ".join(f"{s:>9}" for s in HOST_STAGES)
    print(head + f" {'host':>9} {'wait':>9} {'frame':>9}")
    for lanes, ctx, m in rows:
        cells = " ".join(f"{m[s]:9.1f}" for s in HOST_STAGES)
        print(f"{lanes:5d} {_label(ctx):>8} {cells} {m['host']:9.1f} {m['wait']:9.1f} "
              f"{m['frame']:9.1f}")  # fmt: skip
    first, last = _label(args.contexts[0]), _label(args.contexts[-1])
    for lanes in args.lanes:
        ratio = results[f"host_us_l{lanes}_ctx{last}"] / results[f"host_us_l{lanes}_ctx{first}"]
        frame_ratio = (
            results[f"l{lanes}_ctx{last}_frame_us"] / results[f"l{lanes}_ctx{first}_frame_us"]
        )
        results[f"host_ratio_l{lanes}_{last}_over_{first}"] = round(ratio, 3)
        results[f"frame_ratio_l{lanes}_{last}_over_{first}"] = round(frame_ratio, 3)
        print(f"{lanes} lanes: host {last}/{first} = {ratio:.3f}, frame {frame_ratio:.3f}")
    host_only = {k: v for k, v in results.items() if k.startswith("host_only")}
    if host_only:
        print("host path alone (forward skipped, diagnostic): " + ", ".join(
            f"{k.split('_us_')[1]} {v:.1f} us" for k, v in host_only.items()
        ))  # fmt: skip
    print("sampling variants (device us): " + ", ".join(
        f"{v} {results[f'variant_{v}_device_us']:.1f}" for v in ("argmax", "sample", "logprobs")
    ) + f"; spread {results['variant_cost_spread']:.1%}")  # fmt: skip
    results["device"] = device.type
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
