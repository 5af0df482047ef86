"""What a deployment's processes must agree on at start-up: the model and the code.

Every rank computes a :class:`ModelIdentity` of the model directory it loaded
(and of its draft model, if any) and the :func:`code_version` of the code it
runs, and reports them in its catalog
(:class:`~runtime.transport.catalog_report.CatalogReport`); the coordinator computes
the same of its own model directory (the frontend tokenizes with the
coordinator's copy) and :func:`~runtime.coordinator.engine.startup.agree`
fails start-up naming the field and the parties that differ.

* ``config_digest``: SHA-256 of ``config.json`` (and ``generation_config.json``
  when present), each as canonical JSON (sorted keys, no whitespace), so a
  reformatted copy still agrees.
* ``tokenizer_digest``: SHA-256 of the bytes of ``tokenizer.json``,
  ``tokenizer_config.json`` and ``special_tokens_map.json`` (those present;
  "" when none is, as in a draft model's directory).
* ``weights_digest``: SHA-256 over every safetensors file's name, size and
  header (the 8-byte length and the JSON header: tensor names, dtypes, shapes
  and offsets); cheap, no tensor data is read.
* ``weights_full_digest``: optional (``--verify-weights``), SHA-256 of every
  byte of every safetensors file, streamed in chunks.

The directory's own name is not part of any digest: two copies of a model in
differently named directories agree.  A digest that is "" is unknown and not
compared (a coordinator's copy without weights).  :func:`code_version` is the package
version and a digest of this runtime's source (``runtime/**/*.py`` and
``kernels/**/*.py``), computed once per process.

Pure functions over files: no torch, so the coordinator imports this freely.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CHUNK_BYTES",
    "DEVICE_TYPES",
    "DIGEST_CHARS",
    "DTYPE_NAMES",
    "MAX_HEADER_BYTES",
    "ExpectedIdentity",
    "IdentityError",
    "ModelIdentity",
    "code_digest",
    "code_version",
    "collective_fingerprint",
    "combined_digest",
    "expected_identity",
    "is_digest",
    "loaded_identity",
    "model_identity",
    "package_version",
    "weight_files",
]

DIGEST_CHARS = 64  # a SHA-256 in lowercase hex
CHUNK_BYTES = 8 << 20  # the full weight hash reads this much at a time
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICE_TYPES = ("cpu", "cuda")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
INDEX_FILE = "model.safetensors.index.json"
ROOT = Path(__file__).resolve().parents[1]
SOURCE_PACKAGES = ("runtime", "kernels")

log = logging.getLogger("runtime.identity")


class IdentityError(ValueError):
    """A model directory's identity cannot be computed (a missing or broken file)."""


def is_digest(value: object) -> bool:
    """A SHA-256 in lowercase hex."""
    return (
        isinstance(value, str)
        and len(value) == DIGEST_CHARS
        and all(c in "0123456789abcdef" for c in value)
    )


@dataclass(frozen=True)
class ModelIdentity:
    """A model directory, as digests of its files (see the module docstring)."""

    config_digest: str
    tokenizer_digest: str  # "" when the directory holds no tokenizer files
    weights_digest: str  # "" when the directory holds no weights (a coordinator's copy)
    weights_full_digest: str = ""  # "" unless computed (--verify-weights)

    def __post_init__(self) -> None:
        if not is_digest(self.config_digest):
            raise IdentityError(
                f"config_digest must be a SHA-256 hex digest, got {self.config_digest!r}"
            )
        for name in ("tokenizer_digest", "weights_digest", "weights_full_digest"):
            value = getattr(self, name)
            if value != "" and not is_digest(value):
                raise IdentityError(f"{name} must be '' or a SHA-256 hex digest, got {value!r}")

    def fields(self) -> dict[str, str]:
        """The known digests by field name ("" ones left out: nothing to compare)."""
        names = ("config_digest", "tokenizer_digest", "weights_digest", "weights_full_digest")
        return {name: getattr(self, name) for name in names if getattr(self, name)}

    def combined(self) -> str:
        """One digest of all the fields (the draft model's single field in a report)."""
        return combined_digest(self.fields())


def combined_digest(fields: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(fields):
        h.update(f"{name}={fields[name]}\n".encode())
    return h.hexdigest()


def _update_framed(h: hashlib._Hash, name: str, data: bytes) -> None:  # type: ignore[name-defined]
    """Name and length before the bytes: no two file sets hash alike by shifting bytes."""
    h.update(f"{name}\0{len(data)}\0".encode())
    h.update(data)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise IdentityError(f"{path}: {exc.strerror or exc}") from None


def _canonical_json(path: Path) -> bytes:
    data = _read(path)
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IdentityError(f"{path}: not JSON ({exc})") from None
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def config_digest(model_dir: Path) -> str:
    if not (model_dir / "config.json").is_file():
        raise IdentityError(f"{model_dir} has no config.json")
    h = hashlib.sha256()
    for name in CONFIG_FILES:
        if (model_dir / name).is_file():
            _update_framed(h, name, _canonical_json(model_dir / name))
    return h.hexdigest()


def tokenizer_digest(model_dir: Path) -> str:
    """The digest, or "" when the directory has none of the tokenizer files."""
    present = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not present:
        return ""
    h = hashlib.sha256()
    for name in present:
        _update_framed(h, name, _read(model_dir / name))
    return h.hexdigest()


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order: those the index
    names, else every ``*.safetensors`` (as the loader reads them); [] if none."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(_read(index)).get("weight_map", {})
            names = sorted(set(weight_map.values()))
        except (ValueError, AttributeError, TypeError) as exc:
            raise IdentityError(f"{index}: cannot be read ({exc})") from None
        files = [model_dir / str(name) for name in names]
        for file in files:
            if not file.is_file():
                raise IdentityError(f"{INDEX_FILE} names {file.name}, which does not exist")
        return files
    return sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())


def _header(path: Path) -> tuple[int, bytes]:
    """(file size, the 8-byte header length + the JSON header) of a safetensors file."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            if len(prefix) < 8:
                raise IdentityError(f"{path}: not a safetensors file ({size} bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise IdentityError(
                    f"{path}: not a safetensors file (a header of {length} bytes in {size})"
                )
            return size, prefix + f.read(length)
    except OSError as exc:
        raise IdentityError(f"{path}: {exc.strerror or exc}") from None


def weights_digest(files: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        size, header = _header(path)
        h.update(f"{path.name}\0{size}\0".encode())
        _update_framed(h, "header", header)
    return h.hexdigest()


def weights_full_digest(files: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        try:
            with path.open("rb") as f:
                size = f.seek(0, 2)
                f.seek(0)
                h.update(f"{path.name}\0{size}\0".encode())
                while chunk := f.read(CHUNK_BYTES):
                    h.update(chunk)
        except OSError as exc:
            raise IdentityError(f"{path}: {exc.strerror or exc}") from None
    return h.hexdigest()


def model_identity(
    model_dir: str | Path, *, full_weights: bool = False, require_weights: bool = True
) -> ModelIdentity:
    """The identity of ``model_dir``; IdentityError naming the file that is missing or
    broken.  ``full_weights`` also hashes every weight byte (slow: the whole
    checkpoint is read).  Without ``require_weights`` a directory with no
    safetensors files gets ``weights_digest`` "" (a coordinator's copy of the
    config and the tokenizer)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise IdentityError(f"{root} is not a directory")
    files = weight_files(root)
    if not files and require_weights:
        raise IdentityError(f"no *.safetensors files in {root}")
    return ModelIdentity(
        config_digest=config_digest(root),
        tokenizer_digest=tokenizer_digest(root),
        weights_digest=weights_digest(files) if files else "",
        weights_full_digest=weights_full_digest(files) if files and full_weights else "",
    )


def package_version() -> str:
    """The installed flare-runtime version (``0+unknown`` from a bare checkout)."""
    try:
        return importlib.metadata.version("flare-runtime")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def code_digest(root: str | Path = ROOT) -> str:
    """SHA-256 over this runtime's source files (``runtime/**/*.py``,
    ``kernels/**/*.py`` under ``root``), by relative path, sorted."""
    root = Path(root)
    h = hashlib.sha256()
    paths = sorted(
        path
        for package in SOURCE_PACKAGES
        for path in (root / package).rglob("*.py")
        if "__pycache__" not in path.parts and path.is_file()
    )
    for path in paths:
        _update_framed(h, path.relative_to(root).as_posix(), _read(path))
    return h.hexdigest()


@functools.cache
def code_version() -> str:
    """``<package version>+src.<first 16 hex digits of code_digest()>``, once per process:
    two processes running different code (a changed file, another release) differ."""
    return f"{package_version()}+src.{code_digest()[:16]}"


@dataclass(frozen=True)
class ExpectedIdentity:
    """What the coordinator knows of the deployment, compared with every rank's report:
    its own model directory (``model``; a digest it could not compute, such as
    ``weights_digest`` of a copy without weights, is "" and not compared), its
    code and protocol versions.  The draft model is compared among the ranks
    only (the coordinator never reads it).  ``allow_code_mismatch`` turns a code
    version that differs into a warning."""

    model: ModelIdentity | None
    code_version: str
    protocol_version: int
    allow_code_mismatch: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, ModelIdentity):
            raise IdentityError(f"model must be a ModelIdentity or None, got {self.model!r}")
        if not isinstance(self.code_version, str) or not self.code_version:
            raise IdentityError(
                f"code_version must be a non-empty string, got {self.code_version!r}"
            )
        if type(self.protocol_version) is not int or self.protocol_version < 1:
            raise IdentityError(
                f"protocol_version must be an integer >= 1, got {self.protocol_version!r}"
            )
        if not isinstance(self.allow_code_mismatch, bool):
            raise IdentityError(
                f"allow_code_mismatch must be a bool, got {self.allow_code_mismatch!r}"
            )

    def fields(self) -> dict[str, str | int]:
        """The report fields the coordinator has a value for."""
        out: dict[str, str | int] = {
            "protocol_version": self.protocol_version,
            "code_version": self.code_version,
        }
        if self.model is not None:
            out.update(self.model.fields())
        return out


def loaded_identity(model: object) -> ModelIdentity:
    """An identity of a model already in memory, for a worker built without one
    (in-process tests and tools): the config's repr and the parameters' names,
    dtypes and shapes stand in for the files.  ``model`` is a torch module (duck
    typed: ``config`` and ``named_parameters()``)."""
    config = hashlib.sha256(repr(model.config).encode()).hexdigest()  # type: ignore[attr-defined]
    h = hashlib.sha256()
    for name, param in model.named_parameters():  # type: ignore[attr-defined]
        h.update(f"{name}\0{param.dtype}\0{tuple(param.shape)}\n".encode())
    return ModelIdentity(config_digest=config, tokenizer_digest="", weights_digest=h.hexdigest())


def expected_identity(
    model_dir: str | Path,
    protocol_version: int,
    *,
    verify_weights: bool = False,
    allow_code_mismatch: bool = False,
    unreadable_ok: bool = False,
) -> ExpectedIdentity:
    """The coordinator's side of the agreement: its own copy of the model (weights
    optional) and code.  With ``verify_weights`` it hashes its weights fully too,
    when it has them.  With ``unreadable_ok`` a directory whose identity cannot
    be computed is logged and left out (``model`` None: the ranks, which load
    it, say what is wrong with it); otherwise IdentityError."""
    try:
        model = model_identity(model_dir, full_weights=verify_weights, require_weights=False)
    except IdentityError as exc:
        if not unreadable_ok:
            raise
        log.warning("start-up agreement: the coordinator's model directory: %s", exc)
        model = None
    return ExpectedIdentity(
        model=model,
        code_version=code_version(),
        protocol_version=protocol_version,
        allow_code_mismatch=allow_code_mismatch,
    )


def collective_fingerprint(
    identity: ModelIdentity, draft: ModelIdentity | None, dtype: str
) -> bytes:
    """32 bytes the ranks compare among themselves before their first collective of
    model data (device profiling, graph capture): the config, the weights' shapes
    (headers) and the dtype decide whether those collectives line up."""
    h = hashlib.sha256()
    for value in (identity.config_digest, identity.weights_digest, dtype):
        h.update(f"{value}\n".encode())
    h.update((draft.combined() if draft is not None else "").encode())
    return h.digest()
