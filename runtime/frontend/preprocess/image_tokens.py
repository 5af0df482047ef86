"""Which served models take images, and how many prompt tokens an image becomes
(:class:`ImageTokens`, read from the model's ``config.json`` by
:func:`read_image_tokens`).

A model directory in transformers' ``LlavaForConditionalGeneration`` layout takes
images: its ``config.json`` names that architecture, or ``model_type`` ``"llava"``,
or holds a ``vision_config`` (beside ``text_config``); the same rule as the rank's
reader (``runtime.ranks.model.vision_config.is_llava``).  Fields read:

- ``image_token_index`` (or transformers 5's ``image_token_id``): the image token;
- ``vision_config.image_size`` and ``vision_config.patch_size`` (both required, the
  size a multiple of the patch);
- ``vision_feature_select_strategy``: ``"default"`` (the CLS row dropped:
  ``(image_size / patch_size) ** 2`` tokens per image) or ``"full"`` (that + 1);
  absent, ``"default"`` (transformers' default).

Each refusal is a ValueError naming ``config.json`` and the field.  vLLM counts an
image's tokens the same way (one per patch, plus CLS with ``"full"``); transformers'
``LlavaProcessor`` does with ``num_additional_image_tokens=1`` (llava-hf's
``processor_config.json``).  A ``processor_config.json`` beside it is checked by
:func:`check_processor_config`: its ``num_additional_image_tokens`` must be 1 (the
CLIP encoder's one CLS row), and its ``patch_size`` and
``vision_feature_select_strategy``, when given, those of ``config.json``; a
processor that counted otherwise would expand a different number of image
tokens than the encoder writes features.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.frontend.preprocess.image_processor import (
    PREPROCESSOR_CONFIG,
    ImageProcessorConfig,
    load_processor_config,
)

CONFIG = "config.json"
PROCESSOR_CONFIG = "processor_config.json"  # transformers' LlavaProcessor settings
LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
SELECT_STRATEGIES = ("default", "full")
MAX_IMAGE_TOKENS = 1 << 16  # one image's tokens: beyond this, not a LLaVA encoder's


@dataclass(frozen=True)
class ImageTokens:
    """How a served vision model's prompt holds an image: ``image_token_id``
    repeated :attr:`tokens_per_image` times (one per feature row its vision
    encoder produces)."""

    image_token_id: int
    image_size: int
    patch_size: int
    select_strategy: str = "default"

    def __post_init__(self) -> None:
        for name, where in (
            ("image_token_id", "image_token_index"),
            ("image_size", "vision_config.image_size"),
            ("patch_size", "vision_config.patch_size"),
        ):
            value = getattr(self, name)
            low = 0 if name == "image_token_id" else 1
            if type(value) is not int or value < low:
                raise ValueError(f"{CONFIG}: {where} must be an integer >= {low}, got {value!r}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"{CONFIG}: vision_config.image_size ({self.image_size}) is not a multiple of "
                f"vision_config.patch_size ({self.patch_size})"
            )
        if self.select_strategy not in SELECT_STRATEGIES:
            raise ValueError(
                f"{CONFIG}: vision_feature_select_strategy must be one of "
                f"{', '.join(map(repr, SELECT_STRATEGIES))}, got {self.select_strategy!r}"
            )
        if self.tokens_per_image > MAX_IMAGE_TOKENS:
            raise ValueError(
                f"{CONFIG}: vision_config.image_size / patch_size gives "
                f"{self.tokens_per_image} tokens per image, over {MAX_IMAGE_TOKENS}"
            )

    @property
    def tokens_per_image(self) -> int:
        """``(image_size / patch_size) ** 2``, + 1 (the CLS row) with ``"full"``."""
        return (self.image_size // self.patch_size) ** 2 + (self.select_strategy == "full")


def is_llava(config: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is a LLaVA (vision-language) model's."""
    archs = config.get("architectures")
    if isinstance(archs, list) and LLAVA_ARCHITECTURE in archs:
        return True
    return config.get("model_type") == "llava" or "vision_config" in config


def image_tokens_from_config(config: dict[str, Any]) -> ImageTokens | None:
    """A parsed ``config.json``'s :class:`ImageTokens`; None for a text-only model."""
    if not is_llava(config):
        return None
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"{CONFIG}: vision_config must be an object, got {vision!r}")
    for name in ("image_size", "patch_size"):
        if vision.get(name) is None:
            raise ValueError(f"{CONFIG}: vision_config.{name} is missing")
    token = config.get("image_token_index")
    if token is None:
        token = config.get("image_token_id")
    if token is None:
        raise ValueError(f"{CONFIG}: image_token_index (or image_token_id) is missing")
    return ImageTokens(
        image_token_id=token,
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        select_strategy=config.get("vision_feature_select_strategy", "default"),
    )


def read_image_tokens(model_dir: str | Path) -> ImageTokens | None:
    """The model directory's :class:`ImageTokens` (module docstring); None when
    the model is text-only or has no ``config.json``."""
    config = _json_object(Path(model_dir) / CONFIG)
    return None if config is None else image_tokens_from_config(config)


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such file."""
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def fixed_output_size(processor: ImageProcessorConfig) -> tuple[int, int] | None:
    """(height, width) of every preprocessed image, or None when it depends on the image."""
    if processor.do_center_crop:
        return processor.crop_height, processor.crop_width
    if processor.do_resize and processor.resize_height is not None:
        return processor.resize_height, processor.resize_width or 0
    return None


def load_vision(model_dir: str | Path) -> tuple[ImageTokens, ImageProcessorConfig] | None:
    """A vision model's image tokens and ``preprocessor_config.json``, checked
    against each other (every preprocessed image is the encoder's ``image_size``
    square: its tokens are counted from that); None for a text-only model."""
    tokens = read_image_tokens(model_dir)
    if tokens is None:
        return None
    check_processor_config(model_dir, tokens)
    processor = load_processor_config(str(model_dir))
    if processor is None:
        raise ValueError(
            f"{model_dir}: a LLaVA model needs its {PREPROCESSOR_CONFIG} (the image "
            "preprocessing: size, crop, mean and std)"
        )
    size, fixed = tokens.image_size, fixed_output_size(processor)
    if fixed != (size, size):
        got = "depends on the image" if fixed is None else f"is {fixed[0]} x {fixed[1]}"
        raise ValueError(
            f"{PREPROCESSOR_CONFIG}: its output size {got}; {CONFIG}'s "
            f"vision_config.image_size is {size} (crop_size must be {size} x {size})"
        )
    return tokens, processor


def check_processor_config(model_dir: str | Path, tokens: ImageTokens) -> None:
    """``processor_config.json`` (transformers' ``LlavaProcessor`` settings), when
    the directory has one, agrees with ``config.json`` on how many tokens an image
    becomes (module docstring); a ValueError naming the file and field otherwise."""
    config = _json_object(Path(model_dir) / PROCESSOR_CONFIG)
    if config is None:
        return
    expected = {
        "num_additional_image_tokens": 1,
        "patch_size": tokens.patch_size,
        "vision_feature_select_strategy": tokens.select_strategy,
    }
    for name, want in expected.items():
        got = config.get(name)
        if got is not None and (got != want or type(got) is not type(want)):
            why = CONFIG if name != "num_additional_image_tokens" else "the CLIP encoder's CLS row"
            raise ValueError(
                f"{PROCESSOR_CONFIG}: {name} is {got!r}, but {why} gives {want!r} "
                f"({tokens.tokens_per_image} image tokens per image)"
            )
