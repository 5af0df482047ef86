"""The model's tokenizer for the frontend: text to token ids and back, BOS and EOS facts.

``ModelTokenizer.from_dir(model_dir)`` reads, through the ``tokenizers`` library only
(no transformers, no torch):

- ``tokenizer.json`` (required): the vocabulary, pre-tokenizer, decoder and the
  post-processor that adds special tokens when encoding, as Hugging Face's fast
  tokenizers do.
- ``tokenizer_config.json`` (optional): ``add_bos_token: true`` makes sure an encoded
  prompt starts with the BOS token even when ``tokenizer.json`` has no post-processor
  adding it (older Llama exports); ``bos_token`` / ``eos_token`` (a string or an
  ``{"content": ...}`` object) are the strings chat templates write.
- ``config.json`` and ``generation_config.json`` (optional): ``bos_token_id`` and
  ``eos_token_id`` (an int or a list). The EOS ids of all three files together are the
  ids that end a generation.

The embedded default model has only ``config.json`` and ``tokenizer.json``: no BOS is
added, ``<|bos|>``/``<|eos|>`` come from the ids in ``config.json``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

__all__ = ["ModelTokenizer", "TokenizerError", "read_model_json"]


class TokenizerError(ValueError):
    """A model directory whose tokenizer files are missing or malformed (names the file)."""


def read_model_json(model_dir: str | Path, name: str) -> dict[str, Any] | None:
    """The JSON object in ``model_dir/name``, or None when the file does not exist."""
    path = Path(model_dir) / name
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class ModelTokenizer:
    """A ``tokenizers.Tokenizer`` plus the BOS/EOS facts the frontend needs.

    ``add_bos_token``: encoding with special tokens makes sure the ids start with
    ``bos_token_id`` (the post-processor of ``tokenizer.json`` may already add it; it is
    never doubled). ``eos_token_ids``: every id that ends a generation.
    """

    backend: Tokenizer = field(repr=False)
    add_bos_token: bool = False
    bos_token_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelTokenizer:
        """Load ``model_dir`` as described in the module docstring."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"tokenizer.json not found in {model_dir}")
        backend = Tokenizer.from_file(str(path))
        tok_config = read_model_json(model_dir, "tokenizer_config.json") or {}
        config = read_model_json(model_dir, "config.json") or {}
        gen_config = read_model_json(model_dir, "generation_config.json") or {}

        add_bos = tok_config.get("add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise TokenizerError(
                f"tokenizer_config.json: add_bos_token must be true or false, got {add_bos!r}"
            )
        bos_token = _token_string("bos_token", tok_config.get("bos_token"))
        eos_token = _token_string("eos_token", tok_config.get("eos_token"))

        bos_ids = [
            *_token_ids("config.json bos_token_id", config.get("bos_token_id")),
            *_token_ids("generation_config.json bos_token_id", gen_config.get("bos_token_id")),
        ]
        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        if bos_id is None and bos_ids:
            bos_id = bos_ids[0]
            bos_token = bos_token or backend.id_to_token(bos_id)
        if add_bos and bos_id is None:
            raise TokenizerError(
                "tokenizer_config.json: add_bos_token is true but no BOS token is known "
                "(bos_token or bos_token_id)"
            )

        eos_ids = [
            *_token_ids("config.json eos_token_id", config.get("eos_token_id")),
            *_token_ids("generation_config.json eos_token_id", gen_config.get("eos_token_id")),
        ]
        if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
            eos_ids.insert(0, eos_id)
        eos_ids = list(dict.fromkeys(eos_ids))  # ordered, without repeats
        if eos_token is None and eos_ids:
            eos_token = backend.id_to_token(eos_ids[0])
        return cls(backend, add_bos, bos_id, bos_token, eos_token, tuple(eos_ids))

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added (special) tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound of the characters one token stands for: the longest
        vocabulary entry (byte-level entries are at least as long as their text)."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor's tokens
        and, if ``add_bos_token``, a leading BOS. Special-token strings inside ``text``
        (``<|eos|>``) become their ids, as in Hugging Face tokenizers."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``. Bytes that do not form complete UTF-8 characters
        decode to U+FFFD; ids outside the vocabulary decode to nothing."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _token_string(name: str, value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise TokenizerError(f"tokenizer_config.json: {name} must be a string, got {value!r}")


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    """An int or a list of ints (config files write both), as a tuple."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(type(v) is int and v >= 0 for v in items):
        raise TokenizerError(f"{name} must be a non-negative int or a list of them, got {value!r}")
    return tuple(items)
