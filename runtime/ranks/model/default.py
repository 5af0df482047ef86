"""The embedded default model: a tiny trained Llama and its draft, shipped as files.

``scripts/train_default.py`` trains both on the text of the standard library's
``pydoc_data.topics`` and writes them, fp16 safetensors with Hugging Face names,
into ``weights/`` next to this module with a ``SHA256SUMS``; ``weights/TRAINING.md``
holds the figures. ``create_default_model(dir)`` and ``create_default_draft(dir)``
copy a checkpoint out of there (``config.json``, ``model.safetensors``,
``tokenizer.json``) after checking every byte against ``SHA256SUMS``;
``default_model_dir()`` and ``default_draft_dir()`` do so once under
``$FLARE_HOME``. Nothing is trained or downloaded at start-up.

``write_random_checkpoint`` still writes random checkpoints of any shape for
tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from runtime.ranks.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_DRAFT_NAME",
    "DEFAULT_MODEL_NAME",
    "DRAFT_CONFIG",
    "SPECIAL_TOKENS",
    "WEIGHTS_DIR",
    "build_tokenizer",
    "create_default_draft",
    "create_default_model",
    "default_draft_dir",
    "default_model_dir",
    "learn_tokenizer",
    "matmul_flops_per_token",
    "verify_weights",
    "write_random_checkpoint",
]

DEFAULT_MODEL_NAME = "flare-tiny-llama-v2"  # bump when the committed weights change
DEFAULT_DRAFT_NAME = "flare-tiny-llama-v2-draft"
SEED = 20240607
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # the last ids of the vocabulary
_BOS_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)
_EOS_ID = _BOS_ID + 1

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"

DEFAULT_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=VOCAB_SIZE,
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    eos_token_ids=(_EOS_ID,),
    bos_token_id=_BOS_ID,
)

# The draft for speculative decoding: same tokenizer and vocabulary, at most a
# quarter of the target's matmul FLOPs per token (see matmul_flops_per_token).
DRAFT_CONFIG = dataclasses.replace(
    DEFAULT_CONFIG, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4,
)  # fmt: skip


def matmul_flops_per_token(config: ModelConfig) -> int:
    """2 x the parameters of every matmul one token goes through (q, k, v, o, the MLP
    and lm_head); the embedding lookup and the attention over the context excluded."""
    h = config.hidden_size
    attn = h * config.q_size + 2 * h * config.kv_size + config.q_size * h
    mlp = 3 * h * config.intermediate_size
    return 2 * (config.num_hidden_layers * (attn + mlp) + config.vocab_size * h)


# -- tokenizer ---------------------------------------------------------------------------


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255 (ByteLevel's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _learn_merges(words: Counter[str], num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE: merge the most frequent adjacent pair (ties: smallest pair)."""
    split = {word: list(word) for word in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            symbols = split[word]
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        for word, symbols in split.items():
            i, out = 0, []
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            split[word] = out
    return merges


def learn_tokenizer(text: str) -> Tokenizer:
    """Byte-level BPE learned from ``text``: 256 byte tokens (id = byte), learned
    merges, then the specials as the last ids. Same text, same bytes."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(text))
    alphabet = _bytes_to_unicode()
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges = _learn_merges(words, VOCAB_SIZE - len(SPECIAL_TOKENS) - len(alphabet))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for i, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = _BOS_ID + i  # fixed ids even if fewer merges were learned
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tokenizer


def build_tokenizer() -> Tokenizer:
    """The default models' tokenizer (the committed ``weights/tokenizer.json``)."""
    verify_weights(("tokenizer.json",))
    return Tokenizer.from_file(str(WEIGHTS_DIR / "tokenizer.json"))


# -- weights ------------------------------------------------------------------------------


def _weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face named tensors, drawn in a fixed order from one CPU generator."""
    import torch  # here, not at the top: the first-use copy needs no torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    h, inter = config.hidden_size, config.intermediate_size
    out_std = 0.02 / (2 * config.num_hidden_layers) ** 0.5
    tensors = {"model.embed_tokens.weight": normal(config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "self_attn.q_proj.weight"] = normal(config.q_size, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(config.kv_size, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(config.kv_size, h)
        if config.attention_bias:
            tensors[p + "self_attn.q_proj.bias"] = normal(config.q_size)
            tensors[p + "self_attn.k_proj.bias"] = normal(config.kv_size)
            tensors[p + "self_attn.v_proj.bias"] = normal(config.kv_size)
        if config.qk_norm:
            tensors[p + "self_attn.q_norm.weight"] = torch.ones(config.head_dim)
            tensors[p + "self_attn.k_norm.weight"] = torch.ones(config.head_dim)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, config.q_size, std=out_std)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, inter, std=out_std)
    tensors["model.norm.weight"] = torch.ones(h)
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(config.vocab_size, h)
    return tensors


def write_random_checkpoint(model_dir: str | Path, config: ModelConfig, *, seed: int) -> Path:
    """Write ``config.json`` and a random ``model.safetensors`` (Hugging Face names)
    for any supported config: the default model, test and benchmark checkpoints."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    config_text = json.dumps(config.to_hf(), indent=2, sort_keys=True) + "\n"
    (model_dir / "config.json").write_text(config_text, encoding="utf-8")
    save_file(
        _weights(config, seed), str(model_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    return model_dir


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify_weights(names: tuple[str, ...] | None = None) -> dict[str, str]:
    """Check the committed files (``names``, or all) against ``weights/SHA256SUMS``;
    return the expected digests. Raises naming the first file that is missing or
    does not match."""
    sums_path = WEIGHTS_DIR / "SHA256SUMS"
    if not sums_path.is_file():
        raise RuntimeError(f"{sums_path} is missing: the default model's files are not installed")
    expected: dict[str, str] = {}
    for line in sums_path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            expected[name.lstrip("*")] = digest
    for name in expected if names is None else names:
        path = WEIGHTS_DIR / name
        if name not in expected:
            raise RuntimeError(f"{path}: not listed in {sums_path}")
        if not path.is_file():
            raise RuntimeError(f"{path}: missing (listed in {sums_path})")
        actual = _sha256(path)
        if actual != expected[name]:
            raise RuntimeError(
                f"{path}: SHA-256 {actual} does not match {expected[name]} in {sums_path}; "
                "the default model's files are damaged (reinstall, or rerun "
                "scripts/train_default.py)"
            )
    return expected


def _copy_checkpoint(model_dir: str | Path, stem: str) -> Path:
    files = {
        f"{stem}.json": "config.json",
        f"{stem}.safetensors": "model.safetensors",
        "tokenizer.json": "tokenizer.json",
    }
    verify_weights(tuple(files))
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    for source, dest in files.items():
        shutil.copyfile(WEIGHTS_DIR / source, model_dir / dest)
    return model_dir


def create_default_model(model_dir: str | Path) -> Path:
    """Copy the committed default (target) checkpoint into ``model_dir``."""
    return _copy_checkpoint(model_dir, "target")


def create_default_draft(model_dir: str | Path) -> Path:
    """Copy the committed draft checkpoint into ``model_dir``."""
    return _copy_checkpoint(model_dir, "draft")


_FILES = ("config.json", "model.safetensors", "tokenizer.json")


_STAMP = "SHA256SUMS"  # the committed sums the copy was made from


def _first_use_dir(name: str, create) -> Path:
    """``$FLARE_HOME/models/name``, (re)made from the committed files unless it
    holds a complete copy of the current ones: the copy keeps the
    ``SHA256SUMS`` it was made from, so retrained weights replace a stale copy."""
    home = Path(os.environ.get("FLARE_HOME") or Path.home() / ".cache" / "flare")
    target = home / "models" / name
    sums = (WEIGHTS_DIR / _STAMP).read_bytes()

    def current(path: Path) -> bool:
        stamp = path / _STAMP
        complete = all((path / f).is_file() for f in _FILES)
        return complete and stamp.is_file() and stamp.read_bytes() == sums

    if current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    stale = None
    try:
        create(tmp)
        (tmp / _STAMP).write_bytes(sums)
        if target.exists():  # a stale copy (older weights): moved aside, then removed
            stale = Path(tempfile.mkdtemp(prefix=f".{name}-stale-", dir=target.parent))
            with contextlib.suppress(OSError):
                target.rename(stale / "model")
        try:
            tmp.rename(target)
        except OSError:
            if not current(target):
                raise RuntimeError(
                    f"{target} exists but is not a complete model; remove it"
                ) from None
    finally:
        for leftover in (tmp, stale):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """The default checkpoint under ``$FLARE_HOME`` (or ``~/.cache/flare``), copied on
    first use. Creation goes through a temporary directory and a rename, so a
    concurrent first use never sees a half-written model."""
    return _first_use_dir(DEFAULT_MODEL_NAME, create_default_model)


def default_draft_dir() -> Path:
    """The default draft checkpoint, like :func:`default_model_dir`."""
    return _first_use_dir(DEFAULT_DRAFT_NAME, create_default_draft)
