"""Train the embedded default model and its draft; write them into the package.

    python scripts/train_default.py [--threads 1] [--target-steps N] [--draft-steps N]

Corpus: the standard library's ``pydoc_data.topics`` (the values in sorted key
order, joined by blank lines). The last topics by sorted key are held out: never
trained on, used for the figures. Steps:

1. learn the 512-token byte-level BPE from the training text (the specials
   ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` are the last three ids);
2. train the target (``DEFAULT_CONFIG``) with cross-entropy;
3. train the draft (``DRAFT_CONFIG``, at most a quarter of the target's matmul FLOPs
   per token) by distillation: KL(target || draft) plus a little cross-entropy;
4. write ``target.safetensors``/``target.json``, ``draft.safetensors``/``draft.json``
   (fp16, Hugging Face names), ``tokenizer.json``, ``TRAINING.md`` and ``SHA256SUMS``
   into ``runtime/ranks/model/weights/``.

The figures are measured on the fp16 weights as written. Plain torch on the CPU,
transformers' ``LlamaForCausalLM`` as the training module (same tensor names).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.ranks.model.config import ModelConfig  # noqa: E402
from runtime.ranks.model.default import (  # noqa: E402
    DEFAULT_CONFIG,
    DRAFT_CONFIG,
    WEIGHTS_DIR,
    learn_tokenizer,
    matmul_flops_per_token,
)

HELD_OUT_FRACTION = 0.07  # of the topics, by sorted key: the last ones
MAX_BYTES = 5 * 1024 * 1024


def corpus() -> tuple[str, str, list[str], list[str]]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    n_train = len(keys) - max(1, round(len(keys) * HELD_OUT_FRACTION))
    train_keys, held_keys = keys[:n_train], keys[n_train:]
    train = "\n\n".join(topics[k] for k in train_keys)
    held = "\n\n".join(topics[k] for k in held_keys)
    return train, held, train_keys, held_keys


def hf_model(config: ModelConfig, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(**{k: v for k, v in config.to_hf().items() if k != "architectures"})
    hf_cfg.initializer_range = 0.02
    model = LlamaForCausalLM(hf_cfg)
    return model.float()


def windows(tokens: torch.Tensor, seq: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
    return torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer(model, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def train(
    name: str,
    model,
    tokens: torch.Tensor,
    *,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    seed: int,
    teacher=None,
    kl_weight: float = 0.8,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = optimizer(model, lr)
    warmup = max(1, steps // 20)
    model.train()
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        chunk = windows(tokens, seq, batch, gen)
        inputs, labels = chunk[:, :-1], chunk[:, 1:]
        logits = model(input_ids=inputs).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if teacher is None:
            loss, kl = ce, None
        else:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=inputs).logits, dim=-1)
            logq = F.log_softmax(logits, dim=-1)
            kl = (t_logp.exp() * (t_logp - logq)).sum(-1).mean()
            loss = kl_weight * kl + (1 - kl_weight) * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            elapsed = time.time() - start
            extra = "" if kl is None else f" kl {kl.item():.3f}"
            print(
                f"[{name}] step {step + 1}/{steps} ce {ce.item():.3f}{extra} "
                f"lr {opt.param_groups[0]['lr']:.2e} {elapsed:.0f}s",
                flush=True,
            )
    model.eval()


def fp16_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}


@torch.no_grad()
def evaluate(target, draft, tokens: torch.Tensor, seq: int) -> dict[str, float]:
    """Held-out figures over consecutive windows of ``seq`` tokens."""
    n = (len(tokens) - 1) // seq
    ce_t = ce_d = agree = acc1 = acc07 = 0.0
    count = 0
    for i in range(n):
        chunk = tokens[i * seq : i * seq + seq + 1].unsqueeze(0)
        inputs, labels = chunk[:, :-1], chunk[:, 1:].reshape(-1)
        lt = target(input_ids=inputs).logits[0].float()
        ld = draft(input_ids=inputs).logits[0].float()
        ce_t += F.cross_entropy(lt, labels, reduction="sum").item()
        ce_d += F.cross_entropy(ld, labels, reduction="sum").item()
        agree += (lt.argmax(-1) == ld.argmax(-1)).float().sum().item()
        for temp, slot in ((1.0, 1), (0.7, 2)):
            p = F.softmax(lt / temp, dim=-1)
            q = F.softmax(ld / temp, dim=-1)
            value = torch.minimum(p, q).sum(-1).sum().item()
            if slot == 1:
                acc1 += value
            else:
                acc07 += value
        count += labels.numel()
    return {
        "tokens": count,
        "target_ce": ce_t / count,
        "draft_ce": ce_d / count,
        "target_ppl": math.exp(ce_t / count),
        "draft_ppl": math.exp(ce_d / count),
        "greedy_agreement": agree / count,
        "acceptance_t1": acc1 / count,
        "acceptance_t07": acc07 / count,
    }


@torch.no_grad()
def greedy_text(model, tokenizer, prompt: str, n: int) -> str:
    ids = tokenizer.encode(prompt).ids
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return tokenizer.decode(ids)


def params(model) -> int:
    return sum(p.numel() for p in model.state_dict().values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target-steps", type=int, default=400)
    parser.add_argument("--draft-steps", type=int, default=450)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--target-lr", type=float, default=3e-3)
    parser.add_argument("--draft-lr", type=float, default=4e-3)
    parser.add_argument("--seed", type=int, default=20240607)
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    wall = time.time()

    flops_t = matmul_flops_per_token(DEFAULT_CONFIG)
    flops_d = matmul_flops_per_token(DRAFT_CONFIG)
    ratio = flops_d / flops_t
    print(f"matmul FLOPs/token: target {flops_t:,} draft {flops_d:,} ratio {ratio:.4f}")
    assert ratio <= 0.25, ratio

    train_text, held_text, train_keys, held_keys = corpus()
    print(
        f"corpus: {len(train_keys)} topics / {len(train_text):,} chars for training, "
        f"{len(held_keys)} held out ({', '.join(held_keys)}) / {len(held_text):,} chars"
    )
    t0 = time.time()
    tokenizer = learn_tokenizer(train_text)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens, learned in {time.time() - t0:.0f}s")
    assert tokenizer.get_vocab_size() == DEFAULT_CONFIG.vocab_size
    assert tokenizer.token_to_id("<|bos|>") == DEFAULT_CONFIG.bos_token_id
    train_tokens = torch.tensor(tokenizer.encode(train_text).ids, dtype=torch.long)
    held_tokens = torch.tensor(tokenizer.encode(held_text).ids, dtype=torch.long)
    print(f"tokens: {len(train_tokens):,} training, {len(held_tokens):,} held out")

    target = hf_model(DEFAULT_CONFIG, args.seed)
    t0 = time.time()
    train(
        "target",
        target,
        train_tokens,
        steps=args.target_steps,
        batch=args.batch,
        seq=args.seq,
        lr=args.target_lr,
        seed=args.seed + 1,
    )
    target_s = time.time() - t0
    target_state = fp16_state(target)
    target.load_state_dict({k: v.float() for k, v in target_state.items()})  # as shipped
    with torch.no_grad():
        n = min(len(held_tokens) - 1, 4 * args.seq)
        logits = target(input_ids=held_tokens[:n].unsqueeze(0)).logits[0]
        held_ce = F.cross_entropy(logits, held_tokens[1 : n + 1]).item()
    print(f"[target] held-out ce on the first {n} tokens: {held_ce:.3f}", flush=True)
    for p in target.parameters():
        p.requires_grad_(False)

    draft = hf_model(DRAFT_CONFIG, args.seed + 2)
    t0 = time.time()
    train(
        "draft",
        draft,
        train_tokens,
        steps=args.draft_steps,
        batch=args.batch,
        seq=args.seq,
        lr=args.draft_lr,
        seed=args.seed + 3,
        teacher=target,
    )
    draft_s = time.time() - t0
    draft_state = fp16_state(draft)
    draft.load_state_dict({k: v.float() for k, v in draft_state.items()})

    figures = evaluate(target, draft, held_tokens, args.seq)
    sample = greedy_text(target, tokenizer, "The ", 40)
    sample_draft = greedy_text(draft, tokenizer, "The ", 40)
    for key, value in figures.items():
        print(f"held-out {key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"greedy target: {sample!r}")
    print(f"greedy draft:  {sample_draft!r}")

    from safetensors.torch import save_file

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file():  # keep vision/ (scripts/train_vision_default.py)
            stale.unlink()
    for stem, config, state in (
        ("target", DEFAULT_CONFIG, target_state),
        ("draft", DRAFT_CONFIG, draft_state),
    ):
        save_file(state, str(out / f"{stem}.safetensors"), metadata={"format": "pt"})
        text = json.dumps(config.to_hf(), indent=2, sort_keys=True) + "\n"
        (out / f"{stem}.json").write_text(text, encoding="utf-8")
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    wall_s = time.time() - wall

    n_t, n_d = params(target), params(draft)
    b_t = (out / "target.safetensors").stat().st_size
    b_d = (out / "draft.safetensors").stat().st_size
    cfg_line = "hidden {h}, {l} layers, intermediate {i}, {a} heads / {k} KV heads, head_dim {d}"

    def describe(c: ModelConfig) -> str:
        return cfg_line.format(
            h=c.hidden_size,
            l=c.num_hidden_layers,
            i=c.intermediate_size,
            a=c.num_attention_heads,
            k=c.num_key_value_heads,
            d=c.head_dim,
        )

    f = figures
    report = f"""# The embedded default model: training record

Written by `scripts/train_default.py` (rerun it to reproduce; figures below are
on the fp16 weights as committed).

## Corpus

`pydoc_data.topics` from Python {platform.python_version()} (the values in sorted key
order, joined by blank lines). Training: the first {len(train_keys)} topics,
{len(train_text):,} characters, {len(train_tokens):,} tokens. Held out (never trained
on): the last {len(held_keys)} topics by sorted key ({", ".join(held_keys)}),
{len(held_text):,} characters, {len(held_tokens):,} tokens.

Tokenizer: byte-level BPE, 512 ids (256 bytes, learned merges, then `<|bos|>`,
`<|eos|>`, `<|pad|>` as ids 509-511), learned from the training text.

## Models

| | target (`target.*`) | draft (`draft.*`) |
|---|---|---|
| shape | {describe(DEFAULT_CONFIG)} | {describe(DRAFT_CONFIG)} |
| parameters | {n_t:,} | {n_d:,} |
| fp16 safetensors bytes | {b_t:,} | {b_d:,} |
| matmul FLOPs per token | {flops_t:,} | {flops_d:,} (ratio {ratio:.3f}) |

Untied embeddings, RoPE theta 10000, max positions 4096, RMSNorm eps 1e-5.

## Training

torch {torch.__version__}, CPU, {args.threads} thread(s), transformers'
`LlamaForCausalLM`. Random windows of {args.seq} tokens, batch {args.batch}, AdamW
(betas 0.9/0.95, weight decay 0.1 on matrices), warmup 5 % then cosine to 10 % of
the peak, gradient clipping 1.0, seed {args.seed}.

- target: {args.target_steps} steps, peak lr {args.target_lr}, cross-entropy;
  {target_s / 60:.1f} min.
- draft: {args.draft_steps} steps, peak lr {args.draft_lr}, 0.8 x KL(target || draft)
  + 0.2 x cross-entropy (distilled toward the target as committed); {draft_s / 60:.1f} min.
- total wall time {wall_s / 60:.1f} min.

## Held-out figures ({f["tokens"]:,} tokens, windows of {args.seq})

| | cross-entropy (nats/token) | perplexity |
|---|---|---|
| target | {f["target_ce"]:.3f} | {f["target_ppl"]:.2f} |
| draft | {f["draft_ce"]:.3f} | {f["draft_ppl"]:.2f} |
| uniform over 512 | {math.log(512):.3f} | 512 |

Draft against target on the same held-out prefixes:

- greedy agreement (argmax draft == argmax target): {f["greedy_agreement"]:.3f}
- expected speculative acceptance per token, sum_v min(p, q), temperature 1:
  {f["acceptance_t1"]:.3f}
- the same at temperature 0.7: {f["acceptance_t07"]:.3f}

## Greedy samples (prompt `"The "`, 40 tokens)

- target: `{sample!r}`
- draft: `{sample_draft!r}`
"""
    (out / "TRAINING.md").write_text(report, encoding="utf-8")
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "SHA256SUMS")
    sums = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in files)
    (out / "SHA256SUMS").write_text(sums, encoding="utf-8")
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"params: target {n_t:,} ({b_t:,} bytes), draft {n_d:,} ({b_d:,} bytes)")
    print(f"wrote {out}: {total:,} bytes in all; wall time {wall_s / 60:.1f} min")
    assert total <= MAX_BYTES, total
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
