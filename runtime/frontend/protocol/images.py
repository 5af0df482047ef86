"""Images in chat messages: the limits a server puts on them (:class:`ImageLimits`),
an ``image_url`` content part checked as far as it can be without decoding
(:func:`image_part`), and what a decoded, preprocessed image becomes
(:class:`PreparedImage`, the hand-off to the vision model).

Accepted parts (OpenAI's two shapes)::

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": ...}}
    {"type": "image_url", "image_url": "data:image/png;base64,..."}

Only base64 ``data:`` URIs of an ``image/*`` media type: the server never fetches, so
an ``http(s)://`` (or any other) URL is a 400 naming the field. ``detail`` is accepted
and ignored. What the bytes hold (PNG, JPEG, WebP or GIF), their pixel count and
frames are checked where the image is decoded, in a preprocessing worker
(:mod:`runtime.frontend.preprocess.images`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from runtime.frontend.protocol.errors import RequestError
from runtime.transport.images import DTYPE as DTYPE  # re-exported: one digest for both sides
from runtime.transport.images import pixel_digest
from runtime.transport.images import pixel_digest_input as pixel_digest_input

# vLLM V1 takes up to 999 images per prompt; flare holds each image's prepared
# pixels (3 x 336 x 336 float32: 1.35 MB for LLaVA-1.5) in the preprocessing worker
# and across its pipe, so its default is smaller.
DEFAULT_IMAGES_PER_PROMPT = 16
DEFAULT_IMAGE_BYTES = 20 << 20  # OpenAI's per-image limit
DEFAULT_IMAGE_PIXELS = 4096 * 4096
DEFAULT_IMAGE_FRAMES = 32
# LLaVA's image token: the text an image part leaves at its place in the message
# (the vision model's work expands it into the image's tokens).
IMAGE_PLACEHOLDER = "<image>"
NOT_ACCEPTED = "the served model does not accept images (it is a text-only model)"

_DATA_URI = re.compile(r"data:(image/[A-Za-z0-9.+-]+)((?:;[^;,]*)*),", re.ASCII)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (``flare run`` flags in brackets); each
    refusal is a 400 naming the limit and the field.

    - ``max_images_per_prompt`` [``--limit-mm-per-prompt '{"image": N}'``, vLLM's
      flag]: image parts in one request, counted before any is decoded;
    - ``max_image_bytes`` [``--max-image-bytes``]: one image's encoded size (the
      file the data URI carries), read from the base64 length before decoding it;
    - ``max_image_pixels`` [``--max-image-pixels``]: width x height, read from the
      header before any pixel is decoded (a decompression bomb stops here), and the
      size the preprocessor would resize it to;
    - ``max_image_frames`` [``--max-image-frames``]: an animated image's frames,
      counted without decoding them (only the first frame is used).
    """

    max_images_per_prompt: int = DEFAULT_IMAGES_PER_PROMPT
    max_image_bytes: int = DEFAULT_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_IMAGE_PIXELS
    max_image_frames: int = DEFAULT_IMAGE_FRAMES

    def __post_init__(self) -> None:
        for name, low in (
            ("max_images_per_prompt", 0),
            ("max_image_bytes", 1),
            ("max_image_pixels", 1),
            ("max_image_frames", 1),
        ):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class ImagePart:
    """An ``image_url`` part as parsed: where it is (``param``, the field errors
    name), its declared media type and its base64 text, not yet decoded."""

    param: str
    media_type: str
    base64: str

    def encoded_bytes(self) -> int:
        """The size of the file the base64 text decodes to (without decoding it)."""
        text = self.base64
        pad = len(text) - len(text.rstrip("="))
        return len(text) * 3 // 4 - min(pad, 2)


def image_part(part: dict[str, Any], at: str, limits: ImageLimits) -> ImagePart:
    """The ``image_url`` part ``part`` (at ``at``, e.g. ``messages[0].content[1]``):
    its URL a base64 data URI of an image type within ``max_image_bytes``."""
    value = part.get("image_url")
    where = f"{at}.image_url"
    if isinstance(value, dict):
        url, where = value.get("url"), f"{where}.url"
    elif isinstance(value, str):
        url = value
    else:
        raise RequestError(
            400, f"{where} must be an object with a url (or the url as a string)", where
        )
    if not isinstance(url, str):
        raise RequestError(400, f"{where} must be a string", where)
    head = url[:256]
    if not head.lower().startswith("data:"):
        scheme = _SCHEME.match(head)
        what = f"a {scheme.group(1).lower()} URL" if scheme else "not a data URI"
        raise RequestError(
            400,
            f"{where} is {what}: this server does not fetch images; send the image "
            "inline as a data URI (data:image/png;base64,...)",
            where,
        )
    match = _DATA_URI.match(head)
    params = match.group(2).lower().split(";") if match else []
    if match is None or "base64" not in params:
        raise RequestError(
            400,
            f"{where} must be a base64 data URI of an image, data:image/<type>;base64,<data>",
            where,
        )
    found = ImagePart(where, match.group(1).lower(), url[match.end() :])
    size = found.encoded_bytes()
    if size > limits.max_image_bytes:
        raise RequestError(
            400,
            f"{where} holds an image of {size} bytes, over this server's limit of "
            f"{limits.max_image_bytes} bytes per image (--max-image-bytes)",
            where,
        )
    return found


def too_many_images(count: int, limits: ImageLimits) -> RequestError:
    return RequestError(
        400,
        f"messages has at least {count} images; this server takes at most "
        f"{limits.max_images_per_prompt} per request (--limit-mm-per-prompt)",
        "messages",
    )


def not_accepted(param: str) -> RequestError:
    """What an image gets from a text-only model (as vLLM refuses one)."""
    return RequestError(400, NOT_ACCEPTED, param)


@dataclass(frozen=True)
class PreparedImage:
    """One image, decoded and preprocessed as the model's ``preprocessor_config.json``
    says: the hand-off from the frontend to the vision model.

    ``pixels``: the float32 ``(3, H, W)`` array's bytes, C order (``shape`` is
    ``(3, H, W)``, ``dtype`` ``"float32"``); ``image_hash``: the sha256 of
    :func:`pixel_digest_input` (shape, dtype and pixels), for the prefix-cache key:
    the same prompt with different images never shares KV. ``original_size``: the
    decoded image's (width, height). ``param``: the content part it came from.
    Checked on construction (a worker's answer is checked again on receipt, its
    hash recomputed).
    """

    pixels: bytes
    shape: tuple[int, ...]
    dtype: str
    image_hash: str
    original_size: tuple[int, int]
    param: str

    def __post_init__(self) -> None:
        if self.dtype != DTYPE:
            raise ValueError(f"dtype must be {DTYPE!r}, got {self.dtype!r}")
        shape = self.shape
        if len(shape) != 3 or shape[0] != 3 or min(shape) < 1:
            raise ValueError(f"shape must be (3, H, W) with H, W >= 1, got {shape}")
        if len(self.pixels) != 4 * shape[0] * shape[1] * shape[2]:
            raise ValueError(f"pixels must hold {shape} float32 values")
        if _HEX64.fullmatch(self.image_hash) is None:
            raise ValueError("image_hash must be a sha256 in 64 lower-case hex digits")
        if min(self.original_size) < 1:
            raise ValueError(f"original_size must be positive, got {self.original_size}")

    def array(self):  # -> numpy.ndarray (numpy imported only where images are used)
        """The pixels as a read-only float32 ``(3, H, W)`` numpy array."""
        import numpy as np

        return np.frombuffer(self.pixels, dtype=np.float32).reshape(self.shape)

    def hash_matches(self) -> bool:
        return image_hash(self.pixels, self.shape) == self.image_hash


def image_hash(pixels: bytes, shape: tuple[int, ...]) -> str:
    """The sha256 of :func:`pixel_digest_input` (shape, dtype, pixels): the digest the
    coordinator recomputes on receipt (:mod:`runtime.transport.images`)."""
    return pixel_digest(pixels, shape)
