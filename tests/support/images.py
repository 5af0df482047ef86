"""Images for the image-intake tests, made here (no files, no network): small valid
ones of each format, and hostile ones (a truncated PNG, a PNG header declaring
100,000 x 100,000 pixels with none behind it, an animated GIF of many 1 x 1
frames), and the data URIs and chat bodies that carry them."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def picture(width: int = 48, height: int = 32, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels if channels > 1 else pixels[..., 0], mode)


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def png(width: int = 48, height: int = 32, seed: int = 0) -> bytes:
    return encoded(picture(width, height, seed))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` RGB pixels, followed by a
    few bytes of compressed data: the pixels are never allocated here."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def truncated_png() -> bytes:
    whole = png(64, 64, seed=3)
    return whole[: len(whole) // 2]


def animated_gif(frames: int) -> bytes:
    """An animated GIF of ``frames`` 1 x 1 frames (alternating colours, so none is merged)."""
    colours = [Image.new("P", (1, 1), i % 2) for i in range(frames)]
    for frame in colours:
        frame.putpalette([0, 0, 0, 255, 255, 255])
    return encoded(colours[0], "GIF", save_all=True, append_images=colours[1:], duration=10)


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_chat(*uris: str, text: str = "What is in this picture?", bare: bool = False) -> dict:
    """A chat body of one user message: the text, then one image part per URI (the
    ``image_url`` an object with ``url``, or with ``bare`` the URL string itself)."""
    parts: list[dict] = [{"type": "text", "text": text}]
    for uri in uris:
        parts.append({"type": "image_url", "image_url": uri if bare else {"url": uri}})
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
