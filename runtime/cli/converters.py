"""Every argument converter (an argparse ``type=``) of the command line, and its constants.

Each converter turns a flag's text into its value or raises
``argparse.ArgumentTypeError`` with the reason argparse prints after the flag:
``flare run: error: argument --port: must lie in 1..65535, got 0``.  The
messages differ between flag families (``must ...`` for most of ``flare run``,
``expected ...`` for the external-rank, liveness and ``flare bench`` flags): each
flag keeps its words, so the names below say what a converter accepts.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.catalog import PROMPT_ALIGNMENT
from runtime.deploy.devices import is_device
from runtime.loadgen.workload import Distribution, parse_distribution
from runtime.ranks.memory import MIN_CONTEXT, parse_bytes
from runtime.transport.recording import recording_exists

LOG_LEVELS = ("debug", "info", "warning", "error")
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")  # --device's metavar
TRACE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
MIN_TRACE_BYTES = 4096

Converter = Callable[[str], Any]


# ------------------------------------------------------------ "must ..." integers


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def int_in(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An integer >= ``low`` (and at most ``high``; ``why`` explains that bound)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}{why}, got {value}")
        return value

    return parse


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``low..high`` (the error names the range)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must lie in {low}..{high}, got {value}")
        return value

    return parse


positive_int = int_in(1)
nonnegative_int = int_in(0)
port = int_between(1, 65535)  # --port: an HTTP port
top_k = int_in(-1)  # -1: every token
model_len = int_in(MIN_CONTEXT)  # --max-model-len
trace_keep = int_between(0, 100)  # --trace-keep


def positive_count(text: str) -> int:
    """An integer >= 1; a negative one is refused as below 0 first (--max-connections)."""
    value = nonnegative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def prefill_tokens(text: str) -> int:
    """``--max-prefill-tokens``: a positive multiple of the prompt alignment."""
    value = positive_int(text)
    if value % PROMPT_ALIGNMENT:
        raise argparse.ArgumentTypeError(f"must be a multiple of {PROMPT_ALIGNMENT}, got {value}")
    return value


# ------------------------------------------------------------ "must ..." numbers


def number(low: float | None = None, strict: bool = False) -> Callable[[str], float]:
    """A finite float, optionally >= ``low`` (> ``low`` when ``strict``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if low is not None and (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {low:g}, got {value:g}"
            )
        return value

    return parse


positive_float = number(0.0, strict=True)
nonnegative_float = number(0.0)


def nonnegative_seconds(text: str) -> float:
    """A finite number of seconds >= 0 (--drain-timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (--header-timeout)."""
    value = nonnegative_seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1] (--gpu-memory-utilization)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text!r}")
    return value


# ------------------------------------------------------------ "expected ..." values


def expected_positive_float(text: str) -> float:
    """A finite number > 0, in the liveness flags' words (--heartbeat-*, --frame-watchdog-*)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def expected_positive_seconds(text: str) -> float:
    """A finite number of seconds > 0, in the external-rank flags' words."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text}")
    return value


def bind_port(text: str) -> int:
    """A port to bind, 0..65535 (0: any free port): the external-rank ports."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port lies in 0..65535, got {value}")
    return value


def expected(convert: Converter, ok: Callable[[Any], bool], need: str) -> Converter:
    """``convert`` the text, then require ``ok`` of the value; both errors read
    ``expected NEED, got 'TEXT'`` (the ``flare bench`` flags)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {need}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {need}, got {text!r}")
        return value

    return parse


expected_positive_int = expected(int, lambda v: v >= 1, "an integer >= 1")
positive_ms = expected(float, lambda v: 0 < v < math.inf, "a positive number of ms")
bench_seconds = expected(float, lambda v: 0 < v < math.inf, "a positive number of seconds")
request_rate = expected(float, lambda v: v > 0, "a positive rate in requests/s, or inf")
base_url = expected(
    lambda t: t.rstrip("/"), lambda v: v.startswith(("http://", "https://")), "an http(s) URL"
)


# ------------------------------------------------------------ structured values


def probabilities(text: str) -> tuple[float, ...]:
    """``S1,S2,...``: comma-separated numbers (--speculative-acceptance-prior)."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"comma-separated probabilities expected, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("at least one probability expected")
    return values


def device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (N >= 0), lower-cased."""
    value = text.strip().lower()
    if is_device(value):
        return value
    raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")


def kv_bytes(text: str) -> int:
    """``4294967296``, ``4GiB``, ``512MiB``: :func:`runtime.ranks.memory.parse_bytes`
    (the KV cache budget of ``--kv-cache-memory``)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def byte_count(text: str) -> int:
    """``20971520``, ``20MiB``: bytes, as :func:`kv_bytes` reads them (``--max-image-bytes``)."""
    return kv_bytes(text)


def mm_limits(text: str) -> int:
    """vLLM's ``--limit-mm-per-prompt``: ``{"image": N}`` (JSON) or ``image=N``; the
    images per request (N >= 0; 0 refuses every image). flare takes images only:
    another modality (video, audio) is refused."""
    raw = text.strip()
    if raw.startswith("{"):
        try:
            value = json.loads(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be JSON such as '{{\"image\": 4}}', got {text!r}"
            ) from None
    else:
        pairs = [item.partition("=") for item in raw.split(",") if item.strip()]
        if not pairs or any(not eq for _, eq, _ in pairs):
            raise argparse.ArgumentTypeError(
                f"must be JSON such as '{{\"image\": 4}}' or image=4, got {text!r}"
            )
        value = {k.strip(): _integer(v.strip()) for k, _, v in pairs}
    if not isinstance(value, dict) or set(value) != {"image"}:
        keys = sorted(value) if isinstance(value, dict) else value
        raise argparse.ArgumentTypeError(
            f'flare takes images only: give {{"image": N}}, got {keys!r}'
        )
    count = value["image"]
    if type(count) is not int or count < 0:
        raise argparse.ArgumentTypeError(f"image must be an integer >= 0, got {count!r}")
    return count


def trace_bytes(text: str) -> int:
    """``268435456``, ``256M``, ``256MiB``, ``1G``: bytes (binary units), >= 4096."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = raw[-1:] if raw[-1:] in TRACE_UNITS and raw[-1:] else ""
    digits = raw[: len(raw) - len(unit)]
    try:
        value = int(float(digits) * TRACE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a size in bytes such as 268435456 or 256M, got {text!r}"
        ) from None
    if value < MIN_TRACE_BYTES:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_TRACE_BYTES} bytes, got {text!r}")
    return value


def new_recording_dir(text: str) -> str:
    """``--record-frames``: a directory that holds no recording yet."""
    problem = recording_exists(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def prompts_file(path: str) -> tuple[str, ...]:
    """The non-blank lines of a file (``flare bench --prompts-file``)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {exc.strerror}") from None
    prompts = tuple(line for line in lines if line.strip())
    if not prompts:
        raise argparse.ArgumentTypeError(f"{path!r} holds no prompts")
    return prompts


def id_range(text: str) -> tuple[int, int]:
    """``LO:HI`` integers, 0 <= LO < HI (``flare bench --token-id-range``)."""
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        low, high = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI integers, got {text!r}") from None
    if not 0 <= low < high:
        raise argparse.ArgumentTypeError(f"need 0 <= LO < HI, got {text!r}")
    return low, high


def tokenizer_vocab(path: str) -> int:
    """The vocabulary size (added tokens included) of a ``tokenizer.json``, or of the
    one in a model directory (``flare bench --tokenizer``)."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    try:
        return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # tokenizers raises its own exception types
        raise argparse.ArgumentTypeError(f"cannot load {file}: {exc}") from None


def distribution(text: str) -> Distribution:
    """``N``, ``uniform:LO:HI`` or ``normal:MEAN:STD[:LO:HI]`` (``flare bench`` lengths)."""
    try:
        return parse_distribution(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
