"""The embedded default model: a tiny Llama checkpoint the project writes itself.

``create_default_model(dir)`` writes ``config.json``, ``model.safetensors`` and
``tokenizer.json`` with the same bytes every time: weights from a fixed-seed
generator, a byte-level BPE whose merges are learned in-process from the text
below (greedy, ties broken by the pair itself, so no hash order leaks in). No
download. The weights are random: the model serves, it does not know anything.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from runtime.ranks.model.config import ModelConfig

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_MODEL_NAME",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "create_default_model",
    "default_model_dir",
    "write_random_checkpoint",
]

DEFAULT_MODEL_NAME = "flare-tiny-llama-v1"  # bump when anything below changes
SEED = 20240607
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # the last ids of the vocabulary
_BOS_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)
_EOS_ID = _BOS_ID + 1

DEFAULT_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    eos_token_ids=(_EOS_ID,),
    bos_token_id=_BOS_ID,
)

_CORPUS = """\
The coordinator decides and the ranks execute. Each rank holds a shard of the model
and replays prepared programs: fixed shapes, captured ahead of time, chosen again and
again by the value they are expected to produce per unit of execution time.
A request arrives with a prompt. Its prompt is consumed in chunks, then it decodes one
token at a time, and every token it emits is published to the client that asked for it.
Pages of the key and value cache are allocated by the coordinator and named in frames;
a rank writes the keys and values of new tokens into those pages and reads them back
when the same request attends to its own past.
The quick brown fox jumps over the lazy dog. A small model, written by the program
itself, lets the server start without a download: it knows nothing, but it runs.
Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256, 512 and 1024 appear
in configuration files; so do names like page_size, num_pages, world_size and rank.
def forward(self, input_ids, positions, metadata): return self.model(input_ids)
Hello, world! How are you today? I am fine, thank you. What time is it? It is late.
Once upon a time there was a tensor that wanted to be parallel. It split itself into
columns and rows, gathered what it needed, reduced what it had to, and was content.
"""


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


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE: 256 byte tokens (id = byte), learned merges, then specials."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(_CORPUS))
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


# -- weights ------------------------------------------------------------------------------


def _weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face named tensors, drawn in a fixed order from one CPU generator."""
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
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    config_text = json.dumps(config.to_hf(), indent=2, sort_keys=True) + "\n"
    (model_dir / "config.json").write_text(config_text, encoding="utf-8")
    save_file(
        _weights(config, seed), str(model_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    return model_dir


def create_default_model(model_dir: str | Path) -> Path:
    """Write the default checkpoint into ``model_dir`` (created if needed)."""
    model_dir = write_random_checkpoint(model_dir, DEFAULT_CONFIG, seed=SEED)
    build_tokenizer().save(str(model_dir / "tokenizer.json"), pretty=True)
    return model_dir


_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def default_model_dir() -> Path:
    """The default checkpoint under ``$FLARE_HOME`` (or ``~/.cache/flare``), written on
    first use. Creation goes through a temporary directory and a rename, so a
    concurrent first use never sees a half-written model."""
    home = Path(os.environ.get("FLARE_HOME") or Path.home() / ".cache" / "flare")
    target = home / "models" / DEFAULT_MODEL_NAME
    if all((target / name).is_file() for name in _FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        create_default_model(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not all((target / name).is_file() for name in _FILES):
                raise RuntimeError(
                    f"{target} exists but is not a complete model; remove it"
                ) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
