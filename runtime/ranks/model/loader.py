"""Load a Hugging Face style directory onto one rank.

``config.json`` gives the architecture; every ``*.safetensors`` file (or those a
``model.safetensors.index.json`` names) is opened with ``safe_open`` and each
tensor is read through ``get_slice``, so a rank reads only the rows or columns its
shard keeps. A missing, unexpected, duplicated or mis-shaped tensor raises
LoadError naming it.

A LLaVA directory (``config.json`` with ``vision_config``) loads as
:class:`~runtime.ranks.model.llava.LlavaForConditionalGeneration`, a
LlamaForCausalLM with the vision encoder and projector; its checkpoint names are
mapped by ``param_name`` (the layouts transformers writes, :mod:`.llava`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from runtime.ranks.model.checkpoint import checkpoint_files
from runtime.ranks.model.config import ModelConfig
from runtime.ranks.model.errors import LoadError
from runtime.ranks.model.llama import PACKED_MODULES, LlamaForCausalLM
from runtime.ranks.model.llava import LlavaForConditionalGeneration
from runtime.ranks.model.parallel import TPGroup, default_weight_loader

__all__ = [
    "LoadError",
    "load_model",
    "load_tokenizer",
    "load_weights",
]

# Checkpoint tensors that carry nothing the model needs (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path,
    group: TPGroup | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """Config, construction directly on ``device``, and this rank's weights: a
    LlavaForConditionalGeneration (a LlamaForCausalLM that also encodes images)
    for a LLaVA directory, else a LlamaForCausalLM."""
    config = ModelConfig.from_dir(model_dir)
    cls = LlamaForCausalLM if config.vision is None else LlavaForConditionalGeneration
    with torch.device(device):
        model = cls(config, group, dtype)
    load_weights(model, model_dir)
    return model.eval()


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The directory's ``tokenizer.json`` through the ``tokenizers`` library."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise LoadError(f"tokenizer.json not found in {model_dir}")
    return Tokenizer.from_file(str(path))


def _target(
    name: str, tied: bool, rename: Callable[[str], str | None] | None = None
) -> tuple[str, Hashable] | None:
    """Model parameter and shard id for a checkpoint tensor name; None to skip it."""
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    if rename is not None:
        renamed = rename(name)
        if renamed is None:
            return None
        name = renamed
    if tied and name == "lm_head.weight":
        return None  # the embedding (already read) is the head
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in PACKED_MODULES:
            merged, shard_id = PACKED_MODULES[part]
            return ".".join([*parts[:i], merged, *parts[i + 1 :]]), shard_id
    return name, None


def _source_name(param_name: str, shard_id: Hashable) -> str:
    """The checkpoint tensor name that fills (param_name, shard_id)."""
    if shard_id is None:
        return param_name
    for hf, (merged, sid) in PACKED_MODULES.items():
        if sid == shard_id and f".{merged}." in param_name:
            return param_name.replace(f".{merged}.", f".{hf}.")
    return f"{param_name}[{shard_id}]"


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Fill every parameter of ``model`` with this rank's shard from ``model_dir``."""
    params = dict(model.named_parameters())
    required: set[tuple[str, Hashable]] = set()
    for param_name in params:
        module = model.get_submodule(param_name.rpartition(".")[0])
        for shard_id in getattr(module, "shard_ids", [None]):
            required.add((param_name, shard_id))

    loaded: set[tuple[str, Hashable]] = set()
    tied = model.config.tie_word_embeddings
    rename = model.param_name if isinstance(model, LlavaForConditionalGeneration) else None
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = _target(name, tied, rename)
                if target is None:
                    continue
                param_name, shard_id = target
                if (param_name, shard_id) not in required:
                    raise LoadError(
                        f"unexpected tensor {name!r} in {file.name}: the "
                        f"{model.config.architecture} model has no such parameter"
                    )
                if (param_name, shard_id) in loaded:
                    raise LoadError(f"tensor {name!r} appears twice (again in {file.name})")
                module = model.get_submodule(param_name.rpartition(".")[0])
                loader = getattr(module, "weight_loader", None)
                param = params[param_name]
                src = f.get_slice(name)
                try:
                    if loader is None:
                        default_weight_loader(param, src)
                    else:
                        loader(param, src, shard_id)
                except LoadError as exc:
                    raise LoadError(f"tensor {name!r} in {file.name} {exc}") from None
                loaded.add((param_name, shard_id))

    missing = sorted(_source_name(p, s) for p, s in required - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoadError(
            f"tensor {missing[0]!r} is missing from the checkpoint in {model_dir}{more}: "
            f"{missing[:8]}"
        )
