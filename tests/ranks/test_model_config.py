"""ModelConfig from Hugging Face config.json: fields, RoPE formats, refusals, TP splits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runtime.ranks.model.config import ModelConfig, RopeScaling
from runtime.ranks.model.errors import ModelConfigError
from runtime.ranks.model.loader import load_model


def _llama(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 101,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 256,
        "eos_token_id": [2, 7],
        "bos_token_id": 1,
    }
    raw.update(overrides)
    return raw


def test_reads_transformers_configs() -> None:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    llama = ModelConfig.from_hf(
        LlamaConfig(
            vocab_size=101,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ).to_dict()
    )
    assert (llama.architecture, llama.head_dim, llama.attention_bias, llama.qk_norm) == (
        "LlamaForCausalLM",
        16,
        False,
        False,
    )
    assert llama.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert llama.eos_token_ids == (2,)

    qwen2 = ModelConfig.from_hf(
        Qwen2Config(
            vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
        ).to_dict()
    )
    assert qwen2.architecture == "Qwen2ForCausalLM"
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.rope_scaling is None

    qwen3 = ModelConfig.from_hf(
        Qwen3Config(
            vocab_size=96,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=True,
        ).to_dict()
    )
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.tie_word_embeddings
    assert qwen3.q_size == 128 and qwen3.kv_size == 32


def test_reads_legacy_rope_fields_and_eos_list() -> None:
    cfg = ModelConfig.from_hf(_llama(rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("linear", 2.0)
    assert cfg.eos_token_ids == (2, 7) and cfg.bos_token_id == 1
    assert ModelConfig.from_hf(_llama(rope_scaling={"rope_type": "default"})).rope_scaling is None


def test_round_trips_through_hf_dict() -> None:
    cfg = ModelConfig.from_hf(_llama(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize(
    ("rope", "field"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_rejects_unsupported_rope_scaling(rope: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_hf(_llama(**rope))


def test_load_model_rejects_unsupported_rope_scaling(tmp_path: Path) -> None:
    raw = _llama(rope_scaling={"rope_type": "longrope", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=r"rope_scaling type 'longrope'.*supported: none"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"]
)
def test_missing_field_is_named(field: str) -> None:
    raw = _llama()
    del raw[field]
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "architectures"),
        ({"architectures": None, "model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 66}, "head_dim"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"eos_token_id": "eos"}, "eos_token_id"),
    ],
)
def test_rejects_bad_fields(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_hf(_llama(**overrides))


def test_architecture_from_model_type_when_absent() -> None:
    cfg = ModelConfig.from_hf(_llama(architectures=None, model_type="qwen3", head_dim=8))
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.head_dim == 8


def test_tensor_parallel_split_checks() -> None:
    cfg = ModelConfig.from_hf(_llama())  # 4 heads, 2 kv heads, intermediate 128, vocab 101
    for ws in (1, 2, 4):
        cfg.check_tensor_parallel(ws)
    assert cfg.padded_vocab_size(2) == 102 and cfg.padded_vocab_size(4) == 104
    assert cfg.local_kv_heads(2) == 1 and cfg.local_kv_heads(4) == 1  # replicated at 4
    with pytest.raises(ModelConfigError, match="num_attention_heads"):
        cfg.check_tensor_parallel(3)
    ModelConfig.from_hf(_llama(num_attention_heads=8, num_key_value_heads=2)).check_tensor_parallel(
        8
    )
    cfg6 = ModelConfig.from_hf(_llama(num_attention_heads=6, num_key_value_heads=3, hidden_size=96))
    with pytest.raises(ModelConfigError, match="num_key_value_heads"):
        cfg6.check_tensor_parallel(2)  # 3 kv heads do not split over 2
    cfg12 = ModelConfig.from_hf(
        _llama(num_attention_heads=12, num_key_value_heads=3, hidden_size=96, intermediate_size=192)
    )
    cfg12.check_tensor_parallel(6)  # each kv head on two ranks
    with pytest.raises(ModelConfigError, match="cannot be replicated"):
        cfg12.check_tensor_parallel(4)
    with pytest.raises(ModelConfigError, match="intermediate_size"):
        ModelConfig.from_hf(_llama(intermediate_size=130)).check_tensor_parallel(4)
