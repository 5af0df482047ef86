"""Packed prefill programs on the device, for scripts/gpu_check.py (also runs on CPU).

With the embedded model (float32) and the capacity's packed prefill programs
(``packed_prefill``): eight prompts of 9 to 226 tokens prefilled as packed
frames (up to B rows sharing C tokens; rows that finish their prompt, rows
that take a chunk, rows over their cached prefix), then decoded.  Captured
graphs give the tokens of eager execution (greedy, seeded, penalties), packed
frames give the greedy tokens and the penalty state of the same rows run as
single prefill frames, the packed log probabilities match eager within 1e-5;
and the packed programs' replay times.

    python scripts/gpu_packed.py [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import default_model_dir, load_model
from runtime.ranks.worker import RankWorker
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams

PAGE = 16
PAGES_PER_SLOT = 32
NEW = 8
ROWS = 4  # rows a packed frame takes at most (the catalog's largest packed B)
# Prompt lengths: four rows (the last a 170-token chunk) fill C = 256; that
# prompt's rest over its cache beside a whole one (B = 2); three more rows, a
# chunk again; the rest alone.
LENGTHS = (20, 9, 57, 200, 226, 30, 131, 205)


def make_worker(device: str, capture: bool) -> RankWorker:
    """The capacity's catalog with its packed prefill programs: B = 2 at C = 128
    and 256, B = 4 at C = 256 (``capacity.packed_prefill_shapes``)."""
    capacity = CapacityConfig(
        max_concurrency=8, min_prefill_tokens=64, max_prefill_tokens=256, packed_prefill=True
    )
    return RankWorker(
        load_model(default_model_dir(), dtype=torch.float32, device=device), capacity,
        num_pages=8 * PAGES_PER_SLOT, page_size=PAGE, capture=capture,
        max_model_len=PAGES_PER_SLOT * PAGE,
    )  # fmt: skip


def schedule(prompts: list[list[int]]) -> list[list[tuple[int, int, int]]]:
    """Packed frames of rows (slot, start, end): each frame takes rows in slot
    order while it has fewer than ROWS rows and fewer than 256 tokens, the last
    row taking what is left (a chunk); the rest of that prompt goes first next."""
    left = [(slot, 0) for slot in range(len(prompts))]
    frames = []
    while left:
        rows, used = [], 0
        while left and len(rows) < ROWS and used < 256:
            slot, start = left.pop(0)
            end = min(len(prompts[slot]), start + 256 - used)
            rows.append((slot, start, end))
            used += end - start
            if end < len(prompts[slot]):
                left.insert(0, (slot, end))
        frames.append(rows)
    return frames


def program_for(w: RankWorker, rows: list[tuple[int, int, int]]) -> GraphDescriptor:
    """The smallest prefill program of the catalog that holds ``rows``."""
    tokens = sum(end - start for _, start, end in rows)
    fits = [
        d for d in w.catalog
        if d.kind is GraphKind.PREFILL and d.batch_capacity >= len(rows)
        and d.prompt_capacity >= tokens
    ]  # fmt: skip
    return min(fits, key=lambda d: (d.batch_capacity, d.prompt_capacity))


class Driver:
    runs: dict[int, int] = {}  # noqa: RUF012 - per worker: generations used

    def __init__(self, w: RankWorker, prompts, samplings) -> None:
        self.w, self.prompts, self.samplings = w, prompts, samplings
        self.gen = Driver.runs[id(w)] = Driver.runs.get(id(w), 0) + 1  # fresh tenants
        self.fence = self.gen * 1_000_000
        self.out: dict[int, list[int]] = {}
        self.times: dict[str, list[int]] = {}
        self.logprobs: list[float] = []

    def send(self, program: GraphDescriptor, lanes: list[FrameLane]) -> None:
        self.fence += 1
        done = self.w.execute(Frame.from_lanes(self.fence, program, lanes))
        assert done.error is None, done.error
        self.times.setdefault(program.describe(), []).append(done.device_ns)
        for r in done.lane_results():
            self.out.setdefault(r.slot, []).extend(r.tokens)
        if "logprobs" in done.sidecars:
            self.logprobs += done.sidecars["logprobs"].values()

    def row(self, slot: int, start: int, end: int) -> FrameLane:
        prompt = self.prompts[slot]
        pages = tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))
        return FrameLane(slot, self.gen, "prefill", start, tuple(prompt[start:end]), start,
                         pages if start == 0 else (), int(end == len(prompt)),
                         self.samplings[slot])  # fmt: skip

    def generate(self, use_packed: bool) -> list[list[int]]:
        for rows in schedule(self.prompts):
            if use_packed:
                self.send(program_for(self.w, rows), [self.row(*r) for r in rows])
            else:
                for r in rows:
                    self.send(program_for(self.w, [r]), [self.row(*r)])
        slots = range(len(self.prompts))
        for i in range(NEW - 1):
            lanes = [FrameLane(s, self.gen, "decode", 0, (), len(self.prompts[s]) + i, (), 1)
                     for s in slots]  # fmt: skip
            self.send(GraphDescriptor(GraphKind.DECODE, 8), lanes)
        return [self.out[s] for s in slots]


def penalty_rows(w: RankWorker, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    state = w.outputs.penalties
    return state.counts[:slots].cpu(), state.prompt_mask[:slots].cpu()


def run(check, results: dict, device: str) -> bool:
    cuda = device == "cuda"
    eager = make_worker(device, capture=False)
    graphs = make_worker(device, capture=True) if cuda else eager  # CPU: one eager worker
    captured = sum(p.captured for p in graphs.programs.values())
    every = captured == len(graphs.programs) or not cuda
    packed = [
        d.describe() for d in graphs.catalog if d.kind is GraphKind.PREFILL and d.batch_capacity > 1
    ]
    detail = f"{captured}/{len(graphs.programs)} programs; packed: {', '.join(packed)}"
    ok = check("packed_capture", every and len(packed) == 3, detail)
    prompts = [[(11 * i + 5 * j + 7) % 500 for j in range(n)] for i, n in enumerate(LENGTHS)]
    results["packed_frames"] = [len(rows) for rows in schedule(prompts)]
    settings = {
        "greedy": [SamplingParams()] * 8,
        "seeded": [SamplingParams(0.8, 0.9, 40, 2000 + i) for i in range(8)],
        "penalties": [SamplingParams(repetition_penalty=1.5, presence_penalty=0.5 * (i % 3),
                                     frequency_penalty=0.3, seed=i) for i in range(8)],
        "logprobs": [SamplingParams(logprobs=5)] * 8,
    }  # fmt: skip
    times: dict[str, list[int]] = {}
    for name, samplings in settings.items():
        got = Driver(graphs, prompts, samplings)
        tokens = got.generate(True)
        want, ref = got, tokens  # CPU (a dry run): graphs are eager
        if cuda:
            want = Driver(eager, prompts, samplings)
            ref = want.generate(True)
        for graph, ns in got.times.items():
            times.setdefault(graph, []).extend(ns)
        if name == "logprobs":
            diff = max(abs(a - b) for a, b in zip(want.logprobs, got.logprobs))
            ok &= check("packed_logprobs_graph_equals_eager",
                        len(want.logprobs) == len(got.logprobs) and diff < 1e-5,
                        f"max diff {diff}")  # fmt: skip
            continue
        ok &= check(f"packed_graph_equals_eager_{name}", tokens == ref)
        if name in ("greedy", "penalties"):
            rows = penalty_rows(graphs, 8)
            separate = Driver(graphs, prompts, samplings).generate(False)
            same = all(torch.equal(a, b) for a, b in zip(rows, penalty_rows(graphs, 8)))
            ok &= check(f"packed_equals_separate_{name}", separate == tokens and same)
    table = {g: round(statistics.median(ns) / 1e3, 1) for g, ns in sorted(times.items())}
    results["packed_replay_us"] = table
    print("packed prefill replay (median us):")
    for graph, us in table.items():
        print(f"  {graph:<30} {us:>10.1f}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    results: dict = {}

    def check(name: str, good: bool, detail: str = "") -> bool:
        results[f"{name}_ok"] = good
        print(f"{'PASS' if good else 'FAIL'} {name} {detail}", flush=True)
        return good

    ok = run(check, results, args.device)
    print(results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
