"""Scored prefill programs on the device, for scripts/gpu_check.py (also runs on CPU).

With the embedded model (float32) and the capacity's scored prefill programs
(``scored_prefill`` with ``packed_prefill``): the eight prompts of
``gpu_packed`` scored as packed SCORED_PREFILL frames (rows that finish their
prompt, chunks scored across their boundary through ``score_next``, rows over
their cached prefix).  Captured graphs give the prompt log probabilities and
top-k ids of eager execution (within 1e-4) and its first tokens; packed scored
frames give what the same rows give as single scored frames; the first tokens
are the plain prefill's; and the replay times of scored programs beside the
prefill programs of the same shapes (the cost of scoring).

    python scripts/gpu_scored.py [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_packed
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import default_model_dir, load_model
from runtime.ranks.worker import RankWorker
from runtime.transport.frame import Frame
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import tensor_to_torch

PAGE, PAGES_PER_SLOT = gpu_packed.PAGE, gpu_packed.PAGES_PER_SLOT
K = 5


def make_worker(device: str, capture: bool) -> RankWorker:
    capacity = CapacityConfig(
        max_concurrency=8, min_prefill_tokens=64, max_prefill_tokens=256,
        packed_prefill=True, scored_prefill=True,
    )  # fmt: skip
    return RankWorker(
        load_model(default_model_dir(), dtype=torch.float32, device=device), capacity,
        num_pages=8 * PAGES_PER_SLOT, page_size=PAGE, capture=capture,
        max_model_len=PAGES_PER_SLOT * PAGE,
    )  # fmt: skip


def program_for(w: RankWorker, rows, kind: GraphKind) -> GraphDescriptor:
    tokens = sum(end - start for _, start, end in rows)
    fits = [d for d in w.catalog if d.kind is kind and d.batch_capacity >= len(rows)
            and d.prompt_capacity >= tokens]  # fmt: skip
    return min(fits, key=lambda d: (d.batch_capacity, d.prompt_capacity))


class Scorer(gpu_packed.Driver):
    """gpu_packed's driver over scored (or plain) prefill frames: per slot, each
    position's [logprob, top-K values] and top-K ids, and the first tokens."""

    def __init__(self, w: RankWorker, prompts, kind: GraphKind) -> None:
        super().__init__(w, prompts, [SamplingParams()] * len(prompts))
        self.kind = kind
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.ids: dict[int, list[torch.Tensor]] = {}

    def run_rows(self, rows) -> None:
        self.fence += 1
        program = program_for(self.w, rows, self.kind)
        extra = {}
        if self.kind is GraphKind.SCORED_PREFILL:
            following = [self.prompts[s][e] if e < len(self.prompts[s]) else -1 for s, _, e in rows]
            extra = {"score_next": following, "score_k": K}
        frame = Frame.from_lanes(self.fence, program, [self.row(*r) for r in rows], **extra)
        done = self.w.execute(frame)
        assert done.error is None, done.error
        self.times.setdefault(program.describe(), []).append(done.device_ns)
        for r in done.lane_results():
            self.out.setdefault(r.slot, []).extend(r.tokens)
        if self.kind is GraphKind.SCORED_PREFILL:
            values = tensor_to_torch(done.sidecars["prompt_logprobs"])
            ids = tensor_to_torch(done.sidecars["prompt_logprob_token_ids"])
            at = 0
            for slot, start, end in rows:
                self.rows.setdefault(slot, []).append(values[at : at + end - start])
                self.ids.setdefault(slot, []).append(ids[at : at + end - start])
                at += end - start

    def score(self, use_packed: bool) -> None:
        for rows in gpu_packed.schedule(self.prompts):
            for group in [rows] if use_packed else [[r] for r in rows]:
                self.run_rows(group)

    def table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's rows (the prompt's last position left out: no next token)."""
        slots = range(len(self.prompts))
        values = torch.cat([torch.cat(self.rows[s])[:-1] for s in slots])
        ids = torch.cat([torch.cat(self.ids[s])[:-1] for s in slots])
        return values, ids


def run(check, results: dict, device: str) -> bool:
    cuda = device == "cuda"
    eager = make_worker(device, capture=False)
    graphs = make_worker(device, capture=True) if cuda else eager  # CPU: one eager worker
    scored = [p for p in graphs.programs.values() if p.desc.kind is GraphKind.SCORED_PREFILL]
    captured = sum(p.captured for p in scored)
    detail = f"{captured}/{len(scored)} scored programs captured"
    ok = check("scored_capture", bool(scored) and (captured == len(scored) or not cuda), detail)
    prompts = [
        [(11 * i + 5 * j + 7) % 500 for j in range(n)] for i, n in enumerate(gpu_packed.LENGTHS)
    ]
    got = Scorer(graphs, prompts, GraphKind.SCORED_PREFILL)
    got.score(True)
    values, ids = got.table()
    finite = bool(torch.isfinite(values).all()) and bool((values <= 1e-6).all())
    ok &= check("scored_values_are_log_probabilities", finite, f"{values.shape[0]} positions")
    if cuda:
        want = Scorer(eager, prompts, GraphKind.SCORED_PREFILL)
        want.score(True)
        ref_values, ref_ids = want.table()
        diff = float((values - ref_values).abs().max())
        same_ids = float((ids == ref_ids).float().mean())
        good = diff < 1e-4 and same_ids > 0.999 and got.out == want.out
        detail = f"max diff {diff}, ids agree {same_ids:.4f}"
        ok &= check("scored_graph_equals_eager", good, detail)
    single = Scorer(graphs, prompts, GraphKind.SCORED_PREFILL)
    single.score(False)
    s_values, _ = single.table()
    diff = float((values - s_values).abs().max())
    ok &= check("scored_packed_equals_single", diff < 1e-4 and got.out == single.out,
                f"max diff {diff}")  # fmt: skip
    plain = Scorer(graphs, prompts, GraphKind.PREFILL)
    plain.score(True)
    ok &= check("scored_first_tokens_equal_prefill", plain.out == got.out)
    times: dict[str, list[int]] = {}
    for driver in (got, single, plain):
        for graph, ns in driver.times.items():
            times.setdefault(graph, []).extend(ns)
    table = {g: round(statistics.median(ns) / 1e3, 1) for g, ns in sorted(times.items())}
    results["scored_replay_us"] = table
    results["scored_positions"] = int(values.shape[0])
    print("scored and plain prefill replay (median us):")
    for graph, us in table.items():
        print(f"  {graph:<34} {us:>10.1f}")
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
