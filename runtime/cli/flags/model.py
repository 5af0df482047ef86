"""The model flags of ``flare run``: the model directory, dtype, context and
execution mode, and which directory the command line names."""

from __future__ import annotations

import argparse
import os

from runtime.cli.converters import model_len
from runtime.cli.flags.families import flag_group
from runtime.deploy.config import DTYPES
from runtime.ranks.memory import MIN_CONTEXT


def add_model_flags(run: argparse.ArgumentParser) -> None:
    model = flag_group(run, "model")
    model.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="Hugging Face style model directory, as --model (default: the "
        "embedded model, created on first use)",
    )
    model.add_argument(
        "--model",
        metavar="DIR",
        help="model directory (default: the embedded model); the same as MODEL_DIR",
    )
    model.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="auto",
        help="weights and activations; auto is bfloat16 on CUDA and float32 on CPU",
    )
    model.add_argument(
        "--max-model-len",
        metavar="N",
        type=model_len,
        help=f"context limit, >= {MIN_CONTEXT} (default: the model's max_position_embeddings)",
    )
    model.add_argument(
        "--enforce-eager",
        "--no-cuda-graphs",
        dest="enforce_eager",
        action="store_true",
        help="run programs eagerly, without CUDA graphs (--no-cuda-graphs is an alias)",
    )


def model_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, str]:
    """The model directory and how the command line named it (for messages); with
    ``--image`` and no directory, the embedded vision model."""
    positional, flag = args.model_dir, args.model
    if (
        positional is not None
        and flag is not None
        and os.path.realpath(positional) != os.path.realpath(flag)
    ):
        parser.error(
            f"MODEL_DIR {positional} and --model {flag} name different directories; "
            "give one of them"
        )
    if positional is not None:
        return positional, f"MODEL_DIR {positional}"
    if flag is not None:
        return flag, f"--model {flag}"
    if getattr(args, "image", None):  # --image: the embedded vision model
        from runtime.cli.flags.vision import default_vision_dir

        path = default_vision_dir()
        return path, f"the default vision model {path}"
    from runtime.ranks.model import default_model_dir

    path = str(default_model_dir())
    return path, f"the default model {path}"
