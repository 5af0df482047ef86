"""Image tokens in the prompt (issue 27, Vision, Frontend): which models take images
(a LLaVA ``config.json``: ImageTokens, checked naming the field), each image's
placeholder expanded into its image tokens as transformers' ``LlavaProcessor`` does
(1 and 2 images; a template that renders content parts and the string fallback; a
tokenizer that does not know ``<image>``), the spans, usage and the context counting
the image tokens, a placeholder typed by a client or lost by a template a 400
naming the field, truncation kept off the images, and the Submit a choice sends."""

from __future__ import annotations

import json
import os
from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient

from runtime.frontend.chat import ChatMessage, ChatTemplate, load_chat_template
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.preprocess.image_processor import load_processor_config, preprocess
from runtime.frontend.preprocess.image_tokens import (
    ImageTokens,
    image_tokens_from_config,
    load_vision,
    read_image_tokens,
)
from runtime.frontend.preprocess.preparer import Preparer
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.image_prompt import check_hand_off, expand_images
from runtime.frontend.protocol.images import IMAGE_PLACEHOLDER, NOT_ACCEPTED, ImageLimits
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.server.app import create_app
from runtime.frontend.server.state import Frontend
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir
from tests.support.images import data_uri, image_chat, picture, png
from tests.support.scripted_client import MODEL, ScriptedClient, script_for

# llava-hf's template (without transformers' {% generation %} tags): images first,
# then the text parts, of each message; it renders content parts itself.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
PROCESSOR = {
    "size": {"shortest_edge": 28},
    "crop_size": {"height": 28, "width": 28},
    "image_processor_type": "CLIPImageProcessor",
}
IMAGE_ID = 512  # <image>, added to the tiny tokenizer's 512


def llava_dir(path, strategy: str = "default", template: str | None = LLAVA_TEMPLATE) -> str:
    """A tiny LLaVA model directory as transformers saves it: LlavaConfig (CLIP
    28 / 14: 4 patches), the tiny tokenizer with <image> added, a CLIP processor."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    tok = Tokenizer.from_file(os.path.join(default_model_dir(), "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    assert tok.token_to_id("<image>") == IMAGE_ID
    tok.save(str(path / "tokenizer.json"))
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, vocab_size=IMAGE_ID + 1)  # fmt: skip
    LlavaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=IMAGE_ID,
        vision_feature_select_strategy=strategy,
    ).save_pretrained(str(path))  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return str(path)


def hf_llava_processor(model_dir: str, strategy: str = "default"):
    """transformers' LlavaProcessor over the same files; llava-hf's processor_config
    counts the CLS row (num_additional_image_tokens=1), as the model's encoder does."""
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.utils import logging

    logging.set_verbosity_error()
    try:
        from transformers import CLIPImageProcessorPil as Images
    except ImportError:  # transformers 4
        from transformers import CLIPImageProcessor as Images
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"))
    return LlavaProcessor(
        Images(**PROCESSOR), tokenizer, patch_size=14, vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,
    )  # fmt: skip


def vision_preparer(model_dir: str, max_context: int = 4096, **limits) -> Preparer:
    tokenizer = ModelTokenizer.from_dir(model_dir)
    vision = load_vision(model_dir)
    assert vision is not None
    serving = ServingLimits(
        MODEL, IMAGE_ID + 1, max_context, images=ImageLimits(**limits), accepts_images=True,
        image_tokens=vision[0],
    )  # fmt: skip
    template = load_chat_template(model_dir, tokenizer)
    return Preparer(serving, tokenizer, template, GenerationDefaults(), vision[1])


def refusal(call, *args) -> RequestError:
    with pytest.raises(RequestError) as info:
        call(*args)
    assert info.value.status == 400, info.value.message
    return info.value


# ------------------------------------------------------------------ which models


@pytest.mark.parametrize(("strategy", "per_image"), [("default", 4), ("full", 5)])
def test_a_saved_llava_config_gives_its_image_tokens(tmp_path, strategy, per_image):
    tokens = read_image_tokens(llava_dir(tmp_path, strategy))
    assert tokens == ImageTokens(IMAGE_ID, 28, 14, strategy)
    assert tokens.tokens_per_image == per_image
    # LLaVA-1.5: 336 / 14 = 24, 576 tokens per image (577 with the CLS row).
    assert ImageTokens(32000, 336, 14).tokens_per_image == 576
    assert ImageTokens(32000, 336, 14, "full").tokens_per_image == 577


def test_processor_config_must_count_image_tokens_as_the_encoder_writes_them(tmp_path):
    model_dir = llava_dir(tmp_path, "full")
    hf_llava_processor(model_dir, "full").save_pretrained(model_dir)  # transformers' own file
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["num_additional_image_tokens"] == 1
    vision = load_vision(model_dir)
    assert vision is not None and vision[0].tokens_per_image == 5
    for field, value, message in (
        ("num_additional_image_tokens", 0, "tokens is 0, but the CLIP encoder's CLS row gives 1"),
        ("patch_size", 7, "patch_size is 7, but config.json gives 14"),
        ("vision_feature_select_strategy", "default", "vision_feature_select_strategy is"),
    ):
        (tmp_path / "processor_config.json").write_text(json.dumps({**saved, field: value}))
        with pytest.raises(ValueError, match=message):
            load_vision(model_dir)
    (tmp_path / "processor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"processor_config\.json: cannot read JSON"):
        load_vision(model_dir)
    (tmp_path / "processor_config.json").unlink()  # absent: config.json alone decides
    assert load_vision(model_dir) is not None


def test_a_text_only_model_takes_no_images(tmp_path):
    assert read_image_tokens(default_model_dir()) is None
    assert load_vision(default_model_dir()) is None
    assert read_image_tokens(tmp_path) is None  # no config.json


LLAVA_CONFIG = {
    "model_type": "llava",
    "image_token_index": 32000,
    "vision_config": {"image_size": 336, "patch_size": 14},
    "text_config": {"model_type": "llama"},
}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"image_token_index": None}, "image_token_index (or image_token_id) is missing"),
        ({"image_token_index": -1}, "image_token_index must be an integer >= 0"),
        ({"image_token_index": "32000"}, "image_token_index must be an integer"),
        ({"vision_config": "clip"}, "vision_config must be an object"),
        ({"vision_config": {"patch_size": 14}}, "vision_config.image_size is missing"),
        ({"vision_config": {"image_size": 336}}, "vision_config.patch_size is missing"),
        ({"vision_config": {"image_size": 336, "patch_size": 0}},
         "vision_config.patch_size must be an integer >= 1"),
        ({"vision_config": {"image_size": 336, "patch_size": 15}},
         "vision_config.image_size (336) is not a multiple of vision_config.patch_size"),
        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy must be"),
    ],
)  # fmt: skip
def test_a_bad_llava_config_fails_naming_the_field(change, words):
    config = {**LLAVA_CONFIG, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError) as info:
        image_tokens_from_config(config)
    assert "config.json" in str(info.value) and words in str(info.value)


def test_image_token_id_is_read_too_and_any_llava_marker_counts():
    config = {**LLAVA_CONFIG, "image_token_id": 7}
    del config["image_token_index"]
    assert image_tokens_from_config(config) == ImageTokens(7, 336, 14)
    marked = {"architectures": ["LlavaForConditionalGeneration"], **LLAVA_CONFIG}
    del marked["model_type"]
    assert image_tokens_from_config(marked) is not None
    assert image_tokens_from_config({"model_type": "llama"}) is None


def test_the_preprocessor_must_give_the_encoders_image_size(tmp_path):
    model = llava_dir(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**PROCESSOR, "crop_size": {"height": 32, "width": 32}})
    )
    with pytest.raises(ValueError, match=r"output size is 32 x 32.*image_size is 28"):
        load_vision(model)
    os.remove(tmp_path / "preprocessor_config.json")
    with pytest.raises(ValueError, match=r"needs its preprocessor_config\.json"):
        load_vision(model)


# ------------------------------------------------------------------ expansion


def pictures(count: int):
    return [picture(40 + 7 * i, 30 + 5 * i, seed=i) for i in range(count)]


def chat_of(count: int, text: str = "Describe these") -> dict:
    from tests.support.images import encoded

    return image_chat(*[data_uri(encoded(p)) for p in pictures(count)], text=text)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("template", [LLAVA_TEMPLATE, None])  # parts, or the fallback
def test_expansion_equals_transformers_llava_processor(tmp_path, count, template):
    model = llava_dir(tmp_path, template=template)
    preparer = vision_preparer(model)
    (request,) = preparer.run("chat", chat_of(count))
    assert request.prompt is not None and request.prompt.count(IMAGE_PLACEHOLDER) == count
    want = hf_llava_processor(model)(
        text=request.prompt, images=pictures(count), return_tensors="np",
        add_special_tokens=preparer.template.add_special_tokens,
    )  # fmt: skip
    assert list(request.prompt_token_ids) == want["input_ids"][0].tolist()
    ids = request.prompt_token_ids
    assert ids.count(IMAGE_ID) == 4 * count
    spans = request.image_spans
    assert [s.length for s in spans] == [4] * count
    assert [s.digest for s in spans] == [i.image_hash for i in request.images]
    for span in spans:
        assert ids[span.start : span.end] == (IMAGE_ID,) * 4
    assert spans[-1].end <= len(ids) and all(a.end <= b.start for a, b in pairwise(spans))
    for image, pixels in zip(request.images, want["pixel_values"]):
        np.testing.assert_allclose(image.array(), pixels, atol=1e-5, rtol=0)


def test_the_full_strategy_counts_the_cls_row_as_the_processor_does(tmp_path):
    model = llava_dir(tmp_path, "full")
    (request,) = vision_preparer(model).run("chat", chat_of(2))
    want = hf_llava_processor(model, "full")(text=request.prompt, images=pictures(2))
    assert list(request.prompt_token_ids) == list(want["input_ids"][0])
    assert [s.length for s in request.image_spans] == [5, 5]


def test_images_sit_where_their_parts_are_with_the_string_template(tmp_path):
    preparer = vision_preparer(llava_dir(tmp_path, template=None))
    body = chat_of(2)
    parts = body["messages"][0]["content"]
    body["messages"][0]["content"] = [parts[1], {"type": "text", "text": "and"}, parts[2]]
    (request,) = preparer.run("chat", body)
    assert request.prompt == "<|user|>\n<image>\nand\n<image>\n<|assistant|>\n"
    first, second = request.image_spans
    between = request.prompt_token_ids[first.end : second.start]
    assert preparer.tokenizer.decode(between) == "\nand\n"


def test_a_tokenizer_without_the_image_token_is_tokenized_around_the_placeholder():
    tokenizer = ModelTokenizer.from_dir(default_model_dir())  # no <image> token
    vision = ImageTokens(511, 28, 14)
    text = "Look: <image> and <image>!"
    ids, starts_bare = expand_images(text, 2, vision, tokenizer, special=False)
    pieces = [tokenizer.encode(p, add_special_tokens=False) for p in text.split("<image>")]
    assert list(ids) == pieces[0] + [511] * 4 + pieces[1] + [511] * 4 + pieces[2]
    assert starts_bare == (len(pieces[0]), len(pieces[0]) + 4 + len(pieces[1]))
    # No ordinary token of "<image>" anywhere.
    assert tokenizer.encode("<image>", add_special_tokens=False)[0] not in ids
    # The special tokens (a BOS) go around the whole, once.
    bos = ModelTokenizer(tokenizer.backend, True, 509, "<|bos|>")
    with_bos, starts = expand_images(text, 2, vision, bos, special=True)
    assert with_bos == (509, *ids) and starts == (starts_bare[0] + 1, starts_bare[1] + 1)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("template", [LLAVA_TEMPLATE, None])
def test_a_typed_placeholder_is_a_400_naming_the_text(tmp_path, template):
    preparer = vision_preparer(llava_dir(tmp_path, template=template))
    error = refusal(preparer.run, "chat", chat_of(1, text="what is <image> here"))
    assert error.param == "messages[0].content[0].text" and "'<image>'" in error.message
    body = {"messages": [{"role": "system", "content": "x <image>"}, *chat_of(1)["messages"]]}
    error = refusal(preparer.run, "chat", body)
    assert error.param == "messages[0].content"
    # Typed with no image at all, too: it would be an image without pixels.
    body = {"messages": [{"role": "user", "content": "<image> hi"}]}
    assert refusal(preparer.run, "chat", body).param == "messages[0].content"


def test_a_template_that_loses_an_image_is_a_400_naming_messages(tmp_path):
    text_only = "{% for m in messages %}{% for c in m['content'] %}{{ c.get('text', '') }}" \
        "{% endfor %}{% endfor %}"  # fmt: skip
    preparer = vision_preparer(llava_dir(tmp_path, template=text_only))
    error = refusal(preparer.run, "chat", chat_of(2))
    assert error.param == "messages"
    assert "rendered 0 image placeholders ('<image>') for the request's 2 images" in error.message


def test_on_a_text_only_model_a_typed_placeholder_is_text():
    tokenizer = ModelTokenizer.from_dir(default_model_dir())
    limits = ServingLimits(MODEL, 512, 4096)
    template = load_chat_template(default_model_dir(), tokenizer)
    preparer = Preparer(limits, tokenizer, template, GenerationDefaults())
    (request,) = preparer.run("chat", {"messages": [{"role": "user", "content": "<image>"}]})
    assert request.image_spans == () and "<image>" in (request.prompt or "")
    error = refusal(preparer.run, "chat", image_chat(data_uri(png())))
    assert error.message == NOT_ACCEPTED


def test_the_context_counts_the_image_tokens(tmp_path):
    model = llava_dir(tmp_path)
    (request,) = vision_preparer(model).run("chat", chat_of(2))
    n = len(request.prompt_token_ids)  # 8 of them image tokens
    fits = vision_preparer(model, max_context=n + 2)
    assert fits.run("chat", {**chat_of(2), "max_tokens": 2})[0].prompt_token_ids == (
        request.prompt_token_ids
    )
    error = refusal(fits.run, "chat", {**chat_of(2), "max_tokens": 3})
    assert error.param == "max_tokens" and f"the prompt has {n} tokens" in error.message
    error = refusal(vision_preparer(model, max_context=n).run, "chat", chat_of(2))
    assert error.code == "context_length_exceeded"


def test_truncation_keeps_images_whole(tmp_path):
    preparer = vision_preparer(llava_dir(tmp_path, template=None))
    body = {**chat_of(1), "max_tokens": 2}
    body["messages"] = [{"role": "system", "content": "be brief " * 5}, *body["messages"]]
    (whole,) = preparer.run("chat", body)
    (span,) = whole.image_spans
    keep = len(whole.prompt_token_ids) - 3  # drops 3 system tokens
    (cut,) = preparer.run("chat", {**body, "truncate_prompt_tokens": keep})
    assert cut.prompt_token_ids == whole.prompt_token_ids[3:]
    assert cut.image_spans[0].start == span.start - 3
    into = len(whole.prompt_token_ids) - span.start - 1  # cuts the image's first token
    error = refusal(preparer.run, "chat", {**body, "truncate_prompt_tokens": into})
    assert error.param == "truncate_prompt_tokens" and "images are kept whole" in error.message


def test_images_that_would_not_fit_the_coordinator_link_are_a_400():
    big = SimpleNamespace(pixels=bytes(30 << 20))  # 30 MiB of pixels each
    check_hand_off([big], 4096)
    error = refusal(check_hand_off, [big, big, big], 4096)
    assert error.param == "messages" and "send fewer images" in error.message


def test_tokenize_counts_the_image_tokens_without_decoding(tmp_path):
    preparer = vision_preparer(llava_dir(tmp_path))
    body = chat_of(2)
    (request,) = preparer.run("chat", body)
    body["messages"][0]["content"][1]["image_url"]["url"] = data_uri(b"never decoded")
    counted = preparer.run("tokenize", {"messages": body["messages"]})
    assert counted["tokens"] == list(request.prompt_token_ids)


def test_parts_reach_a_parts_template_and_strings_become_a_text_part():
    template = ChatTemplate(LLAVA_TEMPLATE)
    assert template.renders_parts and not ChatTemplate("{{ messages[0]['content'] }}").renders_parts
    messages = [ChatMessage("user", "hi"),
                ChatMessage("user", "x\n<image>", (("text", "x"), ("image", "")))]  # fmt: skip
    assert template.render(messages) == "USER: hi USER: <image>\nx ASSISTANT:"


# ------------------------------------------------------------------ the hand-off


def test_a_choice_submits_its_images_and_usage_counts_their_tokens(tmp_path):
    model = llava_dir(tmp_path)
    preparer = vision_preparer(model)
    tokenizer = preparer.tokenizer
    client = ScriptedClient(script_for(tokenizer, "a cat"))
    fe = Frontend(
        client, tokenizer, preparer.template, preparer.limits, ServingMetrics(MODEL),
        image_processor=preparer.image_processor,
    )  # fmt: skip
    with TestClient(create_app(fe)) as http:
        r = http.post("/v1/chat/completions", json=chat_of(2))
    assert r.status_code == 200, r.text
    (request,) = preparer.run("chat", chat_of(2))
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(request.prompt_token_ids)  # image tokens included
    (submit,) = client.submits
    assert submit.prompt_token_ids == request.prompt_token_ids
    assert [i.span for i in submit.images] == list(request.image_spans)
    config = load_processor_config(model)
    assert config is not None
    for image, original in zip(submit.images, pictures(2)):
        assert image.shape == (3, 28, 28) and image.dtype == "float32"
        got = np.frombuffer(image.pixels, np.float32).reshape(image.shape)
        np.testing.assert_array_equal(got, preprocess(original, config))
