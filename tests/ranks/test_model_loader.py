"""Loader refusals, multi-file checkpoints, and the embedded default model."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.ranks.model.attention import AttentionMetadata
from runtime.ranks.model.config import ModelConfig
from runtime.ranks.model.default import (
    DEFAULT_CONFIG,
    DEFAULT_MODEL_NAME,
    create_default_model,
    default_model_dir,
    write_random_checkpoint,
)
from runtime.ranks.model.errors import LoadError
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.model.loader import load_model, load_tokenizer

TINY = ModelConfig(
    architecture="Qwen2ForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attention_bias=True,
    tie_word_embeddings=True,
)


def _prefill_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    model.allocate_kv_cache(num_pages=8, page_size=8)
    meta, positions = AttentionMetadata.build(
        query_lens=[len(ids)],
        context_lens=[len(ids)],
        page_tables=[list(range(-(-len(ids) // 8)))],
        page_size=8,
    )
    return model(torch.tensor(ids), positions, meta, torch.arange(len(ids)))  # (n, vocab)


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return write_random_checkpoint(tmp_path / "tiny", TINY, seed=3)


def _edit(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


# -- LoadError ---------------------------------------------------------------------------------


def test_wrong_shape_names_the_tensor_and_shapes(tiny_dir: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit(tiny_dir, lambda t: t.update({name: torch.zeros(8, 32)}))
    with pytest.raises(
        LoadError, match=rf"'{re.escape(name)}'.*shape \[8, 32\], expected \[16, 32\]"
    ):
        load_model(tiny_dir)


def test_wrong_shape_of_a_bias_is_named(tiny_dir: Path) -> None:
    name = "model.layers.0.self_attn.v_proj.bias"
    _edit(tiny_dir, lambda t: t.update({name: torch.zeros(17)}))
    with pytest.raises(LoadError, match=rf"'{re.escape(name)}'.*\[17\], expected \[16\]"):
        load_model(tiny_dir)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.bias",
        "model.norm.weight",
        "model.embed_tokens.weight",
    ],
)
def test_missing_tensor_is_named(tiny_dir: Path, name: str) -> None:
    _edit(tiny_dir, lambda t: t.pop(name))
    with pytest.raises(LoadError, match=rf"'{re.escape(name)}' is missing"):
        load_model(tiny_dir)


def test_unexpected_tensor_is_named(tiny_dir: Path) -> None:
    name = "model.layers.0.self_attn.q_norm.weight"  # Qwen3 only
    _edit(tiny_dir, lambda t: t.update({name: torch.ones(8)}))
    with pytest.raises(LoadError, match=rf"unexpected tensor '{re.escape(name)}'"):
        load_model(tiny_dir)


def test_untied_checkpoint_without_lm_head_is_refused(tiny_dir: Path) -> None:
    raw = json.loads((tiny_dir / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (tiny_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(LoadError, match=r"'lm_head\.weight' is missing"):
        load_model(tiny_dir)


def test_no_weights_and_no_tokenizer(tmp_path: Path, tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(LoadError, match=r"no \*\.safetensors"):
        load_model(tiny_dir)
    with pytest.raises(LoadError, match=r"tokenizer\.json not found"):
        load_tokenizer(tiny_dir)


# -- layouts -------------------------------------------------------------------------------------


def test_several_files_with_an_index_load_like_one(tmp_path: Path, tiny_dir: Path) -> None:
    one = _prefill_logits(load_model(tiny_dir), [1, 5, 9, 13, 2])
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    (split_dir / "config.json").write_text((tiny_dir / "config.json").read_text())
    tensors = load_file(tiny_dir / "model.safetensors")
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, split_dir / file)
        weight_map.update(dict.fromkeys(part, file))
    (split_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (split_dir / "stray.safetensors").write_bytes(b"not named by the index")
    model = load_model(split_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert torch.equal(_prefill_logits(model, [1, 5, 9, 13, 2]), one)


def test_bfloat16_load(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.allocate_kv_cache(4, 8).dtype == torch.bfloat16
    logits = _prefill_logits(model, [3, 4, 5])
    ref = _prefill_logits(load_model(tiny_dir), [3, 4, 5])
    torch.testing.assert_close(logits.float(), ref, atol=0.05, rtol=0.05)


# -- the embedded default -----------------------------------------------------------------------


def _digest(model_dir: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(model_dir.iterdir())}


@pytest.mark.process
def test_default_model_is_deterministic(tmp_path: Path) -> None:
    first = _digest(create_default_model(tmp_path / "a"))
    assert set(first) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert _digest(create_default_model(tmp_path / "b")) == first
    # Another process (other hash seeds, fresh Rust hash maps) writes the same bytes.
    code = (
        "import sys; from runtime.ranks.model.default import create_default_model; "
        "create_default_model(sys.argv[1])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True, env=env)
    assert _digest(tmp_path / "c") == first


def test_default_model_dir_is_created_once_and_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLARE_HOME", str(tmp_path / "home"))
    path = default_model_dir()
    assert path == tmp_path / "home" / "models" / DEFAULT_MODEL_NAME
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [DEFAULT_MODEL_NAME]  # no temp left

    model = load_model(path)
    assert model.config == DEFAULT_CONFIG
    tokenizer = load_tokenizer(path)
    assert tokenizer.get_vocab_size() == DEFAULT_CONFIG.vocab_size
    text = "Hello, world! The ranks execute. ünïcode ✓"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.token_to_id("<|eos|>") in DEFAULT_CONFIG.eos_token_ids
    assert tokenizer.token_to_id("<|bos|>") == DEFAULT_CONFIG.bos_token_id

    ours = _prefill_logits(model, ids[:16])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids[:16]])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
