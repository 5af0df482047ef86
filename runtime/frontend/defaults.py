"""Request defaults from the model directory's ``generation_config.json``, as vLLM takes them.

A request field the client does not set (absent or null) takes, in this order:

1. the request's own value;
2. the model's ``generation_config.json`` entry, when the file has one;
3. flare's (and OpenAI's) default: ``temperature`` 1.0, ``top_p`` 1.0, ``top_k`` off,
   ``repetition_penalty`` 1.0 (off), ``max_tokens`` the rest of the context.

Entries read: ``temperature``, ``top_p``, ``top_k`` (0: off), ``repetition_penalty``,
``max_new_tokens`` (caps the default ``max_tokens``, as vLLM does) and ``eos_token_id``
(an int or a list). The model's EOS ids (``ModelTokenizer.eos_token_ids``: the
tokenizer's ``eos_token`` and the ``eos_token_id`` of ``config.json`` and
``generation_config.json``) end a choice like stop token ids unless the request sets
``ignore_eos``: a Llama 3 instruct model lists ``<|eot_id|>`` only there. Like vLLM,
``do_sample`` is not read (a file with ``do_sample: false`` and a temperature still
samples), and neither are entries flare has no use for (``min_p``, beam settings).
A value out of range fails at start-up, naming the file and the entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.frontend.tokenizer import TokenizerError, read_model_json

__all__ = ["GenerationDefaults", "load_generation_defaults"]

FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request gets for the fields it leaves out (flare's own defaults here).

    ``top_k`` -1 is off; ``max_tokens`` None is the rest of the context;
    ``eos_token_ids`` end a choice unless it sets ``ignore_eos``.  ``given``: the
    ``generation_config.json`` entries these came from, for the start-up log.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    given: tuple[str, ...] = ()


def load_generation_defaults(
    model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()
) -> GenerationDefaults:
    """The defaults of ``model_dir`` (see the module docstring); ``eos_token_ids``: the
    tokenizer's EOS ids, which already include the file's ``eos_token_id``.
    TokenizerError (a ValueError) naming the file and entry for a bad value."""
    raw = read_model_json(model_dir, FILE) or {}
    values: dict[str, Any] = {"eos_token_ids": tuple(eos_token_ids)}
    given = []
    for key, check in _ENTRIES.items():
        value = raw.get(key)
        if value is None:
            continue
        values["max_tokens" if key == "max_new_tokens" else key] = check(key, value)
        given.append(key)
    return GenerationDefaults(**values, given=tuple(given))


def _number(key: str, value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise TokenizerError(f"{FILE}: {key} must be a finite number, got {value!r}")
    return float(value)


def _temperature(key: str, value: Any) -> float:
    value = _number(key, value)
    if value < 0:
        raise TokenizerError(f"{FILE}: {key} must be >= 0, got {value}")
    return value


def _top_p(key: str, value: Any) -> float:
    value = _number(key, value)
    if not 0 < value <= 1:
        raise TokenizerError(f"{FILE}: {key} must lie in (0, 1], got {value}")
    return value


def _top_k(key: str, value: Any) -> int:
    if type(value) is not int or value < -1:
        raise TokenizerError(f"{FILE}: {key} must be an integer >= -1, got {value!r}")
    return -1 if value == 0 else value


def _repetition_penalty(key: str, value: Any) -> float:
    value = _number(key, value)
    if value <= 0:
        raise TokenizerError(f"{FILE}: {key} must be > 0, got {value}")
    return value


def _max_new_tokens(key: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise TokenizerError(f"{FILE}: {key} must be an integer >= 1, got {value!r}")
    return value


_ENTRIES = {
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _top_k,
    "repetition_penalty": _repetition_penalty,
    "max_new_tokens": _max_new_tokens,
}
