"""The tensor-parallel decoder that runs on each rank.

``load_model(dir, TPGroup...)`` builds a Llama / Qwen2 / Qwen3 model holding this
rank's shard; ``model.allocate_kv_cache(num_pages, page_size)`` binds its paged KV
cache; ``model(input_ids, positions, attn_metadata, logits_indices)`` runs one
packed step and returns full-vocabulary logits for the requested tokens.
``default_model_dir()`` is the embedded default checkpoint (a small Llama trained on
``pydoc_data.topics``) and ``default_draft_dir()`` its speculative-decoding draft,
both copied out of the package on first use.
"""

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
