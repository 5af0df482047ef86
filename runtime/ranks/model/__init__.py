"""The tensor-parallel decoder that runs on each rank.

``load_model(dir, TPGroup...)`` builds a Llama / Qwen2 / Qwen3 model holding this
rank's shard; ``model.allocate_kv_cache(num_pages, page_size)`` binds its paged KV
cache; ``model(input_ids, positions, attn_metadata, logits_indices)`` runs one
packed step and returns full-vocabulary logits for the requested tokens.
``default_model_dir()`` is the embedded default checkpoint (a small Llama trained on
``pydoc_data.topics``) and ``default_draft_dir()`` its speculative-decoding draft,
both copied out of the package on first use.

The names below are imported from their modules when first used, so a process
that only reads a model directory (the frontend, the coordinator: ``config``,
``checkpoint``, ``default``) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.ranks.model.attention import AttentionMetadata, compute_slot_mapping
    from runtime.ranks.model.config import ModelConfig, RopeScaling
    from runtime.ranks.model.default import (
        DEFAULT_CONFIG,
        DEFAULT_DRAFT_NAME,
        DEFAULT_MODEL_NAME,
        DRAFT_CONFIG,
        create_default_draft,
        create_default_model,
        default_draft_dir,
        default_model_dir,
    )
    from runtime.ranks.model.errors import LoadError, ModelConfigError
    from runtime.ranks.model.kv_cache import PagedKVCache
    from runtime.ranks.model.llama import LlamaForCausalLM
    from runtime.ranks.model.loader import load_model, load_tokenizer
    from runtime.ranks.model.parallel import TPGroup

# Each exported name and the module (in this package) that defines it.
_HOMES = {
    "AttentionMetadata": "attention",
    "compute_slot_mapping": "attention",
    "ModelConfig": "config",
    "RopeScaling": "config",
    "DEFAULT_CONFIG": "default",
    "DEFAULT_DRAFT_NAME": "default",
    "DEFAULT_MODEL_NAME": "default",
    "DRAFT_CONFIG": "default",
    "create_default_draft": "default",
    "create_default_model": "default",
    "default_draft_dir": "default",
    "default_model_dir": "default",
    "LoadError": "errors",
    "ModelConfigError": "errors",
    "PagedKVCache": "kv_cache",
    "LlamaForCausalLM": "llama",
    "load_model": "loader",
    "load_tokenizer": "loader",
    "TPGroup": "parallel",
}

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_DRAFT_NAME",
    "DEFAULT_MODEL_NAME",
    "DRAFT_CONFIG",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "LoadError",
    "ModelConfig",
    "ModelConfigError",
    "PagedKVCache",
    "RopeScaling",
    "TPGroup",
    "compute_slot_mapping",
    "create_default_draft",
    "create_default_model",
    "default_draft_dir",
    "default_model_dir",
    "load_model",
    "load_tokenizer",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
