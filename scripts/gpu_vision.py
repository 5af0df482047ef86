"""Vision programs on the device, for scripts/gpu_check.py (also runs on CPU).

With a LLaVA model in float32 (the embedded vision model under
``runtime/ranks/model/weights/vision`` when its ``config.json`` exists, else a
tiny random-weight LLaVA written with transformers into a temporary directory)
and a catalog with VISION programs B = 1, 2, 4 and packed prefill programs:

1. capture: every VISION program captured as a CUDA graph beside the others;
2. tokens: a vision frame of 2 images (``Frame.vision``, windows 0 and 1), one
   packed prefill frame reading their features (two prompts with an image
   each and a text-only prompt, ``feature_rows``), then decode frames: the
   greedy tokens of graph replay equal an eager worker's on the same device
   and transformers' ``LlavaForConditionalGeneration.generate`` on the same
   device for the same prompts and pixels (up to the first EOS; a mismatch
   prints transformers' top-2 logit gap where they part); the two images
   swapped change an imaged prompt's tokens and leave the text-only one's;
3. padding: a vision frame of 1 image in the B = 2 program writes only its N
   rows (every other store row unchanged; the scratch row aside), and the rows
   it writes equal those a B = 1 frame writes for the same image (1e-4);
4. timing: per image-count bucket B, the median device interval (from the
   completions, ~20 frames) of a vision frame of B images beside a prefill
   frame of one prompt holding those B images (the prefill that reads them).

On CPU the graphs are eager (one worker; a dry run of the script itself).

    python scripts/gpu_vision.py [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import load_model
from runtime.ranks.model.default import WEIGHTS_DIR
from runtime.ranks.worker import RankWorker
from runtime.transport.completion import Completion
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams

PAGE = 16
PAGES_PER_SLOT = 32  # 512 tokens per request
NEW = 8  # tokens generated per prompt
REPEAT = 20  # frames timed per bucket (CUDA; a CPU dry run times CPU_REPEAT)
CPU_REPEAT = 3
EMBEDDED = WEIGHTS_DIR / "vision"
CAPACITY = CapacityConfig(
    max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=512, packed_prefill=True,
    max_vision_images=4,
)  # fmt: skip


def write_tiny_llava(path: Path) -> None:
    """A tiny random LLaVA in transformers' layout (a CLIP encoder of 32-pixel
    images in 8-pixel patches: 16 feature rows per image; a 2-layer Llama of 128
    ids, image token 120, EOS 127), weights drawn away from the initializer's."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as HFLlava

    text = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=127, bos_token_id=1,
    )  # fmt: skip
    encoder = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
        image_size=32, patch_size=8, projection_dim=32,
    )  # fmt: skip
    torch.manual_seed(3)
    config = LlavaConfig(vision_config=encoder, text_config=text, image_token_index=120)
    model = HFLlava(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + torch.randn_like(param) * 0.1)
            else:
                param.copy_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)


def model_dir(tmp: str) -> tuple[Path, str]:
    """The embedded vision model when committed, else the tiny random one in ``tmp``."""
    if (EMBEDDED / "config.json").exists():
        return EMBEDDED, "embedded"
    write_tiny_llava(Path(tmp))
    return Path(tmp), "random"


def make_worker(path: Path, device: str, capture: bool) -> RankWorker:
    return RankWorker(
        load_model(path, dtype=torch.float32, device=device), CAPACITY,
        num_pages=8 * PAGES_PER_SLOT, page_size=PAGE, capture=capture,
        max_model_len=PAGES_PER_SLOT * PAGE,
    )  # fmt: skip


def smallest(w: RankWorker, kind: GraphKind, rows: int, tokens: int = 0) -> GraphDescriptor:
    """The smallest program of ``kind`` in the catalog holding ``rows`` and ``tokens``."""
    fits = [d for d in w.catalog if d.kind is kind and d.batch_capacity >= rows
            and d.prompt_capacity >= tokens]  # fmt: skip
    return min(fits, key=lambda d: (d.batch_capacity, d.prompt_capacity))


class Driver:
    """Frames for one worker: vision, (packed) prefill reading features, decode.
    One per worker (:func:`driver`): its fences and generations only increase."""

    def __init__(self, w: RankWorker) -> None:
        self.w, self.fence, self.gen = w, 0, 0
        self.image = w.model.image_token_id
        self.n = w.model.image_tokens_per_image
        self.times: dict[str, list[int]] = {}

    def send(self, frame: Frame) -> Completion:
        self.fence += 1
        done = self.w.execute(frame)
        assert done.error is None, done.error
        self.times.setdefault(frame.program.describe(), []).append(done.device_ns)
        return done

    def vision(self, pixels: torch.Tensor, bases: list[int], b: int) -> Completion:
        data = pixels.contiguous().numpy().astype("<f4").tobytes()
        done = self.send(Frame.vision(self.fence + 1, GraphDescriptor(GraphKind.VISION, b),
                                      bases, data))  # fmt: skip
        assert done.num_lanes == 0 and not done.sidecars
        return done

    def rows(self, ids: list[int], bases: list[int]) -> list[int]:
        """Each token's store row: image ``k``'s tokens read ``bases[k] + 0..N-1``."""
        out, seen = [], 0
        for token in ids:
            if token != self.image:
                out.append(-1)
                continue
            k, j = divmod(seen, self.n)
            out.append(bases[k] + j)
            seen += 1
        return out

    def prefill(self, prompts: list[tuple[list[int], list[int]]]) -> Completion:
        """One frame, a row per prompt (ids, its images' store bases) in slots 0..,
        a fresh generation (the same pages)."""
        self.gen += 1
        lanes, feature = [], []
        for slot, (ids, bases) in enumerate(prompts):
            pages = tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))
            lanes.append(FrameLane(slot, self.gen, "prefill", 0, tuple(ids), 0, pages, 1,
                                   SamplingParams()))  # fmt: skip
            feature += self.rows(ids, bases)
        program = smallest(self.w, GraphKind.PREFILL, len(lanes), len(feature))
        return self.send(Frame.from_lanes(self.fence + 1, program, lanes, feature_rows=feature))

    def generate(self, prompts, pixels: torch.Tensor, bases: list[int]) -> list[list[int]]:
        """A vision frame of the images, the packed prefill, NEW - 1 decode frames."""
        self.vision(pixels, bases, 2)
        out = {r.slot: list(r.tokens) for r in self.prefill(prompts).lane_results()}
        slots = range(len(prompts))
        program = smallest(self.w, GraphKind.DECODE, len(prompts))
        for step in range(NEW - 1):
            lanes = [FrameLane(s, self.gen, "decode", 0, (), len(prompts[s][0]) + step, (), 1)
                     for s in slots]  # fmt: skip
            for r in self.send(Frame.from_lanes(self.fence + 1, program, lanes)).lane_results():
                out[r.slot].extend(r.tokens)
        return [out[s] for s in slots]


DRIVERS: dict[int, Driver] = {}


def driver(w: RankWorker) -> Driver:
    d = DRIVERS.get(id(w))
    if d is None or d.w is not w:
        d = DRIVERS[id(w)] = Driver(w)
    return d


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
    return tokens[: cut + 1]


def reference(path: Path, device: str, prompts, pixels: list[torch.Tensor], eos: set[int]):
    """transformers' greedy tokens per prompt (its images' pixels) and a function
    giving its top-2 logit gap after a prompt plus some tokens."""
    from transformers import LlavaForConditionalGeneration as HFLlava

    model = HFLlava.from_pretrained(path, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for (ids, _), images in zip(prompts, pixels):
            inp = torch.tensor([ids], device=device)
            extra = {"pixel_values": images.to(device)} if len(images) else {}
            gen = model.generate(
                inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=NEW,
                eos_token_id=sorted(eos), pad_token_id=0, **extra,
            )  # fmt: skip
            out.append(until_eos(gen[0, len(ids) :].tolist(), eos))

    def gap(ids: list[int], images: torch.Tensor) -> float:
        inp = torch.tensor([ids], device=device)
        extra = {"pixel_values": images.to(device)} if len(images) else {}
        with torch.no_grad():
            top = model(input_ids=inp, **extra).logits[0, -1].float().topk(2).values
        return float(top[0] - top[1])

    return out, gap


def check_tokens(check, results, path, eager, graphs, device: str) -> bool:
    """A vision frame of 2 images, a packed prefill reading them, decode frames:
    graphs == eager == transformers."""
    d = driver(graphs)
    img, size = [d.image] * d.n, graphs.model.config.vision.encoder.image_size
    window = graphs.store.capacity.window_rows  # image 0 in window 0, image 1 in window 1
    prompts = [([1, 5, *img, 17, 33], [0]), ([1, 9, 40, *img, 41, 3], [window]), ([1, 7, 8, 9], [])]
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(7))
    got = d.generate(prompts, pixels, [0, window])
    want = got if eager is graphs else driver(eager).generate(prompts, pixels, [0, window])
    ok = check("vision_graph_equals_eager", got == want, f"{len(prompts)} prompts x {NEW}")
    swapped = d.generate(prompts, pixels.flip(0), [0, window])  # each prompt the other image
    changed = sum(a != b for a, b in zip(swapped[:2], got[:2]))
    ok &= check("vision_features_decide_tokens", changed >= 1 and swapped[2] == got[2],
                f"images swapped: {changed}/2 imaged prompts changed, text-only kept")  # fmt: skip
    eos = set(graphs.model.config.eos_token_ids)
    per_prompt = [pixels[[0]], pixels[[1]], pixels[:0]]
    ref, gap = reference(path, device, prompts, per_prompt, eos)
    mine = [until_eos(t, eos) for t in got]
    detail = []
    for (ids, _), a, b, images in zip(prompts, mine, ref, per_prompt):
        part = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if part is not None:
            margin = gap(ids + a[:part], images)
            detail.append(f"parts at token {part}: {a[part]} vs {b[part]}, top-2 gap {margin:.2e}")
    results["vision_tokens"] = mine
    good = mine == ref
    ok &= check("vision_equals_transformers", good, "; ".join(detail) or f"{mine}")
    return ok


def check_padding(check, results, w: RankWorker) -> bool:
    """One image in the B = 2 program writes only its rows, the rows a B = 1 frame
    writes for the same image."""
    d = driver(w)
    store, n = w.store, d.n
    size = w.model.config.vision.encoder.image_size
    image = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(11))
    d.vision(torch.randn(2, 3, size, size), [0, n], 2)  # stale pixels behind the padding
    base, other = 2 * store.capacity.window_rows, 3 * store.capacity.window_rows
    before = store.features[: store.rows].clone()
    d.vision(image, [base], 2)
    after = store.features[: store.rows].clone()
    moved = (after != before).any(dim=1).nonzero().flatten().tolist()
    ok = check("vision_padded_frame_writes_its_rows_only", moved == list(range(base, base + n)),
               f"{len(moved)} rows changed of {store.rows}, expected {n} at {base}")  # fmt: skip
    d.vision(image, [other], 1)
    single = store.features[other : other + n]
    diff = float((after[base : base + n] - single).abs().max())
    results["vision_padded_vs_single_max_diff"] = diff
    ok &= check("vision_padded_equals_single", diff < 1e-4, f"max diff {diff:.2e}")
    return ok


def time_buckets(results, w: RankWorker) -> None:
    """Per VISION bucket B: the median device interval of vision frames of B
    images beside a prefill frame of one prompt holding those B images."""
    d = driver(w)
    n, size = d.n, w.model.config.vision.encoder.image_size
    pixels = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(13))
    table = {}
    buckets = sorted(p.desc.batch_capacity for p in w.vision.values())
    repeat = REPEAT if w.device.type == "cuda" else CPU_REPEAT
    for b in buckets:
        bases = [k * n for k in range(b)]
        vision = [d.vision(pixels[:b], bases, b).device_ns for _ in range(repeat)]
        ids = [1, 5]
        for k in range(b):
            ids += [d.image] * n + [17 + k]
        prefill = [d.prefill([(ids, bases)]).device_ns for _ in range(repeat)]
        program = smallest(w, GraphKind.PREFILL, 1, len(ids)).describe()
        table[f"B={b}"] = {
            "vision_us": round(statistics.median(vision) / 1e3, 1),
            "prefill_us": round(statistics.median(prefill) / 1e3, 1),
            "prefill_program": program,
            "prompt_tokens": len(ids),
        }
    results["vision_replay_us"] = table
    print(f"vision frames beside the prefill reading them (median us of {repeat}):")
    for bucket, row in table.items():
        print(f"  vision {bucket:<5} {row['vision_us']:>10.1f}   {row['prefill_program']:<20}"
              f" ({row['prompt_tokens']} tokens) {row['prefill_us']:>10.1f}")  # fmt: skip


def run(check, results: dict, device: str) -> bool:
    cuda = device == "cuda"
    with tempfile.TemporaryDirectory(prefix="gpu-vision-") as tmp:
        path, source = model_dir(tmp)
        eager = make_worker(path, device, capture=False)
        graphs = make_worker(path, device, capture=True) if cuda else eager  # CPU: one worker
        vision = list(graphs.vision.values())
        captured = sum(p.captured for p in vision)
        every = sum(p.captured for p in graphs.programs.values()) == len(graphs.programs)
        n = graphs.model.image_tokens_per_image
        results["vision_model"] = source
        results["vision_image_tokens"] = n
        detail = (f"{source} model, N={n}: {captured}/{len(vision)} vision programs "
                  f"({', '.join(p.desc.describe() for p in vision)}) captured")  # fmt: skip
        good = bool(vision) and ((captured == len(vision) and every) or not cuda)
        ok = check("vision_capture", good, detail)
        ok &= check_tokens(check, results, path, eager, graphs, device)
        ok &= check_padding(check, results, graphs)
        time_buckets(results, graphs)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL no CUDA device", flush=True)
        return 1
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
