"""Image intake (issue 27, Vision, Frontend), in process: image_url parts parsed and
their URLs checked, each limit's 400 naming it and the field, hostile images refused
before their pixels are decoded, the preprocessor equal to transformers'
``CLIPImageProcessor`` (its Pillow backend), prepared images across the workers'
wire with their spans (and malformed ones refused), the limits' flags, and a
text-only model's 400.  Image tokens in the prompt: test_image_tokens.py.
Against a real server: test_hostile_clients.py ("Hostile images")."""

from __future__ import annotations

import asyncio
import json

import msgpack
import numpy as np
import pytest
from fastapi.testclient import TestClient

from runtime.cli.app import build_parser
from runtime.cli.flags.serving import serving_options
from runtime.frontend.chat import load_chat_template
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.preprocess.image_processor import (
    ImageProcessorConfig,
    load_processor_config,
    preprocess,
    processor_config,
)
from runtime.frontend.preprocess.image_tokens import ImageTokens
from runtime.frontend.preprocess.images import decode_image, gif_frames, prepare_images
from runtime.frontend.preprocess.pool import PreprocessPool
from runtime.frontend.preprocess.preparer import Preparer
from runtime.frontend.preprocess.wire import WireError, requests_from_wire, requests_to_wire
from runtime.frontend.protocol.chat_completions import parse_chat
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.images import (
    IMAGE_PLACEHOLDER,
    NOT_ACCEPTED,
    ImageLimits,
    PreparedImage,
    image_part,
)
from runtime.frontend.protocol.requests import GenerationRequest, ServingLimits
from runtime.frontend.server.app import create_app
from runtime.frontend.server.state import Frontend
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.image_spans import ImageSpan
from runtime.ranks.model import default_model_dir
from tests.support.images import (
    animated_gif,
    data_uri,
    encoded,
    image_chat,
    picture,
    png,
    png_header,
    truncated_png,
)
from tests.support.scripted_client import MODEL, ScriptedClient

LLAVA = {  # llava-1.5's preprocessor_config.json, less its names
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


# A vision model's image tokens over the tiny tokenizer: <|pad|> (511) as the image
# token, (28 / 14)^2 = 4 tokens per image.
TINY_VISION = ImageTokens(image_token_id=511, image_size=28, patch_size=14)


def vision_limits(**images) -> ServingLimits:
    return ServingLimits(
        MODEL, 512, 4096, images=ImageLimits(**images), accepts_images=True,
        image_tokens=TINY_VISION,
    )  # fmt: skip


def refusal(call, *args) -> RequestError:
    with pytest.raises(RequestError) as info:
        call(*args)
    assert info.value.status == 400, info.value.message
    return info.value


# ------------------------------------------------------------------ the processor


def hf_processor(config: dict):
    from transformers.utils import logging

    logging.set_verbosity_error()
    try:  # transformers 5: the Pillow backend (CLIPImageProcessor wants torchvision)
        from transformers import CLIPImageProcessorPil as Processor
    except ImportError:  # transformers 4: CLIPImageProcessor is the Pillow one
        from transformers import CLIPImageProcessor as Processor
    return Processor(**config)


@pytest.mark.parametrize(
    "config",
    [
        LLAVA,
        {},  # CLIPImageProcessor's defaults: 224, bicubic
        {"size": {"height": 64, "width": 48}, "do_center_crop": False, "resample": 2,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        {"size": {"shortest_edge": 32}, "crop_size": {"height": 40, "width": 40}, "resample": 1},
        {"do_resize": False, "crop_size": {"height": 30, "width": 30}, "do_normalize": False},
    ],
)  # fmt: skip
def test_the_processor_equals_transformers_clip_image_processor(config):
    ours, theirs = processor_config(config), hf_processor(config)
    images = [picture(70, 50, 1), picture(120, 333, 2), picture(20, 20, 3), picture(17, 41, 4)]
    for image in images:
        got = preprocess(image, ours)
        want = theirs(images=image, return_tensors="np")["pixel_values"][0]
        assert got.dtype == np.float32 and got.shape == want.shape == (3, *ours.output_size(
            *image.size))  # fmt: skip
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_transparency_is_composited_on_white_as_transformers_does():
    rgba = picture(40, 30, 5, mode="RGBA")
    part = image_part({"image_url": data_uri(encoded(rgba))}, "m", ImageLimits())
    config = processor_config(LLAVA)
    got = preprocess(decode_image(part, ImageLimits(), config), config)
    want = hf_processor(LLAVA)(images=rgba, return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("size", {"longest_edge": 3}, "size must be"),
        ("size", {"shortest_edge": "336"}, "size.shortest_edge must be an integer"),
        ("crop_size", {"height": 3}, "crop_size must be"),
        ("resample", 9, "resample must be one of"),
        ("image_std", [0.5, 0, 0.5], "image_std must not hold 0"),
        ("image_mean", [0.5, 0.5], "image_mean must be a list of three"),
        ("do_normalize", "yes", "do_normalize must be true or false"),
        ("rescale_factor", 0, "rescale_factor must be > 0"),
        ("size", {"shortest_edge": 0}, "shortest_edge must be an int in 1..8192"),
    ],
)
def test_a_bad_preprocessor_config_fails_naming_the_field(tmp_path, field, value, words):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({**LLAVA, field: value}))
    with pytest.raises(ValueError, match=words) as info:
        load_processor_config(str(tmp_path))
    assert str(path) in str(info.value)


def test_a_model_without_a_preprocessor_config_has_none_and_old_int_sizes_read(tmp_path):
    assert load_processor_config(str(tmp_path)) is None
    old = processor_config({"size": 224, "crop_size": 224})
    assert (old.shortest_edge, old.crop_height, old.crop_width) == (224, 224, 224)


# ------------------------------------------------------------------ parts and limits


def test_image_parts_in_both_shapes_leave_a_placeholder_and_detail_is_ignored(tokenizer):
    config = processor_config(LLAVA)
    template = load_chat_template(default_model_dir(), tokenizer)
    body = image_chat(data_uri(png()), text="Describe")
    body["messages"][0]["content"].append(
        {"type": "image_url", "image_url": data_uri(png(9, 9, 1))}  # the bare string form
    )
    body["messages"][0]["content"][1]["image_url"]["detail"] = "high"
    preparer = Preparer(vision_limits(), tokenizer, template, GenerationDefaults(), config)
    (request,) = preparer.run("chat", body)
    assert request.prompt is not None and request.prompt.count(IMAGE_PLACEHOLDER) == 2
    assert [i.param for i in request.images] == [
        "messages[0].content[1].image_url.url",
        "messages[0].content[2].image_url",
    ]
    assert [i.original_size for i in request.images] == [(48, 32), (9, 9)]
    first = request.images[0]
    assert first.shape == (3, 336, 336) and first.hash_matches()
    np.testing.assert_array_equal(first.array(), preprocess(picture(48, 32), config))
    # The same pixels hash the same; other pixels do not.
    (again,) = preparer.run("chat", image_chat(data_uri(png())))
    (other,) = preparer.run("chat", image_chat(data_uri(png(seed=9))))
    assert again.images[0].image_hash == first.image_hash != other.images[0].image_hash


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("https://example.com/cat.png", "is a https URL: this server does not fetch"),
        ("http://example.com/cat.png", "is a http URL"),
        ("file:///etc/passwd", "is a file URL"),
        ("cat.png", "is not a data URI"),
        ("data:text/plain;base64,aGVsbG8=", "must be a base64 data URI of an image"),
        ("data:image/png,rawbytes", "must be a base64 data URI of an image"),
    ],
)
def test_a_url_that_is_not_an_image_data_uri_is_a_400_naming_the_field(url, words):
    error = refusal(
        image_part, {"image_url": {"url": url}}, "messages[0].content[1]", ImageLimits()
    )
    assert error.param == "messages[0].content[1].image_url.url" and words in error.message


def test_bytes_over_the_limit_are_refused_from_the_base64_length():
    limits = ImageLimits(max_image_bytes=1000)
    fits = data_uri(b"x" * 1000)
    assert image_part({"image_url": fits}, "p", limits).encoded_bytes() == 1000
    error = refusal(image_part, {"image_url": data_uri(b"x" * 1001)}, "p", limits)
    assert error.param == "p.image_url" and "1001 bytes" in error.message
    assert "limit of 1000 bytes per image (--max-image-bytes)" in error.message


def test_images_over_the_count_are_refused_before_any_is_decoded(tokenizer):
    template = load_chat_template(default_model_dir(), tokenizer)
    decoded = []
    body = image_chat(*[data_uri(b"not an image")] * 5)
    error = refusal(
        parse_chat, body, vision_limits(max_images_per_prompt=4), tokenizer, template, None,
        decoded.append,
    )  # fmt: skip
    assert error.param == "messages" and "at most 4 per request (--limit-mm-per-prompt)" in (
        error.message
    )
    assert decoded == []


# ------------------------------------------------------------------ hostile images


def hostile(data: bytes, processor: ImageProcessorConfig | None = None, **limits) -> RequestError:
    part = image_part({"image_url": {"url": data_uri(data)}}, "m[0].content[1]", ImageLimits())
    return refusal(decode_image, part, ImageLimits(**limits), processor)


def test_hostile_images_are_refused_naming_the_field_and_the_reason():
    field = "m[0].content[1].image_url.url"
    cases = [
        (truncated_png(), "cannot be decoded as a PNG image"),
        (png_header(100_000, 100_000), "declares an image of 100000 x 100000 = 10000000000 "
         "pixels, over this server's limit of 16777216 pixels per image (--max-image-pixels)"),
        (b"MZ\x90\x00 not an image at all", "is not a PNG, JPEG, WebP or GIF image"),
        (animated_gif(1000), "is an animated image of more than 32 frames, this server's "
         "limit (--max-image-frames"),
        (encoded(picture(8, 8), "BMP"), "is not a PNG, JPEG, WebP or GIF image"),
        (png_header(0, 5), "is an image of 0 x 5 pixels: it has none"),
    ]  # fmt: skip
    for data, words in cases:
        error = hostile(data)
        assert error.param == field and words in error.message, error.message


def test_a_decompression_bomb_is_refused_by_its_header_in_every_format():
    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):
        error = hostile(encoded(picture(64, 64), fmt), max_image_pixels=64 * 64 - 1)
        assert "declares an image of 64 x 64 = 4096 pixels" in error.message, (fmt, error)


def test_an_extreme_aspect_ratio_is_refused_before_its_resize():
    thin = encoded(Image_new(4000, 1))
    error = hostile(thin, processor_config(LLAVA))
    assert "would be resized to 1344000 x 336" in error.message, error.message
    assert decode_image(
        image_part({"image_url": data_uri(thin)}, "p", ImageLimits()), ImageLimits(), None
    ).size == (4000, 1)  # without a resize it is a small image


def Image_new(width: int, height: int):
    from PIL import Image

    return Image.new("RGB", (width, height), (10, 20, 30))


def test_frames_are_counted_without_decoding_and_the_first_is_used():
    assert gif_frames(animated_gif(1000), 33) == 33  # stops past the limit
    assert gif_frames(animated_gif(5), 33) == 5
    image = decode_image(
        image_part({"image_url": data_uri(animated_gif(5))}, "p", ImageLimits()),
        ImageLimits(max_image_frames=5),
        None,
    )
    assert image.size == (1, 1) and image.getpixel((0, 0)) == (0, 0, 0)  # frame 0's colour


def test_every_accepted_format_decodes():
    for fmt, extra in (("PNG", {}), ("JPEG", {"quality": 95}), ("WEBP", {"lossless": True}),
                       ("GIF", {})):  # fmt: skip
        part = image_part({"image_url": data_uri(encoded(picture(30, 20), fmt, **extra))}, "p",
                          ImageLimits())  # fmt: skip
        image = decode_image(part, ImageLimits(), None)
        assert image.mode == "RGB" and image.size == (30, 20), fmt


# ------------------------------------------------------------------ a text-only model


def text_only_frontend(tokenizer: ModelTokenizer) -> TestClient:
    template = load_chat_template(default_model_dir(), tokenizer)
    fe = Frontend(
        ScriptedClient([]), tokenizer, template, ServingLimits(MODEL, 512, 4096),
        ServingMetrics(MODEL),
    )  # fmt: skip
    return TestClient(create_app(fe))


def test_a_valid_image_on_a_text_only_model_is_a_400_after_intake(tokenizer):
    with text_only_frontend(tokenizer) as http:
        r = http.post("/v1/chat/completions", json=image_chat(data_uri(png())))
        assert r.status_code == 400 and r.json()["error"]["message"] == NOT_ACCEPTED, r.text
        assert r.json()["error"]["param"] == "messages[0].content[1].image_url.url"
        # Intake still runs first: a hostile image is refused for what it is.
        r = http.post("/v1/chat/completions", json=image_chat(data_uri(truncated_png())))
        assert r.status_code == 400 and "cannot be decoded" in r.json()["error"]["message"]
        r = http.post("/tokenize", json={"messages": image_chat(data_uri(png()))["messages"]})
        assert r.status_code == 400 and r.json()["error"]["message"] == NOT_ACCEPTED
        assert r.json()["error"]["param"] == "messages[0].content[1]"


# ------------------------------------------------------------------ the wire


def prepared() -> PreparedImage:
    config = processor_config({**LLAVA, "size": {"shortest_edge": 8},
                               "crop_size": {"height": 8, "width": 6}})  # fmt: skip
    part = image_part({"image_url": data_uri(png(12, 10))}, "messages[0].content[0]", ImageLimits())
    (image,) = prepare_images([part], ImageLimits(), config)
    return image


def test_prepared_images_cross_the_wire_unchanged_and_malformed_ones_are_refused(tokenizer):
    limits = vision_limits(max_images_per_prompt=2)
    image = prepared()
    assert image.shape == (3, 8, 6) and len(image.pixels) == 3 * 8 * 6 * 4
    spans = (ImageSpan(1, 4, image.image_hash), ImageSpan(6, 4, image.image_hash))
    prompt = (1, *[511] * 4, 2, *[511] * 4, 3)
    req = GenerationRequest(MODEL, prompt, "text", 4, images=(image, image), image_spans=spans)
    wire = msgpack.unpackb(msgpack.packb(requests_to_wire([req])), raw=False)
    assert wire[0]["images"][0]["pixels"] == image.pixels  # raw bytes, no pickle
    assert requests_from_wire(wire, limits) == [req]
    bad_spans = [
        [wire[0]["image_spans"][0]],  # one span for two images
        [{**wire[0]["image_spans"][0], "digest": "0" * 64}] * 2,  # not the image's hash
        [wire[0]["image_spans"][0]] * 2,  # overlapping
        [wire[0]["image_spans"][0], {**wire[0]["image_spans"][1], "start": 8}],  # past the end
        [wire[0]["image_spans"][0], {**wire[0]["image_spans"][1], "start": 5}],  # over a text token
    ]
    for bad in bad_spans:
        with pytest.raises(WireError, match="image_spans"):
            requests_from_wire([{**wire[0], "image_spans": bad}], limits)
    good = wire[0]["images"][0]
    bad_images = [
        {**good, "dtype": "float64"},
        {**good, "shape": np.array([3, 8, 7], dtype=np.int64).tobytes()},
        {**good, "shape": np.array([8, 6], dtype=np.int64).tobytes()},
        {**good, "pixels": good["pixels"][:-4]},
        {**good, "pixels": good["pixels"][:-4] + b"\0\0\0\0"},  # the hash no longer matches
        {**good, "image_hash": "0" * 63},
        {**good, "pixels": "text"},
        {**good, "extra": 1},
        "not a map",
    ]
    for bad in bad_images:
        with pytest.raises(WireError):
            requests_from_wire([{**wire[0], "images": [bad]}], limits)
    with pytest.raises(WireError):  # over the count
        requests_from_wire([{**wire[0], "images": [good] * 3}], limits)
    with pytest.raises(WireError):  # to a text-only model
        requests_from_wire(wire, ServingLimits(MODEL, 512, 4096))


@pytest.mark.process  # the pool's worker process
def test_a_worker_prepares_images_and_refuses_hostile_ones(tokenizer):
    template = load_chat_template(default_model_dir(), tokenizer)
    limits, config = vision_limits(max_image_frames=4), processor_config(LLAVA)

    async def run():
        pool = PreprocessPool(
            limits, template, GenerationDefaults(), str(default_model_dir()), 1,
            image_processor=config,
        )  # fmt: skip
        await pool.start()
        try:
            body = json.dumps(image_chat(data_uri(png()))).encode()
            (request,) = await pool.prepare("chat", body)
            np.testing.assert_array_equal(request.images[0].array(), preprocess(picture(), config))
            with pytest.raises(RequestError) as info:
                await pool.prepare(
                    "chat", json.dumps(image_chat(data_uri(animated_gif(9)))).encode()
                )
            assert "more than 4 frames" in info.value.message
            assert pool.replaced == 0
        finally:
            await pool.close()

    asyncio.run(run())


# ------------------------------------------------------------------ the flags


def run_args(*flags: str):
    parser = build_parser()
    return parser, parser.parse_args(["run", *flags])


def test_the_image_flags_reach_the_serving_options():
    parser, args = run_args(
        "--limit-mm-per-prompt", '{"image": 3}', "--max-image-bytes", "1MiB",
        "--max-image-pixels", "1000000", "--max-image-frames", "2",
    )  # fmt: skip
    options = serving_options(args, parser)
    assert options["image_limits"] == ImageLimits(3, 1 << 20, 1_000_000, 2)
    _, args = run_args("--limit-mm-per-prompt", "image=0")
    assert args.limit_mm_per_prompt == 0
    parser, args = run_args()
    assert serving_options(args, parser)["image_limits"] == ImageLimits()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--limit-mm-per-prompt", '{"video": 1}'], "flare takes images only"),
        (["--limit-mm-per-prompt", '{"image": -1}'], "image must be an integer >= 0"),
        (["--limit-mm-per-prompt", "{nope"], "must be JSON"),
        (["--limit-mm-per-prompt", "4"], "must be JSON such as"),
        (["--max-image-bytes", "lots"], "must be a byte count"),
        (["--max-image-pixels", "0"], "must be >= 1"),
        (["--max-image-frames", "-2"], "must be >= 1"),
    ],
)
def test_a_bad_image_flag_fails_naming_it(capsys, flags, words):
    with pytest.raises(SystemExit):
        run_args(*flags)
    err = capsys.readouterr().err
    assert f"argument {flags[0]}:" in err and words in err, err
