"""A request's images on the frontend link (issue 27, Vision): Submit.images (each
image's span, digest and float32 pixels) round-trips as msgpack without pickle and
is refused on receipt, naming the field, for a wrong digest, pixels that are not
their shape, a span past the prompt, overlapping spans, a span over text tokens,
too many images; and what the coordinator's submission path makes of them."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from runtime.catalog import GraphKind
from runtime.coordinator.engine.submission import RequestImages, check_images, spec_images
from runtime.image_spans import ImageSpan
from runtime.transport.api import Submit
from runtime.transport.codec import decode, encode
from runtime.transport.fields import ProtocolError
from runtime.transport.images import MAX_IMAGES, SubmitImage, pixel_digest, pixel_digest_input
from runtime.transport.schema import PROTOCOL_VERSION

IMAGE = 9  # the image token in these prompts


def image(start: int, length: int = 4, seed: int = 0, shape=(3, 4, 5)) -> SubmitImage:
    pixels = np.random.default_rng(seed).standard_normal(shape).astype(np.float32).tobytes()
    return SubmitImage(start, length, pixel_digest(pixels, shape), pixels, shape)


PROMPT = (1, *[IMAGE] * 4, 2, *[IMAGE] * 4, 3)  # images at 1 and 6


def submit(images=(), prompt=PROMPT) -> Submit:
    return Submit(7, prompt, 8, images=tuple(images))


def raw(body: dict) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": "Submit", "b": body}, use_bin_type=True)


def refused(body: dict) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(raw(body))
    return info.value


def test_images_round_trip_as_bytes_shape_and_dtype():
    message = submit([image(1), image(6, seed=1)])
    assert decode(encode(message)) == message
    wire = message.to_wire()["images"][0]
    assert set(wire) == {"start", "length", "digest", "pixels", "shape", "dtype"}
    assert isinstance(wire["pixels"], bytes) and wire["shape"] == [3, 4, 5]
    assert wire["dtype"] == "float32" and len(wire["pixels"]) == 3 * 4 * 5 * 4
    assert message.images[0].span == ImageSpan(1, 4, message.images[0].digest)
    assert decode(encode(submit())).images == ()


def test_the_digest_is_the_frontends_image_hash():
    from runtime.frontend.protocol.images import image_hash
    from runtime.frontend.protocol.images import pixel_digest_input as frontend_input

    one = image(1)
    assert frontend_input is pixel_digest_input
    assert image_hash(one.pixels, one.shape) == one.digest


def test_a_submit_with_malformed_images_is_refused_naming_the_field():
    good = submit([image(1), image(6, seed=1)]).to_wire()
    first, second = good["images"]
    cases = [
        ({**first, "digest": pixel_digest(b"\0" * 240, (3, 4, 5))}, "Submit.images[0].digest"),
        ({**first, "digest": "xyz"}, "Submit.images[0].digest"),
        ({**first, "pixels": first["pixels"][:-4]}, "Submit.images[0].pixels"),
        ({**first, "shape": [3, 4, 6]}, "Submit.images[0].pixels"),
        ({**first, "shape": [3, 20]}, "Submit.images[0].shape"),
        ({**first, "dtype": "float16"}, "Submit.images[0].dtype"),
        ({**first, "pixels": "text"}, "Submit.images[0].pixels"),
        ({**first, "extra": 1}, "Submit.images[0].extra"),
    ]
    for bad, field in cases:
        error = refused({**good, "images": [bad, second]})
        assert error.field == field, (field, error)
    assert refused({**good, "images": "no"}).field == "Submit.images"
    del good["images"]
    assert refused(good).field == "Submit.images"


def test_spans_must_lie_in_the_prompt_in_order_disjoint_over_the_image_token():
    one, two = image(1), image(6, seed=1)
    with pytest.raises(ProtocolError) as info:  # past the prompt's 11 tokens
        submit([one, image(8, seed=1)])
    assert info.value.field == "images[1].length" and "past the prompt" in info.value.reason
    with pytest.raises(ProtocolError) as info:  # overlapping
        submit([one, image(3, seed=1)])
    assert info.value.field == "images[1].start" and "previous span" in info.value.reason
    with pytest.raises(ProtocolError) as info:  # out of order
        submit([two, one])
    assert info.value.field == "images[1].start"
    with pytest.raises(ProtocolError) as info:  # over a text token
        submit([one, image(5, seed=1)])
    assert info.value.field == "images[1].start" and "image token" in info.value.reason
    prompt = (1, *[IMAGE] * 4, 2, *[IMAGE + 1] * 4, 3)  # two different "image tokens"
    with pytest.raises(ProtocolError, match="same id"):
        submit([one, two], prompt)
    # On receipt too, naming the image.
    body = submit([one, two]).to_wire()
    body["images"][1]["start"] = 3
    assert refused(body).field == "Submit.images[1].start"


def test_the_image_count_is_bounded():
    prompt = (IMAGE,) * (MAX_IMAGES + 1)
    one = image(0, 1, shape=(3, 1, 1))
    many = [SubmitImage(i, 1, one.digest, one.pixels, one.shape) for i in range(MAX_IMAGES + 1)]
    with pytest.raises(ProtocolError) as info:
        submit(many, prompt)
    assert info.value.field == "images"
    assert len(submit(many[:MAX_IMAGES], prompt).images) == MAX_IMAGES


# ------------------------------------------------------------------ the coordinator


def facts(*kinds: GraphKind):
    descriptors = tuple(SimpleNamespace(kind=kind) for kind in kinds)
    return SimpleNamespace(descriptors=descriptors, model_name="tiny-llava")


def test_the_engine_keeps_the_pixels_and_hands_the_spans_to_the_scheduler():
    images = submit([image(1), image(6, seed=1)]).images
    kept = check_images(images, PROMPT, facts(GraphKind.PREFILL, GraphKind.VISION))
    assert isinstance(kept, RequestImages) and kept.images == images
    assert kept.spans == tuple(i.span for i in images)
    pixels, shape = kept.pixels(1)
    assert pixels == images[1].pixels and shape == (3, 4, 5)
    assert spec_images(kept) == {"images": kept.spans}
    assert check_images((), PROMPT, facts()) is None and spec_images(None) == {}


def test_the_engine_refuses_images_it_cannot_run_naming_images():
    images = submit([image(1)]).images
    with pytest.raises(ValueError, match=r"^images: the deployment has no vision programs"):
        check_images(images, PROMPT, facts(GraphKind.PREFILL))
    with pytest.raises(ValueError, match=r"^images\[0\]\.length"):  # the Python API's input
        check_images(images, PROMPT[:3], facts(GraphKind.VISION))
    with pytest.raises(ValueError, match="images must be a sequence"):
        check_images(b"pixels", PROMPT, facts(GraphKind.VISION))  # type: ignore[arg-type]
