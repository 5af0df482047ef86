"""What a model directory holds, checked without loading a weight (nor importing
torch): ``config.json`` through :class:`ModelConfig`, ``tokenizer.json``, the
safetensors files or those ``model.safetensors.index.json`` names, and for a LLaVA
directory (``config.json`` with ``vision_config``) ``preprocessor_config.json``.  The frontend
and the coordinator check a deployment's model here; the ranks load it
(:mod:`runtime.ranks.model.loader`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.ranks.model.config import ModelConfig
from runtime.ranks.model.errors import LoadError, ModelConfigError
from runtime.ranks.model.vision_config import VisionConfig, VisionConfigError

_INDEX_FILE = "model.safetensors.index.json"
PREPROCESSOR_FILE = "preprocessor_config.json"


def check_model_dir(model_dir: str | Path, tensor_parallel_size: int = 1) -> ModelConfig:
    """What a deployment needs from ``model_dir``, checked without loading a weight.

    Reads ``config.json`` through :class:`ModelConfig` (architecture, shapes, the
    tensor-parallel split over ``tensor_parallel_size`` ranks), and checks that
    ``tokenizer.json`` and the safetensors files (or those the index names) exist.
    A LLaVA directory (the returned config's ``vision`` set) also needs
    ``preprocessor_config.json``, whose crop size must be the encoder's image size.
    Raises ModelConfigError or LoadError (a LLaVA field: VisionConfigError, both)
    with a one-line message naming the file.
    """
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise LoadError(f"{model_dir} does not exist")
    if not model_dir.is_dir():
        raise LoadError(f"{model_dir} is not a directory")
    if not (model_dir / "config.json").is_file():
        raise LoadError(
            f"{model_dir} has no config.json (a Hugging Face model directory holds "
            "config.json, tokenizer.json and *.safetensors)"
        )
    try:
        config = ModelConfig.from_dir(model_dir)
    except VisionConfigError as exc:
        raise VisionConfigError(f"{model_dir / 'config.json'}: {exc}") from None
    except ModelConfigError as exc:
        raise ModelConfigError(f"{model_dir / 'config.json'}: {exc}") from None
    except OSError as exc:
        raise LoadError(f"{model_dir / 'config.json'}: {exc.strerror or exc}") from None
    if not (model_dir / "tokenizer.json").is_file():
        raise LoadError(
            f"{model_dir} has no tokenizer.json (flare reads the tokenizers library's "
            "tokenizer.json; save one with tokenizer.save_pretrained)"
        )
    if config.vision is not None:
        check_preprocessor(model_dir, config.vision)
    try:
        checkpoint_files(model_dir)
    except (ValueError, AttributeError, OSError) as exc:  # an unreadable index file
        raise LoadError(f"{model_dir / _INDEX_FILE} cannot be read: {exc}") from None
    try:
        config.check_tensor_parallel(tensor_parallel_size)
    except ModelConfigError as exc:
        allowed = ", ".join(map(str, config.tensor_parallel_sizes()))
        raise ModelConfigError(
            f"{model_dir / 'config.json'}: {exc}; tensor-parallel sizes this model "
            f"allows: {allowed}"
        ) from None
    return config


def check_preprocessor(model_dir: str | Path, vision: VisionConfig) -> None:
    """A LLaVA directory's ``preprocessor_config.json``: present, a JSON object, and
    (when it center-crops) cropping to the encoder's ``image_size``."""
    path = Path(model_dir) / PREPROCESSOR_FILE
    if not path.is_file():
        raise LoadError(
            f"{model_dir} has no {PREPROCESSOR_FILE} (a LLaVA model directory needs its "
            "image processor's; save one with CLIPImageProcessor.save_pretrained)"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoadError(f"{path} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise LoadError(f"{path} must hold a JSON object")
    crop = raw.get("crop_size")
    if raw.get("do_center_crop", True) and crop is not None:
        side = vision.encoder.image_size
        if _crop_sides(crop) != (side, side):
            raise LoadError(
                f"{path}: crop_size {crop!r} does not give the vision encoder's "
                f"{side}x{side} images (vision_config.image_size)"
            )


def _crop_sides(crop: Any) -> tuple[Any, Any]:
    if isinstance(crop, dict):
        return crop.get("height"), crop.get("width")
    return crop, crop


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise LoadError(f"{_INDEX_FILE} names {file.name}, which does not exist")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LoadError(f"no *.safetensors files in {model_dir}")
    return files
