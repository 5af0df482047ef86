"""The CUDA path in one short run, for a session that has a GPU lent to it.

Usage: ``python scripts/gpu_check.py [--device cuda] [--out DIR]``

Checks, each printed as PASS/FAIL with its figures, on the embedded model:

1. capture: every program of the catalog captured as a CUDA graph (one pool,
   largest first) and the capture time;
2. graph == eager: greedy and seeded tokens from graph replay equal an eager
   run of the same programs on the same device (float32), for chunked
   prefills and decode batches;
3. batch invariance on the GPU: 8 requests batched give each request's tokens
   when run alone;
4. logprobs inside the graph equal the eager ones within 1e-5;
5. mixed prefill/decode programs (captured with the rest): later prompts
   arrive as the prompt row of mixed frames beside the running decoders; graph
   replay gives the eager tokens (greedy and seeded), the greedy tokens equal
   the same work run as separate prefill and decode frames, and a mixed
   frame's logprobs match eager within 1e-5;
6. logit bias and penalties inside the graphs: eight requests with different
   settings (repetition, frequency/presence, bias, none; greedy and seeded)
   give the eager tokens, in plain and in mixed frames, batched equal alone;
   lanes without adjustments keep their plain tokens; a -100 bias on the
   greedy token changes it; and the per-slot state the graphs updated equals
   the committed tokens' counts and the prompt's token set;
7. NCCL: a one-rank ``nccl`` process group all-reduces (two ranks when the
   machine has two GPUs: ``--tp2``);
8. realistic shapes (``scripts/gpu_realistic.py``): a random-weight Llama with
   vocab 32,000, hidden 2,048, 16 heads of 128, 4 KV heads, 8 layers and
   32,768 positions: the Triton kernels against their references, graph ==
   eager, event intervals against wall time, decode replay at 32k against 1k
   maximum context, no memory growth over 1,000 replays (with the rank's host
   stages), the sampling variants' cost spread, bf16 against fp32
   teacher-forced; then the speculative kernels and the verify attention
   kernel (W = 2..16 queries per lane) against their references, with the
   verify and prefill kernels' event times on the same verification steps;
9. a timing table: CUDA-event replay time per program (mixed ones included);
10. the deployment end to end: ``LocalDeployment`` on CUDA with graphs (mixed
   programs too), its KV cache sized by ``--gpu-memory-utilization`` (the
   default 0.9; the pages it got are recorded), serves 16 concurrent requests
   consistently (the frames run per kind are recorded), and
   ``Engine.measure_round_trip`` gives the empty-frame round trip.  TP=2
   (``--tp2``) needs two GPUs; with one, the output says so.

11. KV memory (``check_kv_memory``): 6 requests, half sharing a cached
   prefix, in a pool too small for them at once give the tokens of a large
   pool (float32, greedy), with preemptions, restore and snapshot rows (the
   page copies and restored rows run before graph replay), every page back.
12. packed prefill programs (``scripts/gpu_packed.py``): up to B prompt rows
   sharing C tokens, captured per (B, C): graph replay gives the eager tokens
   (greedy, seeded, penalties) and log probabilities, the greedy tokens and
   penalty state of the same rows run as single prefills, and their replay
   times.
13. scored prefill programs (``scripts/gpu_scored.py``): the same prompts
   scored in packed SCORED_PREFILL frames: graph replay gives eager's prompt
   log probabilities (1e-4) and top-k ids, packed frames give single frames'
   scores, first tokens equal plain prefill's, and the scored programs'
   replay times beside the prefill programs of the same shapes.
14. vision programs (``scripts/gpu_vision.py``): a LLaVA model (the embedded
   vision model, else a tiny random one) with its VISION programs captured: a
   vision frame of 2 images, a packed prefill reading their features and
   decode frames give the eager tokens and transformers' greedy ``generate``;
   one image padded in the B = 2 program writes only its rows; and each image
   bucket's vision frame time beside the prefill that reads its images.

``--device cpu`` runs the same script without capture or NCCL (a dry run of
the script itself).  The last line is one JSON object with every figure; the
same object is written to ``DIR/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_packed
import gpu_realistic
import gpu_scored
import gpu_speculative
import gpu_vision
import torch
from gpu_timing import event_us

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import default_model_dir, load_model
from runtime.ranks.slots import needs_full
from runtime.ranks.worker import RankWorker
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams

PAGE = 16
PAGES_PER_SLOT = 32
RESULTS: dict[str, object] = {}


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS[f"{name}_ok"] = ok
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    return ok


def worker(device: str, capture: bool) -> tuple[RankWorker, float]:
    model = load_model(default_model_dir(), dtype=torch.float32, device=device)
    capacity = CapacityConfig(
        max_concurrency=8, min_prefill_tokens=64, max_prefill_tokens=256, mixed_prefill=True
    )
    start = time.perf_counter()
    w = RankWorker(
        model, capacity, num_pages=8 * PAGES_PER_SLOT, page_size=PAGE, capture=capture,
        max_model_len=PAGES_PER_SLOT * PAGE,
    )  # fmt: skip
    return w, time.perf_counter() - start


class Driver:
    """Frames the way the coordinator builds them, for one worker."""

    _runs: ClassVar[dict[int, int]] = {}  # per worker: generations and fences used

    def __init__(self, w: RankWorker) -> None:
        self.w, self.pos = w, {}
        self.gen = Driver._runs[id(w)] = Driver._runs.get(id(w), 0) + 1  # fresh tenants
        self.fence = self.gen * 1_000_000
        self.times: dict[str, list[int]] = {}

    def send(self, program: GraphDescriptor, lanes: list[FrameLane], prompt_row: int = -1):
        self.fence += 1
        completion = self.w.execute(Frame.from_lanes(self.fence, program, lanes, prompt_row))
        self.times.setdefault(program.describe(), []).append(completion.device_ns)
        return completion

    def chunk(self, slot, prompt, start, end, sampling) -> FrameLane:
        # The slot's table goes with its first chunk; the ranks keep it (appended pages).
        pages = (
            tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT)) if start == 0 else ()
        )
        last = 1 if end == len(prompt) else 0
        self.pos[slot] = end
        return FrameLane(slot, self.gen, "prefill", start, tuple(prompt[start:end]), start, pages,
                         last, sampling)  # fmt: skip

    def prefill(self, slot: int, prompt: list[int], sampling: SamplingParams, chunk: int = 256):
        out = None
        for start in range(0, len(prompt), chunk):
            lane = self.chunk(slot, prompt, start, min(start + chunk, len(prompt)), sampling)
            cap = next(c for c in (64, 128, 256) if c >= len(lane.prompt_tokens))
            out = self.send(GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=cap), [lane])
        return out.lane_results()[0].tokens[0]

    def decoders(self, slots: list[int]) -> list[FrameLane]:
        lanes = [FrameLane(s, self.gen, "decode", 0, (), self.pos[s], (), 1) for s in slots]
        for s in slots:
            self.pos[s] += 1
        return lanes

    def decode(self, slots: list[int]):
        batch = next(b for b in (1, 2, 4, 8) if b >= len(slots))
        return self.send(GraphDescriptor(GraphKind.DECODE, batch), self.decoders(slots))

    def mixed(self, chunk: FrameLane, slots: list[int]):
        """One mixed frame: ``chunk`` as the prompt row (lane 1 when there are
        decoders, so it is not always lane 0) beside the decoders ``slots``."""
        lanes = self.decoders(slots)
        row = min(1, len(lanes))
        lanes.insert(row, chunk)
        batch = next(b for b in (2, 4, 8) if b >= len(lanes))
        cap = next(c for c in (64, 128, 256) if c >= len(chunk.prompt_tokens))
        program = GraphDescriptor(GraphKind.MIXED, batch, prompt_capacity=cap)
        return self.send(program, lanes, prompt_row=row)


def generate(w: RankWorker, prompts, samplings, new: int, together: bool = True):
    d = Driver(w)
    out = {i: [d.prefill(i, p, s)] for i, (p, s) in enumerate(zip(prompts, samplings))}
    slots = list(out)
    for _ in range(new - 1):
        groups = [slots] if together else [[s] for s in slots]
        for group in groups:
            completion = d.decode(group)
            for lane in completion.lane_results():
                out[lane.slot].append(lane.tokens[0])
    return [out[i] for i in slots], d


def generate_mixed(w: RankWorker, prompts, samplings, new: int, use_mixed: bool = True):
    """The first half of the prompts prefilled alone; each later prompt arrives
    chunk by chunk beside the running decoders, as mixed frames (``use_mixed``)
    or as a prefill frame plus a decode frame; then decode to ``new`` tokens."""
    d = Driver(w)
    half = len(prompts) // 2
    out = {i: [d.prefill(i, prompts[i], samplings[i])] for i in range(half)}
    for i in range(half, len(prompts)):
        prompt = prompts[i]
        for start in range(0, len(prompt), 256):
            end = min(start + 256, len(prompt))
            running = [s for s in out if len(out[s]) < new]
            chunk = d.chunk(i, prompt, start, end, samplings[i])
            if use_mixed:
                lanes = d.mixed(chunk, running).lane_results()
            else:
                cap = next(c for c in (64, 128, 256) if c >= len(chunk.prompt_tokens))
                program = GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=cap)
                lanes = d.send(program, [chunk]).lane_results()
                lanes += d.decode(running).lane_results() if running else ()
            for lane in lanes:
                if lane.tokens:  # a chunk short of the prompt end commits none
                    out.setdefault(lane.slot, []).extend(lane.tokens)
    while any(len(t) < new for t in out.values()):
        completion = d.decode([s for s in out if len(out[s]) < new])
        for lane in completion.lane_results():
            out[lane.slot].append(lane.tokens[0])
    return [out[i] for i in range(len(prompts))], d


def check_penalties(eager: RankWorker, graphs: RankWorker, prompts: list[list[int]]) -> bool:
    """Logit bias and penalties: graph == eager, batch invariance, device state."""
    plain = [SamplingParams()] * 3 + [SamplingParams(0.9, 0.95, 20, 1006)]
    settings = [
        # Strong enough to move a trained model's greedy choice within 12 tokens.
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=1.5, presence_penalty=1.0),
        SamplingParams(logit_bias=((5, 12.0), (7, -2.0), (300, 10.0))),
        plain[0],  # no adjustments, beside adjusted lanes
        SamplingParams(0.8, 0.9, 40, 1004, repetition_penalty=1.2, logit_bias=((11, 1.5),)),
        SamplingParams(0.7, 1.0, -1, 1005, frequency_penalty=1.0),
        plain[3],  # seeded, no adjustments
        SamplingParams(presence_penalty=-2.0, repetition_penalty=0.5),
    ]
    ok = True
    ref, _ = generate(eager, prompts, settings, 12)
    got, _ = generate(graphs, prompts, settings, 12)
    ok &= check("penalties_graph_equals_eager", got == ref)
    # The state the graphs updated: counts of the committed tokens, the prompt's set.
    state = next(iter(graphs.programs.values())).outputs.penalties
    counts, mask = state.counts[:8].cpu(), state.prompt_mask[:8].cpu()
    # Kept for every slot whose settings need the full sampler (the argmax
    # variant of an all-greedy, unadjusted frame leaves the state alone).
    kept = [i for i, params in enumerate(settings) if needs_full(params)]
    good = len(kept) == 7 and all(
        Counter({t: c for t, c in enumerate(counts[i].tolist()) if c}) == Counter(got[i])
        and set(mask[i].nonzero().flatten().tolist()) == set(prompts[i])
        for i in kept
    )
    ok &= check("penalties_device_state", good)
    alone, _ = generate(graphs, prompts, settings, 12, together=False)
    ok &= check("penalties_batch_invariance", alone == got)
    base, _ = generate(graphs, prompts, [plain[0]] * 6 + [plain[3], plain[0]], 12)
    ok &= check("penalties_unadjusted_lanes_unchanged", got[3] == base[3] and got[6] == base[6])
    adjusted = sum(got[i] != base[i] for i in (0, 1, 2, 7))
    ok &= check("penalties_change_greedy_tokens", adjusted >= 3, f"{adjusted}/4 lanes changed")
    banned = [SamplingParams(logit_bias=((tokens[0], -100.0),)) for tokens in base]
    moved, _ = generate(graphs, prompts, banned, 4)
    ok &= check("penalties_bias_moves_greedy", all(m[0] != b[0] for m, b in zip(moved, base)))
    ref, _ = generate_mixed(eager, prompts, settings, 12)
    got, _ = generate_mixed(graphs, prompts, settings, 12)
    ok &= check("penalties_mixed_graph_equals_eager", got == ref)
    separate, _ = generate_mixed(graphs, prompts, settings, 12, use_mixed=False)
    ok &= check("penalties_mixed_equals_separate", got == separate)
    return ok


def check_speculative_kernels() -> bool:
    """The speculative kernels (issue 13) compiled on the device against their
    torch references: rejection-sampling verification and prefix allocation."""
    from kernels.reference.prefix_allocation import prefix_allocation_reference
    from kernels.reference.speculative_verify import verify_reference
    from kernels.triton.prefix_allocation import prefix_allocation
    from kernels.triton.speculative_verify import speculative_verify

    gen = torch.Generator(device="cuda").manual_seed(7)
    lanes, k, vocab = 16, 7, 32000
    target = torch.softmax(torch.randn(lanes, k + 1, vocab, device="cuda", generator=gen), -1)
    draft = torch.softmax(torch.randn(lanes, k, vocab, device="cuda", generator=gen), -1)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(lanes, k)
    num = torch.randint(0, k + 1, (lanes,), device="cuda", generator=gen)
    u = torch.rand(lanes, k, device="cuda", generator=gen)
    ru = torch.rand(lanes, k, device="cuda", generator=gen)
    bu = torch.rand(lanes, device="cuda", generator=gen)
    ok = True
    for greedy in (False, True):
        got = speculative_verify(target, draft, tokens, num, u, ru, bu, greedy=greedy)
        ref = verify_reference(target, draft, tokens, num, u, ru, bu, greedy=greedy)
        same = bool((got[0] == ref[0]).all() and (got[1] == ref[1]).all())
        close = bool(torch.allclose(got[2], ref[2], rtol=1e-4, atol=1e-6))
        ok &= check(f"speculative_verify_{'greedy' if greedy else 'sampled'}", same and close)
    joint = torch.rand(64, 16, device="cuda", generator=gen).sort(dim=1, descending=True).values
    ceilings = torch.randint(1, 18, (64,), device="cuda", generator=gen)
    slots = torch.randperm(64, device="cuda", generator=gen)
    for rows in (64, 200, 2000):
        got = prefix_allocation(joint, ceilings, slots, rows)
        ref = prefix_allocation_reference(joint, ceilings, slots, rows)
        ok &= check(f"prefix_allocation_{rows}", bool((got == ref).all()))
    return ok


def check_verify_attention() -> bool:
    """The verify attention kernel (W > 1 queries per lane, flash-decoding) compiled
    on the device against its torch reference: W 2..16, GQA 4 and 8, fp16/bf16,
    default and single splits; and its event time beside the prefill kernel's on
    the same step (recorded, not checked)."""
    from kernels.reference.paged_verify_attention import paged_verify_attention_reference
    from kernels.triton.paged_prefill_attention import paged_prefill_attention as prefill
    from kernels.triton.paged_verify_attention import paged_verify_attention

    gen = torch.Generator(device="cuda").manual_seed(11)
    d = 128
    # Lanes' contexts: inactive, one page, page-crossing, long; W new tokens each
    # (ragged: the inactive lane has none, another half of W).
    contexts = [0, PAGE, 1000, 4096 + 5, 16384 + 3, 77]
    max_pages = 16384 // PAGE + 1
    used = [-(-c // PAGE) for c in contexts]
    ok, detail = True, []
    for heads, kv_heads, w in ((16, 4, 2), (16, 4, 4), (32, 4, 8), (32, 4, 16)):
        query_lens = [0, w, w, max(1, w // 2), w, w]
        lens = torch.tensor(query_lens, device="cuda")
        starts = torch.cumsum(lens, 0) - lens
        ctx = torch.tensor(contexts, device="cuda")
        tables = torch.full((len(contexts), max_pages), -1, dtype=torch.int32, device="cuda")
        perm = torch.randperm(sum(used) + 1, device="cuda", generator=gen).int()
        start = 0
        for lane, n in enumerate(used):
            tables[lane, :n] = perm[start : start + n]
            start += n
        tokens = sum(query_lens) + 5  # padding rows too
        for dtype in (torch.float16, torch.bfloat16):
            shape = (2, sum(used) + 1, PAGE, kv_heads, d)
            k, v = torch.randn(shape, device="cuda", generator=gen).to(dtype).unbind(0)
            q = torch.randn(tokens, heads, d, device="cuda", generator=gen).to(dtype)
            args = (q, k, v, tables, starts, lens, ctx, d**-0.5, w)
            ref = paged_verify_attention_reference(*args).float()
            for splits in (None, 1):
                out = paged_verify_attention(*args, splits)
                # Error relative to 1 + |ref|: one half-precision ulp at any magnitude.
                diff = ((out.float() - ref).abs() / (1 + ref.abs())).max().item()
                ok &= diff < 2e-2 and bool((out[sum(query_lens) :] == 0).all())
                detail.append(f"H{heads}/{kv_heads} W{w} {str(dtype)[6:]} s={splits}: {diff:.1e}")
            if dtype == torch.bfloat16:
                for name, fn in (("verify", paged_verify_attention), ("prefill", prefill)):
                    us = event_us(fn, args)
                    RESULTS[f"kernel_{name}_w{w}_h{heads}_bf16_us"] = round(us, 1)
    return check("verify_attention_equals_reference", ok, "; ".join(detail))


def check_debugging(engine, prompts, profiles: Path, cuda: bool, tp: int) -> bool:
    """Rank inspection and the on-demand profiler on the device (issue 11)."""
    import threading

    from runtime.transport.control import profile_path

    statuses = engine.inspect_ranks()
    ok = check(f"inspect_tp{tp}", len(statuses) == tp and all(
        (s.device_allocated_bytes > 0 and sum(s.captured) > 0) or not cuda for s in statuses
    ), f"captured {[sum(s.captured) for s in statuses]}, allocated "
       f"{[s.device_allocated_bytes >> 20 for s in statuses]} MiB")  # fmt: skip
    answer: dict = {}

    def ask() -> None:
        answer["frames"], answer["nonce"] = engine.profile_ranks(3, timeout_s=120)

    asking = threading.Thread(target=ask)
    asking.start()
    time.sleep(0.5)  # the ranks have the profile request before the frames
    for stream in [engine.submit(p, 6, ignore_eos=True) for p in prompts]:
        stream.result(timeout=300)
    asking.join(150)
    kernels = 0
    if answer.get("frames") == {rank: 3 for rank in range(tp)}:
        with open(profile_path(str(profiles), answer["nonce"], 0)) as f:
            events = json.load(f)["traceEvents"]
        kernels = sum(1 for e in events if e.get("cat") == "kernel")
    return ok & check(
        f"profile_tp{tp}",
        bool(answer) and (kernels > 0 or not cuda),
        f"frames {answer.get('frames')}, {kernels} CUDA kernel events on rank 0",
    )


def check_kv_memory(device: str) -> bool:
    """Pages on demand, preemption, the prefix cache and the state programs on the
    device: 6 requests in a pool too small for them at once give the tokens of a
    large pool (float32, greedy), with preemptions, restore and snapshot rows run
    (copies and restored rows before graph replay), and every page back."""
    from runtime.deploy.config import DeploymentConfig
    from runtime.deploy.local import LocalDeployment

    prompts = [[(11 * i + 5 * j + 1) % 500 for j in range(60 + 10 * i)] for i in range(6)]
    shared = [[*prompts[0][:48], *p[:20]] for p in prompts]  # a cached 48-token prefix
    results = {}
    for pages in (40, 2048):
        config = DeploymentConfig(device=device, dtype="float32", max_model_len=512,
                                  num_pages=pages, max_concurrency=8)  # fmt: skip
        with LocalDeployment(config) as deployment:
            engine = deployment.engine
            streams = [engine.submit(p, 40, ignore_eos=True) for p in prompts + shared]
            tokens = [s.result(timeout=300).token_ids for s in streams]
            metrics = engine.metrics()
        results[pages] = (tokens, metrics)
    (small, m), (big, _) = results[40], results[2048]
    for key in ("preemptions", "prefix_cache_hit_tokens", "frames_total:restore",
                "frames_total:snapshot", "kv_pages_held"):  # fmt: skip
        RESULTS[f"kv_{key.replace(':', '_')}"] = m.get(key, 0)
    return check(
        "kv_memory",
        small == big and m["preemptions"] >= 1 and m.get("frames_total:restore", 0) >= 1
        and m["kv_pages_held"] == 0,
        f"preemptions {m['preemptions']:.0f}, restores {m.get('frames_total:restore', 0):.0f}, "
        f"hit tokens {m['prefix_cache_hit_tokens']:.0f}",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tp2", action="store_true", help="also run the deployment at TP=2")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("FAIL no CUDA device", flush=True)
        return 1
    RESULTS["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    RESULTS["torch"] = torch.__version__
    prompts = [[(7 * i + 13 * j + 3) % 500 for j in range(20 + 37 * i)] for i in range(8)]
    greedy = [SamplingParams()] * 8
    seeded = [SamplingParams(0.8, 0.9, 40, 1000 + i) for i in range(8)]

    eager, _ = worker(args.device, capture=False)
    graphs, capture_s = worker(args.device, capture=cuda)
    RESULTS["capture_s"] = round(capture_s, 3)
    captured = sum(program.captured for program in graphs.programs.values())
    ok = check("capture", captured == len(graphs.programs) or not cuda,
               f"{captured}/{len(graphs.programs)} programs in {capture_s:.2f} s")  # fmt: skip

    for name, samplings in (("greedy", greedy), ("seeded", seeded)):
        ref, _ = generate(eager, prompts, samplings, 12)
        got, driver = generate(graphs, prompts, samplings, 12)
        ok &= check(f"graph_equals_eager_{name}", got == ref)
        alone, _ = generate(graphs, prompts, samplings, 12, together=False)
        ok &= check(f"batch_invariance_{name}", alone == got)

    def logprob_values(w: RankWorker) -> list[float]:
        d = Driver(w)
        d.prefill(0, prompts[1], SamplingParams(logprobs=5))
        return d.decode([0]).sidecars["logprobs"].values()

    a, b = logprob_values(eager), logprob_values(graphs)
    diff = max(abs(x - y) for x, y in zip(a, b))
    ok &= check("logprobs_graph_equals_eager", len(a) == len(b) and diff < 1e-5, f"max diff {diff}")

    mixed = sum(d.kind is GraphKind.MIXED for d in graphs.catalog)
    RESULTS["mixed_programs"] = mixed
    ok &= check("mixed_programs_prepared", mixed == 9, f"{mixed} mixed programs")
    for name, samplings in (("greedy", greedy), ("seeded", seeded)):
        ref, _ = generate_mixed(eager, prompts, samplings, 12)
        got, _ = generate_mixed(graphs, prompts, samplings, 12)
        ok &= check(f"mixed_graph_equals_eager_{name}", got == ref)
    separate, _ = generate_mixed(graphs, prompts, greedy, 12, use_mixed=False)
    together, _ = generate_mixed(graphs, prompts, greedy, 12)
    ok &= check("mixed_equals_separate_greedy", together == separate)

    def mixed_logprobs(w: RankWorker) -> list[float]:
        d = Driver(w)
        d.prefill(0, prompts[1], SamplingParams(logprobs=5))
        chunk = d.chunk(1, prompts[2], 0, len(prompts[2]), SamplingParams(logprobs=5))
        return d.mixed(chunk, [0]).sidecars["logprobs"].values()

    a, b = mixed_logprobs(eager), mixed_logprobs(graphs)
    diff = max(abs(x - y) for x, y in zip(a, b))
    ok &= check("mixed_logprobs_graph_equals_eager", len(a) == len(b) == 12 and diff < 1e-5,
                f"max diff {diff}")  # fmt: skip

    ok &= check_penalties(eager, graphs, prompts)
    ok &= gpu_packed.run(check, RESULTS, args.device)
    ok &= gpu_scored.run(check, RESULTS, args.device)
    ok &= gpu_vision.run(check, RESULTS, args.device)

    if cuda:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        ok &= check("nccl_all_reduce", bool((x == 1).all()))
        dist.destroy_process_group()

    ok &= gpu_realistic.run(check, RESULTS, cuda)
    if cuda:
        ok &= check_speculative_kernels()
        ok &= check_verify_attention()
        ok &= gpu_speculative.run(check, RESULTS, args.device)  # whole rounds, graphs

    _, driver = generate(graphs, prompts, greedy, 16)
    _, mixed_driver = generate_mixed(graphs, prompts, greedy, 16)
    for graph, ns in mixed_driver.times.items():
        driver.times.setdefault(graph, []).extend(ns)
    table = {g: round(statistics.median(ns) / 1e3, 1) for g, ns in sorted(driver.times.items())}
    RESULTS["replay_us"] = table
    print("program replay (median us):")
    for graph, us in table.items():
        print(f"  {graph:<30} {us:>10.1f}")

    from runtime.deploy.config import DeploymentConfig
    from runtime.deploy.local import LocalDeployment

    ref, _ = generate(graphs, prompts, greedy, 8)
    gpus = torch.cuda.device_count() if cuda else 0
    if args.tp2 and gpus < 2:
        print(f"SKIP deployment_tp2: TP>1 needs more than one GPU; this machine has {gpus}",
              flush=True)  # fmt: skip
    for tp in (1, 2) if args.tp2 and gpus >= 2 else (1,):
        config = DeploymentConfig(tensor_parallel_size=tp, max_concurrency=16,
                                  max_prefill_tokens=256,
                                  num_pages=None if cuda else 1024,
                                  device=args.device, max_model_len=512,
                                  mixed_prefill=True,
                                  profile_dir=str(Path(args.out) / "profiles"))  # fmt: skip
        with LocalDeployment(config) as deployment:
            engine = deployment.engine
            streams = [engine.submit(p, 8, ignore_eos=True) for p in prompts * 2]
            tokens = [s.result(timeout=300).token_ids for s in streams]
            trips = engine.measure_round_trip(200)
            ok &= check_debugging(engine, prompts, Path(args.out) / "profiles", cuda, tp)
            summary = engine.stats.summary()
            RESULTS[f"tp{tp}_num_pages"] = engine.facts.num_pages
            by_kind = {kind: frames for kind, (frames, _) in engine.stats.by_kind().items()}
        RESULTS[f"tp{tp}_frames_by_kind"] = by_kind  # "mixed": frames the scheduler chose
        RESULTS[f"tp{tp}_round_trip_us"] = round(statistics.median(trips) / 1e3, 1)
        RESULTS[f"tp{tp}_host_overhead_ratio"] = round(summary.get("busy_overhead_ratio", 0), 3)
        # bfloat16 on CUDA by default: compare the deployment with itself across copies.
        ok &= check(f"deployment_tp{tp}_consistent", tokens[:8] == tokens[8:],
                    f"round trip {RESULTS[f'tp{tp}_round_trip_us']} us")  # fmt: skip
    ok &= check_kv_memory(args.device)
    RESULTS["reference_tokens_first"] = ref[0]
    RESULTS["all_ok"] = bool(ok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1))
    print(json.dumps(RESULTS, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
