"""The serving flags of ``flare run``: the HTTP server's address, API limits (the
image limits among them: docs/serving.md, "Images"), and its reliability (drain on
SIGTERM, the queue limit, limits against hostile clients; docs/serving.md,
"Reliability").

The heartbeat flags (``--heartbeat-interval``, ``--heartbeat-timeout``) belong
to the liveness flags (flags/liveness.py); the frontend reads them too, for the
coordinator's heartbeat on the API channel.  HTTPS is a security flag
(flags/security.py).
"""

from __future__ import annotations

import argparse
import os

from runtime.cli.converters import (
    byte_count,
    mm_limits,
    nonnegative_int,
    nonnegative_seconds,
    port,
    positive_count,
    positive_int,
    positive_seconds,
)
from runtime.cli.flags.families import flag_group
from runtime.cli.flags.security import add_https_flags, https_options
from runtime.frontend.protocol.images import (
    DEFAULT_IMAGE_BYTES,
    DEFAULT_IMAGE_FRAMES,
    DEFAULT_IMAGE_PIXELS,
    DEFAULT_IMAGES_PER_PROMPT,
    ImageLimits,
)


def add_server_flags(run: argparse.ArgumentParser) -> None:
    """The address, the model name and the API's limits."""
    serving = flag_group(run, "serving")
    serving.add_argument("--host", metavar="HOST", default="127.0.0.1", help="HTTP bind address")
    serving.add_argument("--port", metavar="PORT", type=port, default=8000, help="HTTP port")
    serving.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id of the API (default: the directory name)",
    )
    serving.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template for /v1/chat/completions (default: the model directory's; "
        "without one a generic fallback, with a warning at start-up)",
    )
    serving.add_argument(
        "--max-choices-per-request",
        metavar="N",
        type=positive_int,
        default=1024,
        help="the most choices (prompts x n) one HTTP request may ask for",
    )
    add_image_flags(serving)


def add_image_flags(serving: argparse._ArgumentGroup) -> None:
    """The limits on a chat request's images (docs/serving.md, "Images"), each a 400
    naming it: runtime.frontend.protocol.images.ImageLimits."""
    serving.add_argument(
        "--limit-mm-per-prompt",
        metavar="JSON",
        type=mm_limits,
        default=DEFAULT_IMAGES_PER_PROMPT,
        help="vLLM's flag: the most images one request may hold, as '{\"image\": N}' or "
        f"image=N (0 refuses images; default {DEFAULT_IMAGES_PER_PROMPT})",
    )
    serving.add_argument(
        "--max-image-bytes",
        metavar="BYTES",
        type=byte_count,
        default=DEFAULT_IMAGE_BYTES,
        help="the largest image file a data URI may carry, checked from its base64 length "
        "before decoding (20MiB, 20971520; default 20MiB)",
    )
    serving.add_argument(
        "--max-image-pixels",
        metavar="N",
        type=positive_int,
        default=DEFAULT_IMAGE_PIXELS,
        help="the most pixels (width x height, read from the header before decoding, and "
        f"after the preprocessor's resize) of one image (default {DEFAULT_IMAGE_PIXELS}, "
        "4096 x 4096)",
    )
    serving.add_argument(
        "--max-image-frames",
        metavar="N",
        type=positive_int,
        default=DEFAULT_IMAGE_FRAMES,
        help="the most frames of an animated image (GIF, APNG, WebP), counted without "
        f"decoding them; only the first is used (default {DEFAULT_IMAGE_FRAMES})",
    )


def add_reliability_flags(run: argparse.ArgumentParser) -> None:
    """Drain, the queue limit, the hostile-client limits, then HTTPS (security)."""
    serving = flag_group(run, "serving")
    serving.add_argument(
        "--drain-timeout",
        metavar="SECONDS",
        type=nonnegative_seconds,
        default=0.0,
        help="on SIGTERM/SIGINT, refuse new requests (503 with Retry-After) and let open ones "
        "finish for up to SECONDS; those still open then end with finish_reason 'abort' "
        "(default 0: every open request ends with 'abort' at once); a second signal aborts now",
    )
    serving.add_argument(
        "--max-waiting-requests",
        metavar="N",
        type=nonnegative_int,
        default=None,
        help="answer 429 with Retry-After to a request whose choices would make the open ones "
        "exceed --max-concurrency + N (default: no limit)",
    )
    add_hostile_client_flags(serving)
    add_https_flags(run)


def add_hostile_client_flags(run: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The frontend's limits against hostile clients (docs/serving.md, "Hostile
    clients and limits")."""
    run.add_argument(
        "--max-connections",
        metavar="N",
        type=positive_count,
        default=None,
        help="hold at most N client connections: one more closes the connection that has "
        "waited longest for a request head (503), or gets the 503 itself when every "
        "connection has a request in progress (default: the open-file limit, raised to its "
        "hard value at start, less room for accepting and the process's own files; at most "
        "10000)",
    )
    run.add_argument(
        "--header-timeout",
        metavar="SECONDS",
        type=positive_seconds,
        default=10.0,
        help="close a connection whose request head is not complete SECONDS after it opened "
        "or its previous response ended (408; default 10)",
    )
    run.add_argument(
        "--preprocess-workers",
        metavar="N",
        type=nonnegative_int,
        default=2,
        help="processes that parse, validate and tokenize large request bodies (over 16 KiB, "
        "or chats costly to tokenize), so the event loop never stalls on them; 0: all in "
        "the frontend process (default 2)",
    )


def check_chat_template(path: str | None, parser: argparse.ArgumentParser) -> str | None:
    """``--chat-template``: a readable file, as an absolute path (None: none given)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        parser.error(f"--chat-template {path}: cannot be read ({reason}); give a Jinja file")
    return os.path.abspath(path)


def serving_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The ServeOptions fields of these flags, of HTTPS and of the heartbeat flags,
    checked: a flag given without its partner or naming an unreadable file fails
    naming it."""
    interval, timeout = args.heartbeat_interval, args.heartbeat_timeout  # liveness checks them
    return {
        "heartbeat_interval_s": float(interval),
        "heartbeat_timeout_s": float(timeout),
        "drain_timeout_s": float(args.drain_timeout),
        "max_waiting_requests": args.max_waiting_requests,
        **https_options(args, parser),
        "max_connections": args.max_connections,
        "header_timeout_s": float(args.header_timeout),
        "preprocess_workers": args.preprocess_workers,
        "image_limits": image_limits(args),
    }


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """The image flags as the frontend's limits (the server's and ``--image``'s)."""
    return ImageLimits(
        max_images_per_prompt=args.limit_mm_per_prompt,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        max_image_frames=args.max_image_frames,
    )
