"""Frame recordings: what the coordinator published and what rank 0 answered,
from start-up, for replay without a coordinator (``flare replay``).

A recording is a directory (created 0700; files 0600: frames carry prompts):

* ``meta.json``: the deployment (tensor-parallel size, the rank arguments, the
  model directory and a digest of its files), written by whoever starts the
  deployment (:func:`write_meta`);
* ``log.msgpack``: a stream of ``[kind, bytes]`` entries in the order they
  happened at the coordinator's channel: ``"report"`` (rank 0's catalog),
  ``"frame"`` (every published frame, the exact wire bytes) and
  ``"completion"`` (rank 0's completions).

Frames are stateful (slots, pages, pending tokens), so a recording starts at
start-up and replays from its first frame.  Reading decodes and validates every
entry with the transport's codec, as a rank would.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from runtime.private_files import make_private_dirs, open_private
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.codec import MAX_MESSAGE_BYTES, decode
from runtime.transport.completion import Completion
from runtime.transport.frame import Frame

LOG = "log.msgpack"
META = "meta.json"
KINDS = ("report", "frame", "completion")


class RecordingError(ValueError):
    """A recording that cannot be read (its path and why)."""


class FrameRecorder:
    """Appends entries to ``DIR/log.msgpack`` (the channel calls it; one thread).

    A recording replays from its first frame, so one run's frames appended to
    another's would not replay: a directory that already holds a recording is
    refused (:class:`RecordingError`), never appended to or overwritten."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        problem = recording_exists(self.directory)
        if problem is not None:
            raise RecordingError(problem)
        make_private_dirs(self.directory)
        self._file = os.fdopen(open_private(self.directory / LOG, truncate=False), "ab")
        self._packer = msgpack.Packer(use_bin_type=True)

    def write(self, kind: str, data: bytes) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self._file.write(self._packer.pack([kind, data]))
        self._file.flush()  # a recording is for failures: keep what happened on disk

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def recording_exists(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` cannot take a new recording (None: it can): it already
    holds one."""
    log_path = Path(directory) / LOG
    if log_path.exists():
        return (
            f"{directory} already holds a recording ({LOG}, {log_path.stat().st_size} bytes): "
            "give each recording a directory of its own, or remove that one"
        )
    return None


def model_digest(model_dir: str | os.PathLike) -> str:
    """SHA-256 over the model directory's config and weight files (names, sizes, config text)."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for path in sorted(root.iterdir()):
        if path.suffix in (".json", ".safetensors") and path.is_file():
            h.update(path.name.encode())
            h.update(str(path.stat().st_size).encode())
            if path.suffix == ".json":
                h.update(path.read_bytes())
    return h.hexdigest()


def write_meta(directory: str | os.PathLike, meta: dict[str, Any]) -> None:
    """``meta.json`` of a recording (the deployment's identity)."""
    path = Path(directory)
    make_private_dirs(path)
    with os.fdopen(open_private(path / META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


@dataclass(frozen=True)
class Recording:
    meta: dict[str, Any]
    report: CatalogReport | None
    frames: tuple[Frame, ...]
    completions: dict[int, Completion]  # rank 0's, by fence


def read_recording(directory: str | os.PathLike) -> Recording:
    path = Path(directory)
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
        data = (path / LOG).read_bytes()
    except (OSError, ValueError) as exc:
        raise RecordingError(f"{path}: not a frame recording ({exc})") from None
    unpacker = msgpack.Unpacker(use_list=True, raw=False, max_bin_len=MAX_MESSAGE_BYTES)
    unpacker.feed(data)
    report: CatalogReport | None = None
    frames: list[Frame] = []
    completions: dict[int, Completion] = {}
    for i, entry in enumerate(unpacker):
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in KINDS):
            raise RecordingError(f"{path / LOG}: entry {i} is not a [kind, bytes] pair")
        kind, blob = entry
        message = decode(blob)
        if kind == "report" and isinstance(message, CatalogReport):
            report = message
        elif kind == "frame" and isinstance(message, Frame):
            frames.append(message)
        elif kind == "completion" and isinstance(message, Completion):
            completions[message.fence] = message
        else:
            raise RecordingError(f"{path / LOG}: entry {i} holds a {type(message).__name__}")
    return Recording(meta, report, tuple(frames), completions)
