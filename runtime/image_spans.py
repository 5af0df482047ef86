"""Image spans: where a prompt's image features sit, shared by the frontend and the
coordinator (no torch, no sockets).

The frontend expands each ``<image>`` placeholder into the model's image token,
repeated once per feature row the vision encoder produces for that image
(LLaVA: one per patch).  An :class:`ImageSpan` names those positions: the
prompt index of the first image token, how many there are (the image's feature
rows), and the sha256 of the preprocessed pixels (``PreparedImage.image_hash``),
which enters the prefix-cache key of every page the span touches, so the same
prompt with different images never shares KV.

The spec's rules over spans ("Prerequisites and completion"): an image span is
atomic (a prefill chunk holds it whole or not at all); whole images are grouped
into windows bounded by the prepared feature storage; vision programs populate
the active window before prefill may consume it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DIGEST_HEX = 64  # sha256, hex


class ImageSpanError(ValueError):
    """A span or a request's spans are malformed; the message names the field."""


@dataclass(frozen=True)
class ImageSpan:
    """One image's feature rows in a prompt: positions ``[start, start + length)``."""

    start: int
    length: int
    digest: str

    def __post_init__(self) -> None:
        for name in ("start", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ImageSpanError(f"{name} must be an integer, got {value!r}")
        if self.start < 0:
            raise ImageSpanError(f"start must be >= 0, got {self.start}")
        if self.length < 1:
            raise ImageSpanError(f"length must be >= 1, got {self.length}")
        digest = self.digest
        if (
            not isinstance(digest, str)
            or len(digest) != DIGEST_HEX
            or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise ImageSpanError(f"digest must be {DIGEST_HEX} lowercase hex digits, got {digest!r}")

    @property
    def end(self) -> int:
        return self.start + self.length


def check_spans(spans: Sequence[ImageSpan], prompt_len: int) -> tuple[ImageSpan, ...]:
    """``spans`` as a tuple, checked: in prompt order, disjoint, inside the prompt.
    The error names the span by index."""
    out = tuple(spans)
    previous_end = 0
    for i, span in enumerate(out):
        if not isinstance(span, ImageSpan):
            raise ImageSpanError(f"images[{i}]: expected an ImageSpan, got {type(span).__name__}")
        if span.start < previous_end:
            raise ImageSpanError(
                f"images[{i}]: starts at {span.start}, inside or before the previous span "
                f"(which ends at {previous_end})"
            )
        if span.end > prompt_len:
            raise ImageSpanError(
                f"images[{i}]: ends at {span.end}, past the prompt's {prompt_len} tokens"
            )
        previous_end = span.end
    return out


def windows(spans: Sequence[ImageSpan], capacity: int) -> tuple[tuple[int, int], ...]:
    """Whole-image windows: consecutive spans grouped greedily so that each
    window's feature rows fit ``capacity`` (the prepared feature storage).
    Returns each window's ``(first span index, end span index)``.  An image
    larger than the storage fits no window: :class:`ImageSpanError`."""
    if capacity < 1:
        raise ImageSpanError(f"feature storage must hold >= 1 row, got {capacity}")
    out: list[tuple[int, int]] = []
    first, rows = 0, 0
    for i, span in enumerate(spans):
        if span.length > capacity:
            raise ImageSpanError(
                f"images[{i}]: {span.length} feature rows exceed the window's {capacity}"
            )
        if rows + span.length > capacity:
            out.append((first, i))
            first, rows = i, 0
        rows += span.length
    if spans:
        out.append((first, len(spans)))
    return tuple(out)
