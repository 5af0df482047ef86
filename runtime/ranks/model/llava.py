"""LLaVA on one rank: the CLIP encoder and projector (:mod:`.vision`) in front of
the paged-KV decoder (:mod:`.llama`).

The composite *is* a :class:`LlamaForCausalLM` (``config`` is the decoder's
:class:`ModelConfig`, with ``config.vision`` set), so every text-only caller runs
it unchanged. What it adds:

- :meth:`LlavaForConditionalGeneration.encode_images`: pixels (B, 3, S, S) ->
  projected features (B, N, hidden), N = ``image_tokens_per_image``;
- the decoder's ``forward(..., image_rows=, features=)``: a (R, hidden) feature
  store and, per packed token, the store row that replaces its embedding (-1:
  keep the token's embedding), see :func:`~.llama.substitute_features`.

Checkpoint names: transformers writes the LLaVA weights in one of these
layouts, and all load (:meth:`LlavaForConditionalGeneration.param_name`):

=====================================  =====================================
checkpoint prefix                      parameter prefix
=====================================  =====================================
``language_model.model.``              ``model.``
``model.language_model.``              ``model.``
``language_model.lm_head.``            ``lm_head.``
``lm_head.``                           ``lm_head.``
``vision_tower.vision_model.``         ``vision_tower.``
``model.vision_tower.vision_model.``   ``vision_tower.``
``model.vision_tower.``                ``vision_tower.``
``vision_tower.``                      ``vision_tower.``
``model.multi_modal_projector.``       ``multi_modal_projector.``
``multi_modal_projector.``             ``multi_modal_projector.``
=====================================  =====================================
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.ranks.model.config import ModelConfig
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.model.parallel import TPGroup
from runtime.ranks.model.vision import ClipVisionTower, LlavaProjector
from runtime.ranks.model.vision_config import VisionConfig

__all__ = ["CHECKPOINT_PREFIXES", "LlavaForConditionalGeneration"]

# Checkpoint prefix -> parameter prefix, longest first (the module docstring's table).
CHECKPOINT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("lm_head.", "lm_head."),
)
# Vision tensors LLaVA never uses (and buffers old checkpoints saved).
_UNUSED_VISION = ("vision_tower.post_layernorm.", "vision_tower.embeddings.position_ids")


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The decoder plus a CLIP encoder and projector (module docstring).

    Every rank of the group runs :meth:`encode_images` on the same pixels and gets
    the same features; the encoder is tensor-parallel when its sizes allow
    (:meth:`VisionConfig.encoder_splits`), replicated otherwise.
    """

    def __init__(
        self,
        config: ModelConfig,
        group: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if config.vision is None:
            raise ValueError("a LLaVA model needs config.vision (a LLaVA config.json)")
        super().__init__(config, group, dtype)
        self.vision_tower = ClipVisionTower(config.vision, self.group, dtype)
        self.multi_modal_projector = LlavaProjector(
            config.vision, config.hidden_size, self.group, dtype
        )

    @property
    def vision(self) -> VisionConfig:
        vision = self.config.vision
        assert vision is not None  # checked in __init__
        return vision

    @property
    def image_token_id(self) -> int:
        """The token id whose positions take image features."""
        return self.vision.image_token_id

    @property
    def image_tokens_per_image(self) -> int:
        """Image tokens (feature rows) per image: ``N`` of :meth:`encode_images`."""
        return self.vision.image_tokens_per_image

    @torch.inference_mode()
    def encode_images(self, pixels: Tensor) -> Tensor:
        """pixels (B, C, S, S) float (preprocessed as ``preprocessor_config.json``
        says) -> features (B, N, hidden) in the model dtype, N =
        :attr:`image_tokens_per_image`. Raises ValueError on another shape."""
        enc = self.vision.encoder
        expected = (enc.num_channels, enc.image_size, enc.image_size)
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != expected:
            raise ValueError(
                f"pixels must be (B, {', '.join(map(str, expected))}), got {tuple(pixels.shape)}"
            )
        selected = self.vision_tower(pixels)  # (B, N, vision hidden)
        return self.multi_modal_projector(selected)  # (B, N, hidden)

    def param_name(self, checkpoint_name: str) -> str | None:
        """This model's parameter name for a checkpoint tensor (before the merged
        q/k/v and gate/up renaming); None for tensors LLaVA does not use (the
        vision layers past ``vision_feature_layer``, ``post_layernorm``). Names
        outside every known prefix come back unchanged (the loader refuses them)."""
        for prefix, target in CHECKPOINT_PREFIXES:
            if checkpoint_name.startswith(prefix):
                name = target + checkpoint_name[len(prefix) :]
                break
        else:
            return checkpoint_name
        if name.startswith(_UNUSED_VISION):
            return None
        layers = "vision_tower.encoder.layers."
        if name.startswith(layers):
            index = name[len(layers) :].partition(".")[0]
            if index.isdigit() and int(index) >= self.vision.encoder_layers_used:
                return None
        return name
