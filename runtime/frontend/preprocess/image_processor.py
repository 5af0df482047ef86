"""A Hugging Face ``preprocessor_config.json`` of a CLIP / LLaVA image processor
(``CLIPImageProcessor``), read and checked (:func:`processor_config`), and applied
to a decoded RGB image (:func:`preprocess`): the float32 ``(3, H, W)`` array the
vision encoder takes, as transformers computes it.

Fields read (every other field is ignored; a bad value is a ValueError naming it):

- ``do_resize`` with ``size``: ``{"shortest_edge": S}`` (the short side to S, the
  long side ``int(S * long / short)``), ``{"height": H, "width": W}``, or an int
  (a shortest edge, as CLIP's older configs write it); ``resample``: a Pillow filter
  number (0 nearest, 1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming; default 3);
- ``do_center_crop`` with ``crop_size``: ``{"height": H, "width": W}`` or an int (a
  square); an image smaller than the crop is padded with zeros, as transformers does;
- ``do_rescale`` with ``rescale_factor`` (default 1/255);
- ``do_normalize`` with ``image_mean`` and ``image_std`` (three numbers each, or one
  for every channel; a std of 0 is refused);
- ``do_convert_rgb``: images are always made RGB here (transparency composited on
  white, as transformers does), so false is accepted and changes nothing for RGB
  input.

The defaults are ``CLIPImageProcessor``'s (224, bicubic, OpenAI's CLIP mean and std).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

PREPROCESSOR_CONFIG = "preprocessor_config.json"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
MAX_SIDE = 8192  # a resize or crop target beyond this is not an image encoder's


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The checked fields of a ``preprocessor_config.json`` (module docstring).
    ``shortest_edge`` and ``resize_height``/``resize_width`` are exclusive."""

    do_resize: bool = True
    shortest_edge: int | None = 224
    resize_height: int | None = None
    resize_width: int | None = None
    resample: int = 3
    do_center_crop: bool = True
    crop_height: int = 224
    crop_width: int = 224
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if (self.shortest_edge is None) == (self.resize_height is None):
            raise ValueError("size: give shortest_edge, or height and width")
        if (self.resize_height is None) != (self.resize_width is None):
            raise ValueError("size: height and width go together")
        for name in ("shortest_edge", "resize_height", "resize_width", "crop_height", "crop_width"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not 1 <= value <= MAX_SIDE):
                raise ValueError(f"{name} must be an int in 1..{MAX_SIDE}, got {value!r}")
        if self.resample not in RESAMPLE:
            raise ValueError(f"resample must be one of {sorted(RESAMPLE)}, got {self.resample!r}")
        if not (math.isfinite(self.rescale_factor) and self.rescale_factor > 0):
            raise ValueError(f"rescale_factor must be > 0, got {self.rescale_factor!r}")
        for name in ("image_mean", "image_std"):
            values = getattr(self, name)
            if len(values) != 3 or not all(math.isfinite(v) for v in values):
                raise ValueError(f"{name} must be three finite numbers, got {values!r}")
        if min(self.image_std) == 0:
            raise ValueError("image_std must not hold 0")

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of the array for a ``width`` x ``height`` image."""
        if self.do_center_crop:
            return self.crop_height, self.crop_width
        resized = self.resized(width, height)
        return (height, width) if resized is None else resized

    def resized(self, width: int, height: int) -> tuple[int, int] | None:
        """(height, width) the image is resized to (None: no resize), as
        transformers' ``get_resize_output_image_size`` computes it."""
        if not self.do_resize:
            return None
        if self.shortest_edge is None:
            assert self.resize_height is not None and self.resize_width is not None
            return self.resize_height, self.resize_width
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.shortest_edge * long / short)
        if width <= height:
            return new_long, self.shortest_edge
        return self.shortest_edge, new_long


def processor_config(raw: Any, source: str = PREPROCESSOR_CONFIG) -> ImageProcessorConfig:
    """The fields of a decoded ``preprocessor_config.json`` (module docstring),
    checked; ValueError naming ``source`` and the field."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object")
    fields: dict[str, Any] = {}
    for name in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb"):
        if raw.get(name) is not None:
            fields[name] = _bool(raw[name], source, name)
    if raw.get("size") is not None:
        fields.update(_size(raw["size"], source))
    if raw.get("crop_size") is not None:
        crop = _crop(raw["crop_size"], source)
        fields["crop_height"], fields["crop_width"] = crop
    if raw.get("resample") is not None:
        fields["resample"] = _int(raw["resample"], source, "resample")
    if raw.get("rescale_factor") is not None:
        fields["rescale_factor"] = _number(raw["rescale_factor"], source, "rescale_factor")
    for name in ("image_mean", "image_std"):
        if raw.get(name) is not None:
            fields[name] = _triple(raw[name], source, name)
    try:
        return ImageProcessorConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_processor_config(model_dir: str) -> ImageProcessorConfig | None:
    """``model_dir``'s ``preprocessor_config.json``, checked; None without one."""
    path = os.path.join(model_dir, PREPROCESSOR_CONFIG)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON ({exc})") from None
    return processor_config(raw, path)


def _bool(value: Any, source: str, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {name} must be true or false, got {value!r}")
    return value


def _int(value: Any, source: str, name: str) -> int:
    if type(value) is not int:
        raise ValueError(f"{source}: {name} must be an integer, got {value!r}")
    return value


def _number(value: Any, source: str, name: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{source}: {name} must be a finite number, got {value!r}")
    return float(value)


def _triple(value: Any, source: str, name: str) -> tuple[float, ...]:
    if type(value) in (int, float):
        value = [value] * 3
    if not isinstance(value, list) or len(value) != 3:
        raise ValueError(f"{source}: {name} must be a list of three numbers, got {value!r}")
    return tuple(_number(v, source, name) for v in value)


def _size(value: Any, source: str) -> dict[str, Any]:
    if type(value) is int:
        return {"shortest_edge": value}
    if not isinstance(value, dict):
        raise ValueError(f"{source}: size must be an object or an integer, got {value!r}")
    keys = set(value)
    if keys == {"shortest_edge"}:
        return {"shortest_edge": _int(value["shortest_edge"], source, "size.shortest_edge")}
    if keys == {"height", "width"}:
        return {
            "shortest_edge": None,
            "resize_height": _int(value["height"], source, "size.height"),
            "resize_width": _int(value["width"], source, "size.width"),
        }
    raise ValueError(
        f"{source}: size must be {{'shortest_edge': S}} or {{'height': H, 'width': W}}, "
        f"got keys {sorted(keys)}"
    )


def _crop(value: Any, source: str) -> tuple[int, int]:
    if type(value) is int:
        return value, value
    if not isinstance(value, dict) or set(value) != {"height", "width"}:
        raise ValueError(f"{source}: crop_size must be {{'height': H, 'width': W}} or an integer")
    return (
        _int(value["height"], source, "crop_size.height"),
        _int(value["width"], source, "crop_size.width"),
    )


def preprocess(image, config: ImageProcessorConfig) -> np.ndarray:
    """A decoded RGB ``PIL.Image`` to the float32 ``(3, H, W)`` array ``config``
    asks for: resize (Pillow, on 8-bit pixels as transformers does), center crop,
    rescale, normalize."""
    from PIL import Image

    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode}")
    size = config.resized(*image.size)
    if size is not None:
        height, width = size
        image = image.resize((width, height), resample=Image.Resampling(config.resample))
    pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)  # (3, H, W)
    if config.do_center_crop:
        pixels = _center_crop(pixels, config.crop_height, config.crop_width)
    out = pixels.astype(np.float32)
    if config.do_rescale:
        out = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
        out = (out - mean) / std
    return np.ascontiguousarray(out, dtype=np.float32)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' ``center_crop``: the middle (height, width), zero-padded where
    the image is smaller."""
    _, h, w = pixels.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + height, left : left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((3, new_h, new_w), dtype=pixels.dtype)
    pad_top, pad_left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[:, pad_top : pad_top + h, pad_left : pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[
        :, max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)
    ]
