"""The committed default model and its draft: files, loading, agreement with
transformers, the draft's cost, and that the target was trained (not random)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.ranks.model import default
from runtime.ranks.model.attention import AttentionMetadata
from runtime.ranks.model.config import ModelConfig
from runtime.ranks.model.default import (
    DEFAULT_CONFIG,
    DEFAULT_DRAFT_NAME,
    DEFAULT_MODEL_NAME,
    DRAFT_CONFIG,
    WEIGHTS_DIR,
    build_tokenizer,
    create_default_draft,
    create_default_model,
    default_draft_dir,
    default_model_dir,
    matmul_flops_per_token,
)
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.model.loader import load_model, load_tokenizer


def _sums() -> dict[str, str]:
    out = {}
    for line in (WEIGHTS_DIR / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        digest, name = line.split(maxsplit=1)
        out[name] = digest
    return out


def _prefill_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    page = 16
    pages = -(-len(ids) // page)
    model.allocate_kv_cache(num_pages=pages, page_size=page)
    meta, positions = AttentionMetadata.build(
        query_lens=[len(ids)],
        context_lens=[len(ids)],
        page_tables=[list(range(pages))],
        page_size=page,
    )
    return model(torch.tensor(ids), positions, meta, torch.arange(len(ids)))  # (n, vocab)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("flare-home")


@pytest.fixture(scope="module")
def target_dir(home: Path) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setenv("FLARE_HOME", str(home))
    try:
        return default_model_dir()
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def draft_dir(home: Path) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setenv("FLARE_HOME", str(home))
    try:
        return default_draft_dir()
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def target(target_dir: Path) -> LlamaForCausalLM:
    return load_model(target_dir)


def test_committed_files_match_sha256sums() -> None:
    sums = _sums()
    present = {p.name for p in WEIGHTS_DIR.iterdir() if p.is_file()} - {"SHA256SUMS"}
    assert set(sums) == present
    for name, digest in sums.items():
        assert hashlib.sha256((WEIGHTS_DIR / name).read_bytes()).hexdigest() == digest, name
    assert {"target.safetensors", "target.json", "draft.safetensors", "draft.json"} <= present
    assert "tokenizer.json" in present and "TRAINING.md" in present
    total = sum(p.stat().st_size for p in WEIGHTS_DIR.iterdir() if p.is_file())
    assert total <= 5 * 1024 * 1024


def test_configs_describe_the_committed_checkpoints() -> None:
    assert ModelConfig.from_json(WEIGHTS_DIR / "target.json") == DEFAULT_CONFIG
    assert ModelConfig.from_json(WEIGHTS_DIR / "draft.json") == DRAFT_CONFIG


def test_default_dirs(home: Path, target_dir: Path, draft_dir: Path) -> None:
    assert target_dir == home / "models" / DEFAULT_MODEL_NAME
    assert draft_dir == home / "models" / DEFAULT_DRAFT_NAME
    assert sorted(p.name for p in target_dir.parent.iterdir()) == sorted(
        [DEFAULT_MODEL_NAME, DEFAULT_DRAFT_NAME]
    )  # no temporary directory left behind
    for d in (target_dir, draft_dir):
        assert sorted(p.name for p in d.iterdir()) == [
            "SHA256SUMS",  # the committed sums the copy was made from
            "config.json",
            "model.safetensors",
            "tokenizer.json",
        ]
    assert (target_dir / "tokenizer.json").read_bytes() == (
        draft_dir / "tokenizer.json"
    ).read_bytes()
    assert ModelConfig.from_dir(target_dir) == DEFAULT_CONFIG
    assert ModelConfig.from_dir(draft_dir) == DRAFT_CONFIG


def test_damaged_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.ranks.model.default as default

    fake = tmp_path / "weights"
    fake.mkdir()
    for p in WEIGHTS_DIR.iterdir():
        if p.is_file():  # vision/ has its own SHA256SUMS
            (fake / p.name).write_bytes(p.read_bytes())
    data = bytearray((fake / "draft.safetensors").read_bytes())
    data[-1] ^= 1
    (fake / "draft.safetensors").write_bytes(bytes(data))
    monkeypatch.setattr(default, "WEIGHTS_DIR", fake)
    create_default_model(tmp_path / "ok")  # the target's files are intact
    with pytest.raises(RuntimeError, match=r"draft\.safetensors.*SHA-256"):
        create_default_draft(tmp_path / "bad")


def test_target_matches_transformers(target_dir: Path, target: LlamaForCausalLM) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(target_dir)
    text = "The for statement is used to iterate over the elements of a sequence."
    ids = tokenizer.encode(text).ids[:24]
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    ours = _prefill_logits(target, ids)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)


def test_draft_shares_the_tokenizer_and_is_cheap(draft_dir: Path) -> None:
    draft = load_model(draft_dir)
    assert draft.config.vocab_size == DEFAULT_CONFIG.vocab_size
    assert draft.config.eos_token_ids == DEFAULT_CONFIG.eos_token_ids
    assert draft.config.bos_token_id == DEFAULT_CONFIG.bos_token_id
    assert load_tokenizer(draft_dir).to_str() == build_tokenizer().to_str()
    ratio = matmul_flops_per_token(DRAFT_CONFIG) / matmul_flops_per_token(DEFAULT_CONFIG)
    assert ratio <= 0.25
    for config in (DEFAULT_CONFIG, DRAFT_CONFIG):
        config.check_tensor_parallel(2)


def _held_out_paragraphs() -> list[str]:
    """Paragraphs of the topics the training script holds out (the last ones)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    held = keys[len(keys) - max(1, round(len(keys) * 0.07)) :]
    paragraphs = []
    for key in held:
        paragraphs += [p for p in topics[key].split("\n\n") if len(p) > 200][:2]
    return paragraphs[:6]


def test_target_is_trained(target_dir: Path, target: LlamaForCausalLM) -> None:
    tokenizer = load_tokenizer(target_dir)
    total, count = 0.0, 0
    for paragraph in _held_out_paragraphs():
        ids = tokenizer.encode(paragraph).ids[:128]
        with torch.no_grad():
            logits = _prefill_logits(target, ids)
        total += F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    assert count > 200
    loss = total / count
    assert loss < 3.5, f"held-out loss {loss:.3f} (uniform: {math.log(512):.3f})"

    ids = tokenizer.encode("The ").ids
    with torch.no_grad():
        for _ in range(30):
            ids.append(int(_prefill_logits(target, ids)[-1].argmax()))
    text = tokenizer.decode(ids)
    letters = sum(c.isalpha() or c == " " for c in text)
    assert letters >= 0.8 * len(text), text
    assert len(set(text.split())) >= 4, text


def test_a_stale_copy_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy made from other committed weights (another SHA256SUMS) is replaced
    on first use, so retrained weights never hide behind an old cache."""
    monkeypatch.setenv("FLARE_HOME", str(tmp_path))
    first = default.default_model_dir()
    (first / "SHA256SUMS").write_text("stale\n")
    (first / "model.safetensors").write_bytes(b"old weights")
    again = default.default_model_dir()
    assert again == first
    sums = (default.WEIGHTS_DIR / "SHA256SUMS").read_bytes()
    assert (again / "SHA256SUMS").read_bytes() == sums
    assert (again / "model.safetensors").read_bytes() == (
        default.WEIGHTS_DIR / "target.safetensors"
    ).read_bytes()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]  # no leftovers
