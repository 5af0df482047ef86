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
            raise ImageSpanError(
                f"digest must be {DIGEST_HEX} lowercase hex digits, got {digest!r}"
            )

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


def fit_chunk(spans: Sequence[ImageSpan], position: int, tokens: int) -> int:
    """The most of ``tokens`` a prefill chunk starting at ``position`` may take
    without splitting an image span (atomic: whole or not at all): a chunk
    whose end falls strictly inside a span stops at that span's start (0 when
    the chunk starts at it and cannot hold it whole)."""
    end = position + tokens
    for span in spans:
        if span.start >= end:
            break
        if span.start < end < span.end:
            return max(0, span.start - position)
    return tokens


# A page key's value for an image position: above every token id, so that the
# same prompt tokens with different images never share a cached page.
_IMAGE_KEY_BASE = 1 << 256


def image_key(digest: str) -> int:
    """The prefix-cache content key of a position inside an image span: the
    span's whole sha256 digest (never a token id)."""
    return _IMAGE_KEY_BASE + int(digest, 16)


def keyed_tokens(tokens: Sequence[int], spans: Sequence[ImageSpan]) -> tuple[int, ...]:
    """``tokens`` with every position inside an image span replaced by
    :func:`image_key` of its digest: the content key of the prompt's pages
    (a page touching an image's positions hashes in its digest)."""
    if not spans:
        return tuple(tokens)
    out = list(tokens)
    for span in spans:
        key = image_key(span.digest)
        for p in range(span.start, min(span.end, len(out))):
            out[p] = key
    return tuple(out)


@dataclass(frozen=True)
class VisionStorage:
    """The prepared image-feature storage, sized at start-up and reported with
    the catalog: ``window_slots`` windows, each holding ``window_rows`` feature
    rows (a request's active window occupies one slot; a vision frame writes
    each image into its request's slot at compact offsets from zero);
    ``snapshot_rows`` private snapshot rows for requests whose images span
    several windows (0: one per request slot)."""

    window_slots: int
    window_rows: int
    snapshot_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("window_slots", "window_rows", "snapshot_rows"):
            value = getattr(self, name)
            least = 0 if name == "snapshot_rows" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ImageSpanError(f"{name} must be an integer >= {least}, got {value!r}")

    def to_wire(self) -> dict[str, int]:
        return {
            "window_slots": self.window_slots,
            "window_rows": self.window_rows,
            "snapshot_rows": self.snapshot_rows,
        }

    def describe(self) -> str:
        rows = self.snapshot_rows or "one per slot"
        return (
            f"vision storage: {self.window_slots} windows x {self.window_rows} feature rows, "
            f"snapshot rows {rows}"
        )
