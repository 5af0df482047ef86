"""``flare run --prompt TEXT --image FILE ...``: a chat request whose user message
holds the images, in order, then the prompt text, prepared exactly as the HTTP
server's ``/v1/chat/completions`` prepares one (runtime/frontend: the image
limits, decoding with Pillow against hostile files, ``preprocessor_config.json``,
the chat template, ``<image>`` expanded into the model's image tokens), so a file
gets the server's refusals, each naming ``--image FILE`` instead of the JSON
field.  The prepared prompt ids and the images' ``SubmitImage`` go to the engine
(commands/prompt.py)."""

from __future__ import annotations

import argparse
import base64
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.images import ImageLimits

if TYPE_CHECKING:
    from runtime.deploy.config import DeploymentConfig
    from runtime.frontend.protocol.requests import GenerationRequest
    from runtime.ranks.memory import KVPool
    from runtime.ranks.model.config import ModelConfig
    from runtime.transport.images import SubmitImage

# Media types of the data URIs the files become (the decoder sniffs the bytes).
MEDIA_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
               ".webp": "image/webp", ".gif": "image/gif"}  # fmt: skip


@dataclass(frozen=True)
class ImageFile:
    """One ``--image`` file as read: its path as given and its bytes."""

    path: str
    data: bytes

    def data_uri(self) -> str:
        kind = MEDIA_TYPES.get(os.path.splitext(self.path)[1].lower(), "image/png")
        return f"data:{kind};base64,{base64.b64encode(self.data).decode('ascii')}"


def read_images(
    args: argparse.Namespace, parser: argparse.ArgumentParser, limits: ImageLimits
) -> tuple[ImageFile, ...]:
    """Every ``--image`` file's bytes, in order; a one-line error naming ``--image``
    and the path for a file that cannot be read or is over ``--max-image-bytes``
    (checked from its size, before reading it)."""
    paths = getattr(args, "image", None) or []
    if isinstance(paths, str):  # --config's [run] image = "FILE"
        paths = args.image = [paths]
    if paths and args.prompt is None:
        parser.error(
            "--image needs --prompt TEXT (the text after the images); the HTTP server takes "
            "images in chat requests' image_url parts"
        )
    files = []
    for path in paths:
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size > limits.max_image_bytes:
                    parser.error(
                        f"--image {path}: holds {size} bytes, over the limit of "
                        f"{limits.max_image_bytes} bytes per image (--max-image-bytes)"
                    )
                data = fh.read(limits.max_image_bytes + 1)
        except OSError as exc:
            parser.error(f"--image {path}: cannot be read ({exc.strerror or exc})")
        files.append(ImageFile(path, data))
    return tuple(files)


def chat_body(prompt: str, files: tuple[ImageFile, ...], max_tokens: int) -> dict:
    """The ``/v1/chat/completions`` body: one user message, the images then the text."""
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": f.data_uri()}} for f in files]
    parts.append({"type": "text", "text": prompt})
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens}


def refusal(exc: RequestError, files: tuple[ImageFile, ...]) -> str:
    """The frontend's refusal in command-line words: an image part's field as
    ``--image FILE``, the text part as ``--prompt``, ``max_tokens`` as ``--max-tokens``."""
    message = exc.message
    for i, f in enumerate(files):
        message = message.replace(f"messages[0].content[{i}].image_url.url", f"--image {f.path}")
    param = exc.param or ""
    if param.startswith("messages[0].content[") and param.endswith(".image_url.url"):
        return message
    text = f"messages[0].content[{len(files)}].text"
    if param == text:
        return message.replace(text, "--prompt")
    if param.startswith("max_tokens"):
        return f"--max-tokens: {message}"
    return f"--image: {message}"


def image_request(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    config: DeploymentConfig,
    model: ModelConfig,
    pool: KVPool | None,
    context: int,
) -> GenerationRequest:
    """``--prompt`` and ``--image`` prepared as the chat route prepares a request
    (runtime.frontend.preprocess.preparer.Preparer); every refusal one line naming
    the flag (``parser.error``)."""
    from runtime.cli.flags.serving import image_limits
    from runtime.frontend.chat import load_chat_template
    from runtime.frontend.defaults import load_generation_defaults
    from runtime.frontend.preprocess.image_tokens import load_vision
    from runtime.frontend.preprocess.preparer import Preparer
    from runtime.frontend.protocol.requests import ServingLimits
    from runtime.frontend.tokenizer import ModelTokenizer

    directory = config.model or ""
    try:
        tokenizer = ModelTokenizer.from_dir(directory)
        template = load_chat_template(directory, tokenizer, args.chat_template)
        defaults = load_generation_defaults(directory, tokenizer.eos_token_ids)
        vision = load_vision(directory)
    except ValueError as exc:  # names the file or the flag
        parser.error(f"{directory}: {exc}")
    if vision is None:
        parser.error(f"--image: {directory} does not accept images (it is a text-only model)")
    limits = ServingLimits(
        os.path.basename(os.path.normpath(directory)) or "model",
        model.vocab_size,
        context,
        kv_tokens=None if pool is None else pool.num_pages * config.page_size,
        images=image_limits(args),
        accepts_images=True,
        image_tokens=vision[0],
    )
    preparer = Preparer(limits, tokenizer, template, defaults, vision[1])
    files: tuple[ImageFile, ...] = args.image_files
    try:
        (request,) = preparer.run("chat", chat_body(args.prompt, files, args.max_tokens))
    except RequestError as exc:
        parser.error(refusal(exc, files))
    return request


def image_prompt(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    config: DeploymentConfig,
    model: ModelConfig,
    pool: KVPool | None,
    context: int,
) -> tuple[list[int], tuple[SubmitImage, ...]]:
    """The prompt ids (the images' tokens in place) and the images as the engine's
    ``submit`` takes them."""
    from runtime.frontend.server.generation import submit_images

    request = image_request(args, parser, config, model, pool, context)
    return list(request.prompt_token_ids), submit_images(request)
