"""``python -m runtime.frontend.preprocess``: a preprocessing worker.  It loads the
tokenizer, the chat template and the defaults once (the first frame), then answers
each body frame on stdin with the validated request(s), the finished JSON of
/tokenize and /detokenize, or the RequestError, on stdout."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
from typing import Any

from runtime.frontend.chat import ChatTemplate
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.preprocess.image_processor import ImageProcessorConfig
from runtime.frontend.preprocess.limits import ROUTES
from runtime.frontend.preprocess.memory import TRIM_BODY_BYTES, release_memory, rss_bytes
from runtime.frontend.preprocess.preparer import Preparer, parse_json, render_json
from runtime.frontend.preprocess.wire import (
    FRAME,
    error_to_wire,
    from_wire,
    pack_frame,
    requests_to_wire,
    unpack_header,
)
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.tokenizer import ModelTokenizer

log = logging.getLogger("runtime.frontend")

WORKER_NICE = 10  # the workers' CPU priority below the frontend's, coordinator's and ranks'


def _read_frame(stream) -> tuple[dict[str, Any], bytes] | None:
    head = stream.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    size_head, size_payload = FRAME.unpack(head)
    header = unpack_header(stream.read(size_head))
    payload = stream.read(size_payload) if size_payload else b""
    if len(payload) < size_payload:
        return None
    return header, payload


def _write_frame(stream, header: dict[str, Any], payload: bytes = b"") -> None:
    for part in pack_frame(header, payload):
        stream.write(part)
    stream.flush()


def _handle(preparer: Preparer, route: Any, payload: bytes) -> tuple[dict[str, Any], bytes]:
    if route not in ROUTES:
        return {"error": error_to_wire(RequestError(500, "unknown route", None))}, b""
    try:
        result = preparer.run(route, parse_json(payload))
    except RequestError as exc:
        return {"error": error_to_wire(exc)}, b""
    if isinstance(result, dict):
        return {"json": True}, render_json(result)
    return {"requests": requests_to_wire(result)}, b""


def _image_processor(raw: Any) -> ImageProcessorConfig | None:
    return None if raw is None else from_wire(ImageProcessorConfig, raw)


def worker_main() -> int:
    """``python -m runtime.frontend.preprocess``: frames on stdin, answers on stdout."""
    from runtime.logs import basic_config

    basic_config(logging.WARNING, "[preprocess] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend ends it (EOF, or a kill)
    with contextlib.suppress(OSError):  # background work: the event loop and ranks go first
        os.nice(WORKER_NICE)
    stdin = sys.stdin.buffer
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, never into the answers
    sys.stdout = sys.stderr
    frame = _read_frame(stdin)
    if frame is None:
        return 0
    config, _ = frame
    try:
        tokenizer = ModelTokenizer.from_dir(config["model_dir"])
        preparer = Preparer(
            from_wire(ServingLimits, config["limits"]),
            tokenizer,
            from_wire(ChatTemplate, config["template"]),
            from_wire(GenerationDefaults, config["defaults"]),
            _image_processor(config.get("image_processor")),
        )
    except Exception as exc:
        _write_frame(stdout, {"ready": False, "error": str(exc)[:500]})
        return 1
    gc.collect()
    release_memory()
    _write_frame(stdout, {"ready": True, "rss": rss_bytes()})
    while True:
        frame = _read_frame(stdin)
        if frame is None:
            return 0
        header, payload = frame
        try:
            answer, out = _handle(preparer, header.get("route"), payload)
        except Exception as exc:  # a bug: one line, and the request gets a 500
            log.error("preparing a %s body failed: %r", header.get("route"), exc)
            answer, out = {"error": error_to_wire(RequestError(500, str(exc)[:300], None))}, b""
        big = len(payload) >= TRIM_BODY_BYTES or b"image_url" in payload  # decoded images
        del payload, frame
        if big:
            gc.collect()
            release_memory()
        answer["rss"] = rss_bytes()
        _write_frame(stdout, answer, out)
