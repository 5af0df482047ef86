"""A LLaVA model's vision half, read from its ``config.json`` (frozen, validated,
torch-free: the frontend and the coordinator read it too).

transformers' ``LlavaForConditionalGeneration`` layout: ``vision_config`` (a
``CLIPVisionConfig``), ``text_config`` (the decoder, read by
:class:`~runtime.ranks.model.config.ModelConfig`), and at the top level
``image_token_index`` (or ``image_token_id``), ``vision_feature_layer`` (one int;
a list of layers is refused), ``vision_feature_select_strategy`` (``"default"``
drops the CLS row, ``"full"`` keeps it), ``projector_hidden_act`` and
``multimodal_projector_bias``.  Every refusal is a :class:`VisionConfigError`
naming the field: both a ModelConfigError (what the command line catches) and
a LoadError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runtime.ranks.model.errors import LoadError, ModelConfigError

__all__ = [
    "ACTIVATIONS",
    "ClipVisionConfig",
    "VisionConfig",
    "VisionConfigError",
    "is_llava",
]

# transformers ACT2FN names the vision encoder and the projector may use.
ACTIVATIONS = ("gelu", "quick_gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu")
SELECT_STRATEGIES = ("default", "full")
LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
CLIP_VISION = "clip_vision_model"


class VisionConfigError(ModelConfigError, LoadError):
    """A LLaVA ``config.json`` field is missing, malformed or unsupported; the
    message names it (``vision_config.hidden_size``, ``vision_feature_layer``...)."""


def is_llava(raw: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is a LLaVA (vision-language) config."""
    archs = raw.get("architectures")
    if archs:
        return isinstance(archs, list) and LLAVA_ARCHITECTURE in archs
    model_type = raw.get("model_type")
    return model_type == "llava" or (model_type is None and "vision_config" in raw)


@dataclass(frozen=True)
class ClipVisionConfig:
    """A CLIP ViT encoder's shape (transformers' ``CLIPVisionConfig``)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "image_size",
            "patch_size",
            "num_channels",
        ):
            _positive_int(f"vision_config.{name}", getattr(self, name))
        _positive_float("vision_config.layer_norm_eps", self.layer_norm_eps)
        _activation("vision_config.hidden_act", self.hidden_act)
        if self.hidden_size % self.num_attention_heads:
            raise VisionConfigError(
                f"vision_config.hidden_size ({self.hidden_size}) is not divisible by "
                f"vision_config.num_attention_heads ({self.num_attention_heads})"
            )
        if self.image_size % self.patch_size:
            raise VisionConfigError(
                f"vision_config.image_size ({self.image_size}) is not a multiple of "
                f"vision_config.patch_size ({self.patch_size})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, raw: Any) -> ClipVisionConfig:
        if raw is None:
            raise VisionConfigError(
                "vision_config is missing from config.json (a LLaVA config holds "
                "vision_config and text_config)"
            )
        if not isinstance(raw, dict):
            raise VisionConfigError(f"vision_config must be an object, got {raw!r}")
        model_type = raw.get("model_type", CLIP_VISION)
        if model_type != CLIP_VISION:
            raise VisionConfigError(
                f"vision_config.model_type {model_type!r} is not supported; supported: "
                f"{CLIP_VISION!r} (a CLIP ViT)"
            )
        required = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "image_size",
            "patch_size",
        )
        for name in required:
            if raw.get(name) is None:
                raise VisionConfigError(f"vision_config.{name} is missing from config.json")
        optional = {
            k: raw[k]
            for k in ("num_channels", "layer_norm_eps", "hidden_act")
            if raw.get(k) is not None
        }
        return cls(**{k: raw[k] for k in required}, **optional)


@dataclass(frozen=True)
class VisionConfig:
    """The vision half of a LLaVA model: the encoder, which hidden state it hands
    on, the projector, and the image token.

    The frontend expands each ``<image>`` into :attr:`image_tokens_per_image`
    copies of :attr:`image_token_id`; the rank model substitutes one projected
    feature row for each.
    """

    encoder: ClipVisionConfig
    image_token_id: int
    feature_layer: int = -2
    select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.image_token_id, bool) or not isinstance(self.image_token_id, int):
            raise VisionConfigError(
                f"image_token_index must be a non-negative integer, got {self.image_token_id!r}"
            )
        if self.image_token_id < 0:
            raise VisionConfigError(
                f"image_token_index must be a non-negative integer, got {self.image_token_id!r}"
            )
        layer, layers = self.feature_layer, self.encoder.num_hidden_layers
        if isinstance(layer, list):
            raise VisionConfigError(
                f"vision_feature_layer {layer!r}: a list of layers (concatenated features) "
                "is not supported; give one layer (an int)"
            )
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not -layers - 1 <= layer <= layers
        ):
            raise VisionConfigError(
                f"vision_feature_layer must be an int in [{-layers - 1}, {layers}] (the "
                f"encoder's {layers + 1} hidden states), got {layer!r}"
            )
        if self.select_strategy not in SELECT_STRATEGIES:
            raise VisionConfigError(
                f"vision_feature_select_strategy {self.select_strategy!r} is not supported; "
                f"supported: {', '.join(map(repr, SELECT_STRATEGIES))}"
            )
        _activation("projector_hidden_act", self.projector_hidden_act)
        if not isinstance(self.projector_bias, bool):
            raise VisionConfigError(
                f"multimodal_projector_bias must be true or false, got {self.projector_bias!r}"
            )

    @property
    def image_tokens_per_image(self) -> int:
        """Feature rows (and image tokens in the prompt) per image: one per patch,
        plus the CLS row with the ``"full"`` strategy."""
        return self.encoder.num_patches + (self.select_strategy == "full")

    @property
    def encoder_layers_used(self) -> int:
        """Encoder layers run: the selected hidden state is the output of this many
        layers (0: the embeddings after ``pre_layrnorm``); later layers are unused."""
        return self.feature_layer % (self.encoder.num_hidden_layers + 1)

    def encoder_splits(self, world_size: int) -> bool:
        """Whether the encoder is tensor-parallel over ``world_size`` ranks (heads and
        intermediate size divisible); otherwise every rank holds all of it."""
        enc = self.encoder
        return enc.num_attention_heads % world_size == 0 and enc.intermediate_size % world_size == 0

    @classmethod
    def from_llava(cls, raw: dict[str, Any]) -> VisionConfig:
        """The vision half of a parsed LLaVA ``config.json``."""
        encoder = ClipVisionConfig.from_hf(raw.get("vision_config"))
        token = raw.get("image_token_index")
        if token is None:
            token = raw.get("image_token_id")
        if token is None:
            raise VisionConfigError("image_token_index is missing from config.json")
        bias = raw.get("multimodal_projector_bias")
        return cls(
            encoder=encoder,
            image_token_id=token,
            feature_layer=raw.get("vision_feature_layer", -2),
            select_strategy=raw.get("vision_feature_select_strategy", "default"),
            projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
            projector_bias=True if bias is None else bias,
        )


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise VisionConfigError(f"{name} must be a positive integer, got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not math.isfinite(value) or value <= 0:
        raise VisionConfigError(f"{name} must be a finite number > 0, got {value!r}")


def _activation(name: str, value: Any) -> None:
    if value not in ACTIVATIONS:
        raise VisionConfigError(
            f"{name} {value!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        )
