"""A vision model's prompt: each image's placeholder in the rendered chat prompt
becomes the model's image token, repeated once per feature row of the image
(:func:`expand_images`), and each image's tokens an
:class:`~runtime.image_spans.ImageSpan` (:func:`image_spans`).

The placeholder is ``IMAGE_PLACEHOLDER`` (``<image>``): the text an ``image_url``
part leaves in its message, or what a template that renders content parts writes
for an ``{"type": "image"}`` part (LLaVA's does).  The rendered prompt must hold
exactly one per image (a client cannot type it: :func:`chat_messages` refuses it in
text), else a 400 naming ``messages``.

Tokenizing: when the tokenizer knows the placeholder as the image token (LLaVA's
tokenizers add ``<image>`` as a special token), the prompt is encoded whole and each
image token repeated: the ids transformers' ``LlavaProcessor`` gives, which repeats
the placeholder in the text before encoding it.  Otherwise the text between the
placeholders is encoded piece by piece (the special tokens, a BOS, only around the
whole), so that a placeholder never becomes ordinary text tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.frontend.preprocess.image_tokens import ImageTokens
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.images import IMAGE_PLACEHOLDER, PreparedImage
from runtime.frontend.protocol.requests import Encoder
from runtime.image_spans import ImageSpan
from runtime.transport.codec import MAX_MESSAGE_BYTES

SUBMIT_BYTES_PER_TOKEN = 5  # a msgpack int up to 2**31 - 1
SUBMIT_OVERHEAD_BYTES = 64 << 10  # the other fields, each image's span and shape


def expand_images(
    text: str,
    count: int | None,
    tokens: ImageTokens,
    tokenizer: Encoder,
    special: bool,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``text``'s token ids, each placeholder as ``tokens.tokens_per_image`` image
    tokens, and each image's first position.  ``count``: the images the request
    has (None: whatever the text holds, for a partial conversation's anchors)."""
    found = text.count(IMAGE_PLACEHOLDER)
    if count is not None and found != count:
        raise RequestError(
            400,
            f"the chat template rendered {found} image placeholders ({IMAGE_PLACEHOLDER!r}) "
            f"for the request's {count} images: each image_url part must reach the prompt "
            "once (the template must render image parts)",
            "messages",
        )
    image = tokens.image_token_id
    ids = tokenizer.encode(text, add_special_tokens=special)
    if ids.count(image) != found:  # the tokenizer does not know it: tokenize around it
        ids = _around(text.split(IMAGE_PLACEHOLDER), image, tokenizer, special)
    out: list[int] = []
    starts: list[int] = []
    per = tokens.tokens_per_image
    for token in ids:
        if token == image:
            starts.append(len(out))
            out.extend([image] * per)
        else:
            out.append(token)
    return tuple(out), tuple(starts)


def _around(pieces: Sequence[str], image: int, tokenizer: Encoder, special: bool) -> list[int]:
    """The pieces between the placeholders encoded one by one, joined by the image
    token; with ``special``, what the tokenizer adds before and after a text (a BOS)
    goes before the first piece and after the last."""
    encoded = [tokenizer.encode(piece, add_special_tokens=False) for piece in pieces]
    if any(image in ids for ids in encoded):
        raise RequestError(
            400,
            "the chat template's text encodes to the image token outside an image's place",
            "messages",
        )
    lead: list[int] = []
    trail: list[int] = []
    if special:
        lead, _ = _added(pieces[0], tokenizer)
        _, trail = _added(pieces[-1], tokenizer)
    out = list(lead)
    for i, ids in enumerate(encoded):
        if i:
            out.append(image)
        out.extend(ids)
    return out + trail


def _added(text: str, tokenizer: Encoder) -> tuple[list[int], list[int]]:
    """What encoding ``text`` with special tokens adds before and after its ids."""
    whole = tokenizer.encode(text, add_special_tokens=True)
    bare = tokenizer.encode(text, add_special_tokens=False)
    for k in range(len(whole) - len(bare) + 1):
        if whole[k : k + len(bare)] == bare:
            return whole[:k], whole[k + len(bare) :]
    return [], []


def image_spans(
    starts: Sequence[int],
    images: Sequence[PreparedImage],
    tokens: ImageTokens,
    dropped: int,
) -> tuple[ImageSpan, ...]:
    """Each image's span (its digest the image's hash) in the prompt after
    ``truncate_prompt_tokens`` dropped its first ``dropped`` tokens; a 400 naming
    that field when they held an image token."""
    if starts and dropped > starts[0]:
        raise RequestError(
            400,
            f"truncate_prompt_tokens would cut the prompt's first {dropped} tokens, where an "
            f"image's tokens start at {starts[0]}: images are kept whole",
            "truncate_prompt_tokens",
        )
    per = tokens.tokens_per_image
    return tuple(
        ImageSpan(start - dropped, per, image.image_hash)
        for start, image in zip(starts, images, strict=True)
    )


def check_hand_off(images: Sequence[PreparedImage], prompt_len: int) -> None:
    """The request's Submit must fit the coordinator link's message limit: its
    images' pixels travel in it (a 400 naming ``messages`` otherwise)."""
    pixels = sum(len(image.pixels) for image in images)
    need = pixels + SUBMIT_BYTES_PER_TOKEN * prompt_len + SUBMIT_OVERHEAD_BYTES
    if need > MAX_MESSAGE_BYTES:
        raise RequestError(
            400,
            f"messages: the request's {len(images)} images hold {pixels} bytes of "
            f"preprocessed pixels; with its prompt that exceeds the {MAX_MESSAGE_BYTES} "
            "bytes one request may carry to the scheduler (send fewer images)",
            "messages",
        )
