"""Decoding the images of a chat request, in a preprocessing worker (never on the
event loop: :func:`runtime.frontend.preprocess.preparer.prepare_body` sends every
body with an image part to the pool), against hostile input.

For each :class:`~runtime.frontend.protocol.images.ImagePart`, in this order, each
refusal a 400 naming the part's field and the limit:

1. its size, from the base64 length (:func:`~runtime.frontend.protocol.images.image_part`);
2. base64, strictly (no whitespace);
3. the format, from the magic bytes: PNG, JPEG, WebP or GIF; anything else is refused
   before Pillow looks at it (Pillow opens only that one format);
4. width x height, read from the header here (:func:`header_size`) and again from
   Pillow's header-only open, within ``max_image_pixels`` (a decompression bomb
   declares its size: no pixel is decoded). Pillow's own bomb check
   (``Image.MAX_IMAGE_PIXELS``) is set to the same limit as a backstop;
5. frames: an animated image (GIF, APNG, WebP) may have at most ``max_image_frames``,
   counted without decoding any (a GIF's blocks are walked, stopping past the limit);
   only the first frame is used;
6. the size the preprocessor would resize it to, within ``max_image_pixels`` (a
   1 x 10000 image would otherwise become 224 x 2,240,000);
7. the first frame decoded (a truncated or corrupt file is refused), made RGB
   (transparency composited on white, as transformers does), and preprocessed as
   the model's ``preprocessor_config.json`` says (:mod:`.image_processor`).
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import warnings
from collections.abc import Sequence

from runtime.frontend.preprocess.image_processor import ImageProcessorConfig, preprocess
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.images import (
    DTYPE,
    ImageLimits,
    ImagePart,
    PreparedImage,
    image_hash,
)

FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP", "GIF": "GIF"}
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def sniff(data: bytes) -> str | None:
    """The format of ``data`` from its magic bytes (a key of :data:`FORMATS`), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def header_size(data: bytes, kind: str) -> tuple[int, int] | None:
    """(width, height) as the header declares it, read without Pillow; None when
    this reader cannot find it (Pillow's header-only open then tells)."""
    try:
        if kind == "PNG" and data[12:16] == b"IHDR":
            return struct.unpack(">II", data[16:24])
        if kind == "GIF":
            return struct.unpack("<HH", data[6:10])
        if kind == "WEBP":
            return _webp_size(data)
        if kind == "JPEG":
            return _jpeg_size(data)
    except struct.error:
        return None
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X":
        width = int.from_bytes(data[24:27], "little") + 1
        return width, int.from_bytes(data[27:30], "little") + 1
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and data[20:21] == b"\x2f":
        (bits,) = struct.unpack("<I", data[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The first SOF marker's size (segments skipped by their lengths)."""
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if 0xD0 <= marker <= 0xD8 or marker == 0x01:  # no length
            i += 2
            continue
        if marker in _SOF:
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return width, height
        if marker == 0xDA:  # scan data before any frame header
            return None
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        i += 2 + length
    return None


def gif_frames(data: bytes, stop_after: int) -> int:
    """A GIF's frames (image descriptors), counted by walking its blocks without
    decoding any; stops at ``stop_after`` (the count is then at least that)."""
    if len(data) < 13:
        return 0
    flags = data[10]
    i = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    frames = 0
    while i < len(data) and frames < stop_after:
        block = data[i]
        if block == 0x3B:  # trailer
            break
        if block == 0x21:  # extension: label, then sub-blocks
            i += 2
        elif block == 0x2C:  # image descriptor, local colour table, LZW code size
            if i + 10 > len(data):
                break
            frames += 1
            local = data[i + 9]
            i += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0) + 1
        else:
            break  # corrupt: Pillow's decoding tells
        while i < len(data) and data[i]:  # sub-blocks up to the terminator
            i += data[i] + 1
        i += 1
    return frames


def _frames(image, data: bytes, kind: str, limit: int) -> int:
    if kind == "GIF":
        return gif_frames(data, limit + 1)
    return int(getattr(image, "n_frames", 1))


def _refuse(where: str, message: str) -> RequestError:
    return RequestError(400, f"{where} {message}", where)


def _check_pixels(where: str, size: tuple[int, int], limits: ImageLimits, what: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise _refuse(where, f"is an image of {width} x {height} pixels: it has none")
    if width * height > limits.max_image_pixels:
        raise _refuse(
            where,
            f"{what} {width} x {height} = {width * height} pixels, over this server's limit "
            f"of {limits.max_image_pixels} pixels per image (--max-image-pixels)",
        )


def decode_image(part: ImagePart, limits: ImageLimits, processor: ImageProcessorConfig | None):
    """The part's image as an RGB ``PIL.Image`` (its first frame), every check of
    the module docstring passed; RequestError (400, naming ``part.param``) otherwise."""
    from PIL import Image

    where = part.param
    try:
        data = base64.b64decode(part.base64, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(where, "is not valid base64") from None
    kind = sniff(data)
    if kind is None:
        raise _refuse(where, "is not a PNG, JPEG, WebP or GIF image (the formats accepted)")
    declared = header_size(data, kind)
    if declared is not None:
        _check_pixels(where, declared, limits, "declares an image of")
    Image.MAX_IMAGE_PIXELS = limits.max_image_pixels  # Pillow refuses past twice this
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=[kind])
        except Image.DecompressionBombError:
            raise _refuse(
                where,
                f"declares more than {limits.max_image_pixels} pixels, this server's limit "
                "per image (--max-image-pixels)",
            ) from None
        except Exception as exc:  # a hostile header: whatever Pillow raises
            raise _refuse(where, f"cannot be read as a {FORMATS[kind]} image ({exc})") from None
        with image:
            _check_pixels(where, image.size, limits, "is an image of")
            frames = _frames(image, data, kind, limits.max_image_frames)
            if frames > limits.max_image_frames:
                raise _refuse(
                    where,
                    f"is an animated image of more than {limits.max_image_frames} frames, "
                    f"this server's limit (--max-image-frames; only the first is used)",
                )
            resized = processor.resized(*image.size) if processor is not None else None
            if resized is not None:
                _check_pixels(where, resized[::-1], limits, "would be resized to")
            try:
                image.seek(0)
                image.load()
                return _rgb(image)
            except Exception as exc:  # truncated, corrupt: whatever the decoder raises
                raise _refuse(
                    where, f"cannot be decoded as a {FORMATS[kind]} image ({exc})"
                ) from None


def _rgb(image):
    """RGB, transparency composited on white (transformers' ``convert_to_rgb``)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def prepare_images(
    parts: Sequence[ImagePart], limits: ImageLimits, processor: ImageProcessorConfig | None
) -> tuple[PreparedImage, ...]:
    """Every part decoded and checked; preprocessed into :class:`PreparedImage` when
    there is a ``processor`` (the served model takes images), else only checked
    (a text-only model refuses them after this)."""
    prepared = []
    for part in parts:
        rgb = decode_image(part, limits, processor)
        if processor is None:
            continue
        array = preprocess(rgb, processor)
        pixels = array.tobytes()
        prepared.append(
            PreparedImage(
                pixels=pixels,
                shape=tuple(array.shape),
                dtype=DTYPE,
                image_hash=image_hash(pixels, tuple(array.shape)),
                original_size=rgb.size,
                param=part.param,
            )
        )
    return tuple(prepared)
