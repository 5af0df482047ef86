"""Speculative programs on the device, for scripts/gpu_check.py (also runs on CPU).

With the embedded target and its draft: greedy rounds (draft and copy proposals,
exact, prefix-limit and wide mixed programs) give the tokens of ordinary greedy
decoding; captured graphs give the tokens of eager execution for greedy and
seeded sampled rounds; and the replay times of the round programs.

    python scripts/gpu_speculative.py [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import default_draft_dir, default_model_dir, load_model
from runtime.ranks.proposals import ProposerConfig
from runtime.ranks.worker import RankWorker
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams

PAGE = 16
PAGES_PER_SLOT = 16
NEW = 24


def make_worker(device: str, proposer: str, capture: bool) -> RankWorker:
    capacity = CapacityConfig(
        max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=64, mixed_prefill=True,
        speculative_widths=(2, 4), device_allocation=True,
    )  # fmt: skip
    draft = load_model(default_draft_dir(), device=device) if proposer == "draft" else None
    return RankWorker(
        load_model(default_model_dir(), device=device), capacity,
        num_pages=4 * PAGES_PER_SLOT, page_size=PAGE, capture=capture,
        max_model_len=PAGES_PER_SLOT * PAGE, draft_model=draft,
        proposer=ProposerConfig(proposer),
    )  # fmt: skip


class Rounds:
    runs: dict[int, int] = {}  # noqa: RUF012 - per worker: generations used

    def __init__(self, w: RankWorker, sampling: SamplingParams) -> None:
        self.w, self.sampling = w, sampling
        self.gen = Rounds.runs[id(w)] = Rounds.runs.get(id(w), 0) + 1  # fresh tenants
        self.fence, self.out, self.pos = self.gen * 1_000_000, {}, {}
        self.times: dict[str, list[int]] = {}

    def send(self, program, lanes, prompt_row=-1):
        self.fence += 1
        done = self.w.execute(Frame.from_lanes(self.fence, program, lanes, prompt_row))
        assert done.error is None, done.error
        self.times.setdefault(program.describe(), []).append(done.device_ns)
        for r in done.lane_results():
            self.out.setdefault(r.slot, []).extend(r.tokens)
            self.pos[r.slot] = self.pos.get(r.slot, 0) + len(r.tokens)
        return done

    def prefill(self, slot, prompt):
        pages = tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))
        lane = FrameLane(slot, self.gen, "prefill", 0, tuple(prompt), 0, pages, 1, self.sampling)
        self.send(GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64), [lane])
        self.pos[slot] = len(prompt) + 1

    def lanes(self, widths):
        return [FrameLane(s, self.gen, "decode", 0, (), self.pos[s] - 1, (), q) for s, q in widths]


def generate(w: RankWorker, prompts, sampling, mode: str) -> tuple[list[list[int]], Rounds]:
    """``mode``: decode (width one), exact, device (prefix-limit) or mixed (the last
    prompt arrives beside the others' rounds)."""
    r = Rounds(w, sampling)
    late = prompts[-1] if mode == "mixed" else None
    for slot, prompt in enumerate(prompts[:-1] if late else prompts):
        r.prefill(slot, prompt)
    if late is not None:
        slot = len(prompts) - 1
        pages = tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))
        chunk = FrameLane(slot, r.gen, "prefill", 0, tuple(late), 0, pages, 1, sampling)
        lanes = r.lanes([(s, 4) for s in range(slot)])
        lanes.insert(1, chunk)
        r.send(GraphDescriptor(GraphKind.MIXED, 4, 4, 3, prompt_capacity=64), lanes, 1)
        r.pos[slot] = len(late) + 1
    slots = list(range(len(prompts)))
    while min(len(r.out[s]) for s in slots) < NEW:
        left = {s: NEW - len(r.out[s]) for s in slots}
        b = 4
        if mode == "decode":
            r.send(GraphDescriptor(GraphKind.DECODE, b), r.lanes([(s, 1) for s in slots]))
            continue
        device = mode == "device"
        program = GraphDescriptor(
            GraphKind.SPECULATIVE, b, 4, 3, 2 * b if device else 0, device_allocated=device
        )
        r.send(program, r.lanes([(s, max(1, min(4, left[s]))) for s in slots]))
    return [r.out[s][:NEW] for s in slots], r


def run(check, results: dict, device: str) -> bool:
    cuda = device == "cuda"
    prompts = [[(11 * i + 5 * j + 1) % 500 for j in range(10 + 9 * i)] for i in range(4)]
    ok = True
    times: dict[str, float] = {}
    for proposer in ("draft", "copy"):
        eager = make_worker(device, proposer, capture=False)
        start = time.perf_counter()
        graphs = make_worker(device, proposer, capture=cuda)
        results[f"spec_{proposer}_capture_s"] = round(time.perf_counter() - start, 3)
        reference, _ = generate(eager, prompts, SamplingParams(), "decode")
        for mode in ("exact", "device", "mixed"):
            got, r = generate(graphs, prompts, SamplingParams(), mode)
            ok &= check(f"spec_{proposer}_{mode}_greedy_equals_decode", got == reference)
            for graph, ns in r.times.items():
                times[graph] = statistics.median(ns) / 1e3
        seeded = SamplingParams(0.8, 0.95, 40, 1234, frequency_penalty=0.2)
        a, _ = generate(eager, prompts, seeded, "exact")
        b, _ = generate(graphs, prompts, seeded, "exact")
        ok &= check(f"spec_{proposer}_seeded_graph_equals_eager", a == b)
    results["spec_replay_us"] = {g: round(us, 1) for g, us in sorted(times.items())}
    print("speculative program replay (median us):")
    for graph, us in sorted(times.items()):
        print(f"  {graph:<40} {us:>10.1f}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = p.parse_args(argv)
    results: dict = {}

    def check(name: str, ok: bool, detail: str = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
        return ok

    return 0 if run(check, results, args.device) else 1


if __name__ == "__main__":
    sys.exit(main())
