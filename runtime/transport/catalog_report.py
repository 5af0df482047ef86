"""Rank -> coordinator after capture: :class:`CatalogReport`, the prepared programs
and the model facts the ranks must agree on (protocol version 8 adds the start-up
identity of :mod:`runtime.identity`; protocol version 10 the vision feature
store)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.catalog import CatalogError, GraphDescriptor, validate_catalog
from runtime.identity import DEVICE_TYPES, DTYPE_NAMES, is_digest
from runtime.transport.fields import (
    INT32_MAX,
    INT64_MAX,
    MAX_WORLD_SIZE,
    ProtocolError,
    check_choice,
    check_fields,
    check_instances,
    check_int,
    check_seq,
    check_str,
    set_field,
)

MAX_DESCRIPTORS = 1 << 12

_DIGEST_FIELDS = (
    "config_digest",
    "tokenizer_digest",
    "weights_digest",
    "weights_full_digest",
    "draft_digest",
)
_REQUIRED_DIGESTS = ("config_digest", "weights_digest")


@dataclass(frozen=True)
class CatalogReport:
    """Rank -> coordinator after capture: the prepared programs and model facts.

    ``model_name`` is for display; the ranks must agree on the rest
    (``runtime/coordinator/engine/startup.py``): the identity fields are those
    of :mod:`runtime.identity` (digests are SHA-256 hex; "" = not computed),
    ``kv_page_bytes`` the KV cache bytes of one page on this rank (target and
    draft), ``draft_digest`` one digest of the draft model's identity ("" = no
    draft).

    Vision (protocol version 10, docs/vision.md "Rank programs"): the feature
    store the rank allocated at start-up, ``vision_windows`` windows of
    ``window_rows`` feature rows (store rows ``0 .. vision_windows *
    window_rows - 1``; a vision frame's ``image_base`` and a prompt frame's
    ``feature_rows`` address them), for images of ``image_tokens`` rows each;
    all three 0 for a text-only model.
    """

    rank: int
    world_size: int
    descriptors: tuple[GraphDescriptor, ...]
    vocab_size: int
    max_context: int
    page_size: int
    num_pages: int
    model_name: str
    kv_page_bytes: int
    dtype: str
    device_type: str
    protocol_version: int
    code_version: str
    config_digest: str
    tokenizer_digest: str
    weights_digest: str
    weights_full_digest: str
    draft_digest: str
    vision_windows: int = 0
    window_rows: int = 0
    image_tokens: int = 0

    def __post_init__(self) -> None:
        world_size = check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        check_int("rank", self.rank, 0, world_size - 1)
        descriptors = check_instances(
            "descriptors", self.descriptors, GraphDescriptor, MAX_DESCRIPTORS
        )
        if not descriptors:
            raise ProtocolError("descriptors", "a catalog needs at least one program")
        try:
            validate_catalog(list(descriptors))
        except CatalogError as exc:
            raise ProtocolError("descriptors", str(exc)) from None
        check_int("vocab_size", self.vocab_size, 1, INT32_MAX)
        check_int("max_context", self.max_context, 1, INT32_MAX)
        check_int("page_size", self.page_size, 1, INT32_MAX)
        check_int("num_pages", self.num_pages, 1, INT32_MAX)
        set_field(self, "model_name", check_str("model_name", self.model_name))
        set_field(self, "descriptors", descriptors)
        check_int("kv_page_bytes", self.kv_page_bytes, 0, INT64_MAX)
        set_field(self, "dtype", check_choice("dtype", self.dtype, DTYPE_NAMES))
        set_field(self, "device_type", check_choice("device_type", self.device_type, DEVICE_TYPES))
        check_int("protocol_version", self.protocol_version, 1, INT32_MAX)
        set_field(self, "code_version", check_str("code_version", self.code_version, 128))
        for name in _DIGEST_FIELDS:
            value = getattr(self, name)
            if not (is_digest(value) or (value == "" and name not in _REQUIRED_DIGESTS)):
                wanted = "a SHA-256 hex digest"
                if name not in _REQUIRED_DIGESTS:
                    wanted += " or ''"
                raise ProtocolError(name, f"must be {wanted}, got {value!r:.80}")
            set_field(self, name, str.__str__(value))
        self._check_vision()

    def _check_vision(self) -> None:
        windows = check_int("vision_windows", self.vision_windows, 0, INT32_MAX)
        rows = check_int("window_rows", self.window_rows, 0, INT32_MAX)
        tokens = check_int("image_tokens", self.image_tokens, 0, INT32_MAX)
        if not windows == rows == tokens == 0 and not 1 <= tokens <= rows:
            raise ProtocolError(
                "window_rows",
                f"a vision model's store needs windows >= 1 of at least one image's rows "
                f"({tokens}), got {windows} windows of {rows} rows",
            )
        if windows * rows > INT32_MAX:
            raise ProtocolError("vision_windows", f"{windows} x {rows} rows exceed {INT32_MAX}")

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "descriptors": [d.to_wire() for d in self.descriptors],
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "model_name": self.model_name,
            "kv_page_bytes": self.kv_page_bytes,
            "dtype": self.dtype,
            "device_type": self.device_type,
            "protocol_version": self.protocol_version,
            "code_version": self.code_version,
            **{name: getattr(self, name) for name in _DIGEST_FIELDS},
            "vision_windows": self.vision_windows,
            "window_rows": self.window_rows,
            "image_tokens": self.image_tokens,
        }

    @classmethod
    def from_wire(cls, data: Any) -> CatalogReport:
        fields = dict(check_fields(cls, data))
        descriptors = check_seq("descriptors", fields["descriptors"], MAX_DESCRIPTORS)
        parsed = []
        for i, item in enumerate(descriptors):
            try:
                parsed.append(GraphDescriptor.from_wire(item))
            except (CatalogError, TypeError, ValueError) as exc:
                raise ProtocolError(f"descriptors[{i}]", str(exc)) from None
        fields["descriptors"] = tuple(parsed)
        return cls(**fields)
