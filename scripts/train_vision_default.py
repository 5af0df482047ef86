"""Train the embedded default vision model (a tiny LLaVA); write it into the package.

    python scripts/train_vision_default.py [--threads 1] [--tower-steps N] [--steps N]

Pillow pictures with captions, asked in the ``chat_template`` format; transformers'
``LlavaForConditionalGeneration`` (CLIP tower pretrained here with linear probes, the
decoder from the committed text target plus ``<image>``), caption cross-entropy; fp16
files, ``TRAINING.md`` and ``SHA256SUMS`` in ``runtime/ranks/model/weights/vision/``;
figures from that directory loaded back, greedy ``generate`` on held-out pictures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from vision_data import (
    CLIP_MEAN,
    CLIP_STD,
    COLOURS,
    IMAGE_SIZE,
    POSITIONS,
    QUESTIONS,
    SCALE,
    SHAPES,
    caption,
    draw_picture,
    judge,
    pixels,
)

TEXT_DIR = Path(__file__).resolve().parent.parent / "runtime" / "ranks" / "model" / "weights"
OUT_DIR = TEXT_DIR / "vision"
MAX_BYTES = 6 * 1024 * 1024

PATCH_SIZE = 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 512
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
PAD_ID = 511
# Rendered by runtime/frontend/chat.py; an image content part is the text "<image>".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}"
    "{{ eos_token }}\n"
    "{% else %}{{ message['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

PROBES = {"shape": list(SHAPES), "colour": list(COLOURS), "count": [1, 2, 3],
          "position": [*POSITIONS, None]}  # fmt: skip
KEYS = ("shape", "colour", "both", "count", "position", "exact")
LAYOUT = ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json",
          "tokenizer_config.json", "processor_config.json")  # fmt: skip


def prompt_text(user: str) -> str:
    """CHAT_TEMPLATE rendered for one user message, with the generation prompt."""
    return f"{BOS}User: {user}\nAssistant:"


def vision_tokenizer():
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(TEXT_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == 512 and tok.token_to_id(PAD) == PAD_ID
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    return tok


def encode(tok, text: str) -> list[int]:
    """Ids with the image placeholder expanded to IMAGE_TOKENS image tokens."""
    ids = tok.encode(text, add_special_tokens=False).ids
    return [j for i in ids for j in ([i] * (IMAGE_TOKENS if i == IMAGE_TOKEN_ID else 1))]


def llava_config():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = json.loads((TEXT_DIR / "target.json").read_text(encoding="utf-8"))
    text.pop("architectures")
    text.update(vocab_size=IMAGE_TOKEN_ID + 1, pad_token_id=PAD_ID)
    vision = CLIPVisionConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                              num_attention_heads=8, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                              projection_dim=128, hidden_act="quick_gelu")  # fmt: skip
    return LlavaConfig(vision_config=vision, text_config=LlamaConfig(**text),
                       image_token_index=IMAGE_TOKEN_ID, image_seq_length=IMAGE_TOKENS,
                       projector_hidden_act="gelu", vision_feature_select_strategy="default",
                       vision_feature_layer=-1, tie_word_embeddings=False)  # fmt: skip


def build_model(seed: int):
    """A fresh LLaVA whose decoder is the committed text target (one row more)."""
    from safetensors.torch import load_file
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(llava_config()).float()
    state = {k: v.float() for k, v in load_file(str(TEXT_DIR / "target.safetensors")).items()}
    embed, head = state.pop("model.embed_tokens.weight"), state.pop("lm_head.weight")
    lm = model.model.language_model
    renamed = {k.removeprefix("model."): v for k, v in state.items()}
    missing, unexpected = lm.load_state_dict(renamed, strict=False)
    assert set(missing) == {"embed_tokens.weight"} and not unexpected, (missing, unexpected)
    with torch.no_grad():
        lm.embed_tokens.weight[:512], lm.embed_tokens.weight[512] = embed, embed.mean(0)
        model.lm_head.weight[:512], model.lm_head.weight[512] = head, 0.0
    return model


def example(rng: random.Random, tok) -> tuple[np.ndarray, list[int], int, range]:
    """Pixels, prompt + caption + EOS ids, the prompt's length, the shape word's ids."""
    img, facts = draw_picture(rng)
    question = rng.choice(QUESTIONS)  # the frontend joins content parts by newlines:
    parts = (IMAGE_TOKEN, question) if rng.random() < 0.75 else (question, IMAGE_TOKEN)
    prompt = encode(tok, prompt_text("\n".join(parts)))
    text = " " + caption(facts)
    answer = tok.encode(text, add_special_tokens=False).ids
    words = text.split(" ")  # "", count, colour, shape, ...
    n = [len(tok.encode(" ".join(words[:k]), add_special_tokens=False).ids) for k in (3, 4)]
    ids = prompt + answer + [tok.token_to_id(EOS)]
    return pixels(img), ids, len(prompt), range(len(prompt) + n[0], len(prompt) + n[1])


def batch(rng: random.Random, tok, size: int) -> dict[str, torch.Tensor]:
    """A batch for the model, plus "labels" (caption + EOS) and "shape" (its shape word)."""
    items = [example(rng, tok) for _ in range(size)]
    width = max(len(ids) for _, ids, _, _ in items)
    input_ids = torch.full((size, width), PAD_ID, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    mask = torch.zeros((size, width), dtype=torch.long)
    shape = torch.zeros((size, width), dtype=torch.bool)
    for row, (_, ids, n_prompt, span) in enumerate(items):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])  # caption + EOS
        mask[row, : len(ids)] = 1
        shape[row, span.start : span.stop] = True
    pix = torch.from_numpy(np.stack([p for p, _, _, _ in items]))
    return {"input_ids": input_ids, "attention_mask": mask, "pixel_values": pix,
            "labels": labels, "shape": shape}  # fmt: skip


def pretrain_vision(model, *, steps: int, size: int, lr: float, seed: int) -> dict:
    """Stage 1: the vision tower alone, with linear probes (then discarded) on the mean
    of the image features LLaVA reads (last layer, class position dropped). Starts from
    2-D sine-cosine position embeddings (MAE's, scaled) in place of random ones."""
    vt = model.model.vision_tower
    grid, d = IMAGE_SIZE // PATCH_SIZE, vt.config.hidden_size
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(d // 4) / (d // 4))
    pe = torch.zeros(grid * grid + 1, d)  # row 0: the class position
    for k, coord in enumerate((ys.flatten(), xs.flatten())):
        ang = coord[:, None].float() * omega[None]
        pe[1:, k * d // 2 : k * d // 2 + d // 4] = ang.sin()
        pe[1:, k * d // 2 + d // 4 : (k + 1) * d // 2] = ang.cos()
    with torch.no_grad():
        vt.embeddings.position_embedding.weight.copy_(pe * 0.3)
    torch.manual_seed(seed)
    width = vt.config.hidden_size
    heads = torch.nn.ModuleDict({k: torch.nn.Linear(width, len(v)) for k, v in PROBES.items()})
    params = [*vt.parameters(), *heads.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    rng, start, hist = random.Random(seed), time.time(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        drawn = [draw_picture(rng) for _ in range(size)]
        pix = torch.from_numpy(np.stack([pixels(img) for img, _ in drawn]))
        out = vt(pixel_values=pix, output_hidden_states=True)
        feats = out.hidden_states[-1][:, 1:].mean(1)
        loss, accs = torch.zeros(()), []
        for key, values in PROBES.items():
            y = torch.tensor([values.index(f[key]) for _, f in drawn])
            logits = heads[key](feats)
            loss = loss + F.cross_entropy(logits, y)
            accs.append((logits.argmax(-1) == y).float().mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        hist.append(accs)
        if step % 50 == 0 or step == steps - 1:
            mean = np.mean(hist[-50:], 0)
            probes = " ".join(f"{k} {a:.3f}" for k, a in zip(PROBES, mean))
            print(f"[tower] step {step + 1}/{steps} probe accuracy: {probes} "
                  f"{time.time() - start:.0f}s", flush=True)  # fmt: skip
    return dict(zip(PROBES, np.mean(hist[-50:], 0).tolist()))


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer(model, lr: float, tower_scale: float = 1.0) -> torch.optim.Optimizer:
    """AdamW; the vision tower's rate times tower_scale (0: frozen, not in the optimizer)."""
    groups = []
    for name, p in model.named_parameters():
        scale = tower_scale if "vision_tower" in name else 1.0
        p.requires_grad_(scale > 0)
        if scale > 0:
            groups.append({"params": [p], "weight_decay": 0.05 if p.dim() >= 2 else 0.0,
                           "scale": scale})  # fmt: skip
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def caption_loss(logits, labels, shape, shape_weight: float) -> tuple[torch.Tensor, float]:
    """Cross-entropy on caption + EOS (shape-word tokens weighted); the share of rows whose
    caption is all argmax-right (teacher forced)."""
    logits, labels, shape = logits[:, :-1], labels[:, 1:], shape[:, 1:]
    ce = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    weight = (labels != -100).float() * torch.where(shape, shape_weight, 1.0)
    right = (logits.argmax(-1) == labels) | (labels == -100)
    return (ce * weight).sum() / weight.sum(), right.all(1).float().mean().item()


def train(model, tok, *, steps: int, size: int, lr: float, seed: int, **kw) -> list[float]:
    """Caption training; kw: tower_scale (1), shape_weight (1)."""
    rng = random.Random(seed)
    opt = optimizer(model, lr, kw.get("tower_scale", 1.0))
    warmup = max(1, steps // 20)
    model.train()
    start, losses, exact = time.time(), [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup) * group["scale"]
        b = batch(rng, tok, size)
        labels, shape = b.pop("labels"), b.pop("shape")
        logits = model(**b).logits
        loss, ok = caption_loss(logits, labels, shape, kw.get("shape_weight", 1.0))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        exact.append(ok)
        if step % 25 == 0 or step == steps - 1:
            mean, right = np.mean(losses[-25:]), np.mean(exact[-25:])
            secs = time.time() - start
            rate = lr_at(step, steps, lr, warmup)
            line = f"caption ce {mean:.3f} all-right {right:.3f} lr {rate:.2e}"
            print(f"[vision] step {step + 1}/{steps} {line} {secs:.0f}s", flush=True)
    model.eval()
    return losses


def write_dir(model, tok, out: Path) -> None:
    from transformers import CLIPImageProcessorPil

    def dump(path: Path, obj: dict) -> None:
        path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        stale.unlink()
    model.to(torch.float16).save_pretrained(str(out))  # the model is not used afterwards
    proc = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, image_mean=list(CLIP_MEAN),
                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                 image_std=list(CLIP_STD))  # fmt: skip
    proc_cfg = json.loads(proc.to_json_string())
    proc_cfg["image_processor_type"] = "CLIPImageProcessor"
    dump(out / "preprocessor_config.json", proc_cfg)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    dump(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "pad_token": PAD, "image_token": IMAGE_TOKEN, "add_bos_token": False,
        "extra_special_tokens": {"image_token": IMAGE_TOKEN}, "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE})  # fmt: skip
    dump(out / "processor_config.json", {
        "processor_class": "LlavaProcessor", "image_token": IMAGE_TOKEN, "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1})  # fmt: skip
    for name in {p.name for p in out.iterdir()} - set(LAYOUT):  # generation_config.json
        (out / name).unlink()


def write_sums(out: Path) -> None:
    files = sorted(p for p in out.iterdir() if p.name != "SHA256SUMS")
    sums = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in files)
    (out / "SHA256SUMS").write_text(sums, encoding="utf-8")


@torch.no_grad()
def evaluate_dir(out: Path, n: int, seed: int, new_tokens: int = 24) -> dict:
    """Greedy ``generate`` with the committed directory as transformers loads it."""
    from transformers import AutoImageProcessor as Proc
    from transformers import LlavaForConditionalGeneration, PreTrainedTokenizerFast

    model = LlavaForConditionalGeneration.from_pretrained(str(out)).eval()
    assert model.dtype == torch.float16, model.dtype
    proc = Proc.from_pretrained(str(out))
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    rng = random.Random(seed)
    totals, samples = dict.fromkeys(KEYS, 0), []
    for i in range(n):
        img, facts = draw_picture(rng)
        question = QUESTIONS[i % len(QUESTIONS)]
        text = prompt_text(f"{IMAGE_TOKEN * IMAGE_TOKENS}\n{question}")  # expanded
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        pix = proc(images=img, return_tensors="pt")["pixel_values"].to(torch.float16)
        gen = model.generate(
            **ids, pixel_values=pix, max_new_tokens=new_tokens, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=PAD_ID,
        )  # fmt: skip
        answer = tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        for key, ok in judge(answer, facts).items():
            totals[key] += int(ok)
        if i < 8:
            samples.append((question, caption(facts), answer.strip()))
    return {"figures": {**{k: v / n for k, v in totals.items()}, "images": n}, "samples": samples}


def stages_md(args, result: dict, minutes: dict, tower: dict) -> str:
    """TRAINING.md's numbered stages: this run's, or the resumed record's plus stage 3."""
    if not args.resume:
        probes = ", ".join(f"{k} {v:.3f}" for k, v in tower.items())
        tower_run = f"{args.tower_steps} steps of {args.tower_batch}, lr {args.tower_lr}"
        return f"""1. vision tower alone, {tower_run} ({minutes["tower"]:.1f} min): 2-D sine-cosine
   position embeddings at start, cross-entropy of linear probes (shape, colour, count,
   position; discarded) on the mean of the features LLaVA reads. A random tower gave
   the decoder nothing to read: captions alone stayed at the caption prior for 300
   steps. Probe accuracy, last 50 steps: {probes}.
2. the whole LLaVA, {args.steps} steps of {args.batch}, lr {args.lr} ({minutes["train"]:.1f} min):
   cross-entropy on the caption and EOS tokens only; last 25 steps {result["ce"]:.3f}.
   Total wall time {minutes["total"]:.1f} min."""
    prior = re.search(r"^1\. .*?(?=^## Held-out figures)", args.prior, re.S | re.M).group(0)
    before = re.search(r"Total wall time ([\d.]+) min\.", prior).group(1)
    prior = re.sub(r"\s*Total wall time [\d.]+ min\.", "", prior).rstrip()
    row = re.search(r"^\|---\|.*\n(\|.*\|)$", args.prior, re.M).group(1)
    done = len(re.findall(r"^\d+\. ", prior, re.M))
    args.prior_row = f"\nStage {done + 1} started from the files of stage {done}: {row}.\n"
    tower = {0: "frozen", 1: "trained too"}.get(args.tower_scale, f"at {args.tower_scale}x")
    weight = "" if args.shape_weight == 1 else f", shape-word tokens weighted {args.shape_weight}"
    run = f"{args.resume_steps} steps of {args.batch}, lr {args.resume_lr}"
    seed = args.seed + args.stage - 1
    return f"""{prior} Wall time {before} min.
{done + 1}. resumed (`--resume`) from those files, loaded in fp32: the vision tower
   {tower}, projector and decoder on the same captions, {run}
   ({minutes["resume"]:.1f} min), seed {seed}{weight}; last 25 steps {result["ce"]:.3f}.
   Total wall time {minutes["total"]:.1f} min."""


def training_md(args, result: dict, params: int, minutes: dict, tower: dict) -> str:
    f, weights = result["figures"], (args.out / "model.safetensors").stat().st_size
    rows = "\n".join(f"| {q} | `{want}` | `{got}` |" for q, want, got in result["samples"])
    table = " | ".join(f"{f[k]:.3f}" for k in KEYS)
    shapes, colours, places = ", ".join(SHAPES), ", ".join(COLOURS), " / ".join(POSITIONS)
    stages = stages_md(args, result, minutes, tower)
    return f"""# The embedded default vision model: training record

Written by `scripts/train_vision_default.py` (rerun it to reproduce); figures of the
fp16 files as committed.

## Layout

transformers' `LlavaForConditionalGeneration`: `config.json`, `model.safetensors` (fp16,
{weights:,} bytes, {params:,} parameters), `preprocessor_config.json` (`CLIPImageProcessor`,
{IMAGE_SIZE}x{IMAGE_SIZE}, bicubic, CLIP mean/std), `processor_config.json` (`LlavaProcessor`),
`tokenizer.json`, `tokenizer_config.json` (with `chat_template`), this file, `SHA256SUMS`.

- vision tower: CLIP, image {IMAGE_SIZE}, patch {PATCH_SIZE}, hidden 128, 3 layers, 8 heads,
  intermediate 512; `vision_feature_layer` -1, `vision_feature_select_strategy` "default"
  (class position dropped): **{IMAGE_TOKENS} image tokens per image**; projector
  Linear(128, 192), GELU, Linear(192, 192).
- decoder: initialised from the committed text target (`../target.safetensors`, hidden
  192, 4 layers) and fine-tuned rather than trained from scratch: it starts with the
  tokenizer's statistics, the steps go to grounding, and it has the text default's
  shape. Vocabulary 513: the text pair's 512 ids plus **`<image>` = id {IMAGE_TOKEN_ID}**,
  an added special token (embedding row: the mean, never read as image features replace
  it; output row: zeros). A prompt holds {IMAGE_TOKENS} consecutive id-{IMAGE_TOKEN_ID} tokens
  per image: the placeholder expanded, as `LlavaProcessor` does.

## Chat format

The frontend renders `tokenizer_config.json`'s `chat_template`; an image content part
is the text `<image>`, parts joined by newlines. One user turn, answered
` a red circle on the left.<|eos|>`:

    <|bos|>User: <image>
    What is in this picture?
    Assistant:

Training renders the same text (image part first 75 % of the time, after the question
otherwise), expands `<image>` into {IMAGE_TOKENS} image tokens, tokenizes prompt and answer apart.

## Data and training

Pillow, drawn at {IMAGE_SIZE * SCALE} px, downsampled (Lanczos) to {IMAGE_SIZE}: shapes {shapes};
colours {colours}; count 1 (half the pictures) {places}, or two or
three smaller ones; random low-saturation backgrounds. Captions "a {{colour}} {{shape}}
{{position}}." or "two|three {{colour}} {{shapes}}."; questions: {"; ".join(QUESTIONS)}.
Fresh pictures every step; torch {torch.__version__}, CPU, {args.threads} thread(s), seed
{args.seed}; AdamW (0.9/0.95, weight decay 0.05), warmup 5 %, cosine to 5 %, clipping 1.

{stages}

## Held-out figures

{f["images"]} pictures from seed {args.seed + 1000} (never trained on), the questions in turn,
greedy `generate` (24 new tokens at most) on this directory loaded with
`from_pretrained`, pixels from `CLIPImageProcessor`. An answer names the shape (colour)
when it holds that word and no other shape (colour) word.

| shape | colour | both | count | position (one shape) | exact caption |
|---|---|---|---|---|---|
| {table} |
{args.prior_row if args.resume else ""}
The issue's goal (shape and colour named at least 90 % of the time) is
{"met" if f["both"] >= 0.9 else "NOT met"}: {f["both"]:.3f}.

| question | caption | answer |
|---|---|---|
{rows}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, kind, default in (
        ("--threads", int, 1), ("--tower-steps", int, 4000), ("--tower-batch", int, 32),
        ("--tower-lr", float, 2e-3), ("--steps", int, 1000), ("--batch", int, 16),
        ("--lr", float, 1e-3), ("--seed", int, 20240607), ("--eval-images", int, 300),
        ("--out", Path, OUT_DIR), ("--resume", Path, None), ("--resume-steps", int, 1000),
        ("--resume-lr", float, 5e-4), ("--tower-scale", float, 0.0), ("--shape-weight", float, 1.0),
    ):  # fmt: skip
        parser.add_argument(flag, type=kind, default=default)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    wall = time.time()
    tok = vision_tokenizer()
    if args.resume is not None:
        return resume(args, tok, wall)
    model = build_model(args.seed)
    print(f"model: {param_count(model):,} parameters, {IMAGE_TOKENS} image tokens per image")
    t0 = time.time()
    tower = pretrain_vision(
        model, steps=args.tower_steps, size=args.tower_batch, lr=args.tower_lr, seed=args.seed
    )
    t1 = time.time()
    losses = train(model, tok, steps=args.steps, size=args.batch, lr=args.lr, seed=args.seed + 1)
    minutes = {"tower": (t1 - t0) / 60, "train": (time.time() - t1) / 60}
    return finish(args, model, tok, losses, minutes, wall, tower)


def resume(args, tok, wall: float) -> int:
    """Stage 3: the committed model (fp32) on captions, the vision tower frozen."""
    from transformers import LlavaForConditionalGeneration

    args.prior = (args.resume / "TRAINING.md").read_text(encoding="utf-8")
    args.stage = len(re.findall(r"^\d+\. ", args.prior, re.M)) + 1  # 3 after stages 1 and 2
    model = LlavaForConditionalGeneration.from_pretrained(str(args.resume), dtype=torch.float32)
    t0 = time.time()
    losses = train(model, tok, steps=args.resume_steps, size=args.batch, lr=args.resume_lr,
                   seed=args.seed + args.stage - 1, tower_scale=args.tower_scale,
                   shape_weight=args.shape_weight)  # fmt: skip
    return finish(args, model, tok, losses, {"resume": (time.time() - t0) / 60}, wall, {})


def param_count(model) -> int:
    return sum(p.numel() for p in model.state_dict().values())


def finish(args, model, tok, losses: list[float], minutes: dict, wall: float, tower) -> int:
    """Write the directory, evaluate it as loaded back, write TRAINING.md and SHA256SUMS."""
    params = param_count(model)
    write_dir(model, tok, out := args.out)
    result = evaluate_dir(out, args.eval_images, args.seed + 1000)
    result["ce"] = sum(losses[-25:]) / len(losses[-25:])
    f = result["figures"]
    print(
        f"\nheld-out accuracy ({f['images']} pictures)",
        *(f"{k:<9}{f[k]:.3f}" for k in KEYS),
        sep="\n",
    )
    for q, want, got in result["samples"]:
        print(f"  {q!r}: want {want!r} got {got!r}")
    minutes["total"] = (time.time() - wall) / 60
    print(json.dumps({"result": result, "minutes": minutes, "params": params}), flush=True)
    (out / "TRAINING.md").write_text(training_md(args, result, params, minutes, tower), "utf-8")
    write_sums(out)
    total = sum(p.stat().st_size for p in out.iterdir())
    assert total <= MAX_BYTES, total
    summary = {k: round(v, 4) for k, v in f.items() if k != "images"}
    summary.update(
        images=f["images"], params=params, dir_bytes=total, caption_ce=round(result["ce"], 4)
    )
    summary.update(weights_bytes=(out / "model.safetensors").stat().st_size)
    summary.update({f"{k}_min": round(v, 2) for k, v in minutes.items()})
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
