"""The vision flags of ``flare run``: a vision model's feature store and vision
programs on every rank (``--vision-windows``, ``--vision-window-rows``,
``--max-vision-images``: the ranks' ``CapacityConfig``, docs/vision.md "Rank
programs"; text-only models ignore them), and ``--image FILE`` for ``--prompt``
(commands/image_prompt.py).  The image limits (``--limit-mm-per-prompt``,
``--max-image-bytes``, ...) are serving flags (flags/serving.py)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

from runtime.catalog import MAX_BATCH_CAPACITY
from runtime.cli.converters import int_in, nonnegative_int
from runtime.cli.flags.families import flag_group
from runtime.deploy.config import DeploymentConfig
from runtime.ranks.capacity import (
    DEFAULT_MAX_VISION_IMAGES,
    DEFAULT_VISION_WINDOWS,
    DEFAULT_WINDOW_IMAGES,
    CapacityError,
    VisionCapacity,
)

if TYPE_CHECKING:
    from runtime.ranks.model.config import ModelConfig

log = logging.getLogger("runtime.cli")

# DeploymentConfig's field names in a refusal, as flags.
VISION_FLAGS = {
    "vision_windows": "--vision-windows",
    "vision_window_rows": "--vision-window-rows",
    "max_vision_images": "--max-vision-images",
}


def add_vision_flags(run: argparse.ArgumentParser) -> None:
    """The feature store and vision programs of a vision model's ranks."""
    scheduling = flag_group(run, "scheduling")
    scheduling.add_argument(
        "--vision-windows",
        metavar="N",
        type=int_in(1),
        default=DEFAULT_VISION_WINDOWS,
        help="vision models: feature store windows per rank, each holding the encoded "
        "images of one request at a time (text-only models ignore it)",
    )
    scheduling.add_argument(
        "--vision-window-rows",
        metavar="ROWS",
        type=nonnegative_int,
        default=0,
        help="vision models: feature rows per window, at least one image's tokens; a "
        f"request's images beyond them wait for the next window (0: {DEFAULT_WINDOW_IMAGES} "
        "images' tokens)",
    )
    scheduling.add_argument(
        "--max-vision-images",
        metavar="N",
        type=int_in(1, MAX_BATCH_CAPACITY),
        default=DEFAULT_MAX_VISION_IMAGES,
        help="vision models: the most images one vision frame encodes; programs are "
        "prepared at every power of two through it",
    )


def add_image_flag(run: argparse.ArgumentParser) -> None:
    """``--image FILE`` (repeatable), the images of ``--prompt``."""
    generation = flag_group(run, "generation")
    generation.add_argument(
        "--image",
        metavar="FILE",
        action="append",
        default=None,
        help="--prompt: an image (PNG, JPEG, WebP or GIF) the user message holds before "
        "the prompt text; repeat for more, in order. Needs a vision model (default with "
        "--image: the embedded vision model)",
    )


def vision_config(args: argparse.Namespace) -> dict[str, object]:
    """The DeploymentConfig fields of the vision flags."""
    return {
        "vision_windows": args.vision_windows,
        "vision_window_rows": args.vision_window_rows,
        "max_vision_images": args.max_vision_images,
    }


def flag_message(text: str) -> str:
    """A DeploymentConfig refusal of a vision field in flag words."""
    for name, flag in VISION_FLAGS.items():
        if text.startswith(name):
            return flag + text[len(name) :]
    return text


def default_vision_dir() -> str:
    """The embedded vision model's directory (runtime/ranks/model/weights/vision)."""
    from runtime.ranks.model.default import WEIGHTS_DIR

    return os.fspath(WEIGHTS_DIR / "vision")


def check_vision(
    parser: argparse.ArgumentParser,
    config: DeploymentConfig,
    model: ModelConfig,
    named: str,
    images: bool,
) -> None:
    """A vision model's store must hold one image per window, and its largest
    prefill chunk one image (spans are atomic: an image longer is refused at
    admission): an error with ``--image`` (``images``), else a warning.  A
    text-only model given ``--image`` is refused; otherwise it ignores the flags."""
    vision = model.vision
    if vision is None:
        if images:
            parser.error(
                f"--image: {named} does not accept images (it is a text-only model); give a "
                "vision model (a LLaVA directory as MODEL_DIR or --model), or leave both out "
                "for the embedded vision model"
            )
        return
    per_image = vision.image_tokens_per_image
    try:
        VisionCapacity.of(config.vision_capacity(), per_image)
    except CapacityError as exc:
        parser.error(f"--vision-window-rows {config.vision_window_rows}: {exc} ({named})")
    context = config.max_model_len or model.max_position_embeddings
    if per_image > min(config.max_prefill_tokens, context):
        problem = (
            f"--max-prefill-tokens {config.max_prefill_tokens}: {named} makes every image "
            f"{per_image} prompt tokens, more than the largest prefill chunk; requests with "
            "images are refused (an image is never split between chunks)"
        )
        if images:
            parser.error(problem)
        log.warning(problem)
