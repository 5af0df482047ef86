"""A request's images on the frontend link: each image's span in the prompt and its
preprocessed pixels (:class:`SubmitImage`, carried by :class:`~runtime.transport.api.Submit`),
and the digest that names the pixels (:func:`pixel_digest`, the same on both sides).

Wire form of one image (a msgpack map, no pickle)::

    {"start": int, "length": int, "digest": str (64 hex), "pixels": bin,
     "shape": [int, ...], "dtype": "float32"}

Checked on construction and on receipt: ``dtype`` float32; ``shape`` three positive
dimensions (channels, height, width) whose product times 4 is the byte count of
``pixels``; ``digest`` the sha256 of :func:`pixel_digest_input` recomputed from the
pixels; and over a request's images (:func:`check_images`): at most
:data:`MAX_IMAGES`, their spans in prompt order, disjoint and inside the prompt
(:func:`runtime.image_spans.check_spans`), and each span's prompt tokens one
repeated token id (the model's image token).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.image_spans import ImageSpan, ImageSpanError, check_spans
from runtime.transport.fields import (
    ProtocolError,
    check_fields,
    check_int,
    check_ints,
    check_seq,
    set_field,
)

DTYPE = "float32"
DTYPE_BYTES = 4
MAX_IMAGES = 1024  # per request (vLLM allows 999); the message size bounds them first
MAX_SIDE = 1 << 16  # one dimension of a preprocessed image


def pixel_digest_input(pixels: bytes, shape: tuple[int, ...]) -> bytes:
    """What an image's digest hashes: dtype and shape, then the pixels (C order)."""
    return f"{DTYPE}:{'x'.join(map(str, shape))}:".encode() + pixels


def pixel_digest(pixels: bytes, shape: tuple[int, ...]) -> str:
    """The sha256 (64 lower-case hex digits) of :func:`pixel_digest_input`."""
    return hashlib.sha256(pixel_digest_input(pixels, shape)).hexdigest()


@dataclass(frozen=True)
class SubmitImage:
    """One image of a request: its feature rows' positions in the prompt
    (``[start, start + length)``, each the model's image token), ``digest`` (the
    sha256 of its pixels, the prefix-cache key's image part) and its preprocessed
    pixels (``shape`` ``(3, H, W)``, ``dtype`` float32, C order)."""

    start: int
    length: int
    digest: str
    pixels: bytes
    shape: tuple[int, ...]
    dtype: str = DTYPE

    def __post_init__(self) -> None:
        check_int("start", self.start)
        check_int("length", self.length, 1)
        try:
            ImageSpan(self.start, self.length, self.digest)
        except ImageSpanError as exc:
            raise ProtocolError("digest", str(exc)) from None
        if self.dtype != DTYPE:
            raise ProtocolError("dtype", f"must be {DTYPE!r}, got {self.dtype!r}")
        shape = check_ints("shape", self.shape, 1, MAX_SIDE, 3)
        if len(shape) != 3:
            raise ProtocolError("shape", f"must be (channels, height, width), got {shape}")
        if not isinstance(self.pixels, bytes):
            raise ProtocolError("pixels", f"must be bytes, got {type(self.pixels).__name__}")
        want = DTYPE_BYTES * shape[0] * shape[1] * shape[2]
        if len(self.pixels) != want:
            raise ProtocolError(
                "pixels", f"holds {len(self.pixels)} bytes; shape {shape} of {DTYPE} is {want}"
            )
        if pixel_digest(self.pixels, shape) != self.digest:
            raise ProtocolError("digest", "is not the sha256 of the pixels (pixel_digest_input)")
        set_field(self, "shape", shape)

    @property
    def span(self) -> ImageSpan:
        return ImageSpan(self.start, self.length, self.digest)

    def to_wire(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "length": self.length,
            "digest": self.digest,
            "pixels": self.pixels,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }

    @classmethod
    def from_wire(cls, data: Any) -> SubmitImage:
        return cls(**check_fields(cls, data))


def check_images(value: Any, prompt: Sequence[int]) -> tuple[SubmitImage, ...]:
    """A request's images, checked against its prompt (module docstring); the
    ProtocolError names the image (``images[1].start``)."""
    images = check_seq("images", value, MAX_IMAGES)
    for i, image in enumerate(images):
        if not isinstance(image, SubmitImage):
            raise ProtocolError(f"images[{i}]", "must be a SubmitImage")
    try:
        check_spans([image.span for image in images], len(prompt))
    except ImageSpanError as exc:  # "images[i]: starts at ..." or "... past the prompt"
        where, _, reason = str(exc).partition(": ")
        name = "length" if "past the prompt" in reason else "start"
        raise ProtocolError(f"{where}.{name}", reason) from None
    token: int | None = None
    for i, image in enumerate(images):
        tokens = set(prompt[image.start : image.start + image.length])
        if len(tokens) != 1 or (token is not None and tokens != {token}):
            raise ProtocolError(
                f"images[{i}].start",
                f"the prompt's tokens in [{image.start}, {image.start + image.length}) are "
                "not the image token repeated (the same id in every image's span)",
            )
        (token,) = tokens
    return images
