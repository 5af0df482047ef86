"""The embedded default vision model (scripts/train_vision_default.py): the committed
files match their SHA256SUMS, and transformers loads the directory and names the
shape and colour of a drawn picture."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from runtime.ranks.model.default import WEIGHTS_DIR

VISION_DIR = WEIGHTS_DIR / "vision"
LAYOUT = {
    "SHA256SUMS",
    "TRAINING.md",
    "config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
IMAGE_TOKEN_ID = 512
IMAGE_TOKENS = 64
PROMPT = "<|bos|>User: <image>\nWhat is in this picture?\nAssistant:"


def _sums() -> dict[str, str]:
    out = {}
    for line in (VISION_DIR / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            out[name.lstrip("*")] = digest
    return out


def test_committed_files_match_sha256sums() -> None:
    sums = _sums()
    present = {p.name for p in VISION_DIR.iterdir()}
    assert present == LAYOUT
    assert set(sums) == LAYOUT - {"SHA256SUMS"}
    for name, digest in sums.items():
        assert hashlib.sha256((VISION_DIR / name).read_bytes()).hexdigest() == digest, name
    assert sum(p.stat().st_size for p in VISION_DIR.iterdir()) <= 6 * 1024 * 1024


def test_config_tokenizer_and_chat_template() -> None:
    from transformers import PreTrainedTokenizerFast

    config = json.loads((VISION_DIR / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["image_token_index"] == IMAGE_TOKEN_ID
    assert config["image_seq_length"] == IMAGE_TOKENS
    assert config["vision_feature_select_strategy"] == "default"
    vision = config["vision_config"]
    assert (vision["image_size"] // vision["patch_size"]) ** 2 == IMAGE_TOKENS
    assert config["text_config"]["vocab_size"] == IMAGE_TOKEN_ID + 1
    pre = json.loads((VISION_DIR / "preprocessor_config.json").read_text(encoding="utf-8"))
    assert pre["crop_size"] == {"height": vision["image_size"], "width": vision["image_size"]}
    # The text pair's tokenizer plus <image>: the same ids for text.
    text_tok = PreTrainedTokenizerFast(tokenizer_file=str(WEIGHTS_DIR / "tokenizer.json"))
    tok = PreTrainedTokenizerFast.from_pretrained(str(VISION_DIR))
    assert tok.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    sample = "Describe the image, please."
    assert tok.encode(sample, add_special_tokens=False) == text_tok.encode(
        sample, add_special_tokens=False
    )
    messages = [{"role": "user", "content": "<image>\nWhat is in this picture?"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == PROMPT


def _draw(shape: str, rgb: tuple[int, int, int], centre: tuple[float, float], side: int):
    """A picture as the training script draws them: at twice the size, downsampled."""
    from PIL import Image, ImageDraw

    size = 2 * side
    img = Image.new("RGB", (size, size), (128, 128, 128))
    draw = ImageDraw.Draw(img)
    cx, cy, r = centre[0] * size, centre[1] * size, 0.23 * size
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=rgb)
    else:  # triangle
        pts = [(-math.pi / 2 + k * 2 * math.pi / 3) for k in range(3)]
        draw.polygon([(cx + r * math.cos(a), cy + r * math.sin(a)) for a in pts], fill=rgb)
    return img.resize((side, side), Image.Resampling.LANCZOS)


@pytest.mark.parametrize(
    ("shape", "colour", "rgb", "centre"),
    [
        ("circle", "red", (220, 30, 30), (0.5, 0.5)),
        ("triangle", "blue", (40, 70, 225), (0.25, 0.5)),
    ],
)
def test_transformers_names_shape_and_colour(
    shape: str, colour: str, rgb: tuple[int, int, int], centre: tuple[float, float]
) -> None:
    import torch
    from transformers import (
        AutoImageProcessor,
        LlavaForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    model = LlavaForConditionalGeneration.from_pretrained(str(VISION_DIR)).eval()
    assert model.dtype == torch.float16
    side = model.config.vision_config.image_size
    proc = AutoImageProcessor.from_pretrained(str(VISION_DIR))
    tok = PreTrainedTokenizerFast.from_pretrained(str(VISION_DIR))
    text = PROMPT.replace("<image>", "<image>" * IMAGE_TOKENS)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    assert int((ids["input_ids"] == IMAGE_TOKEN_ID).sum()) == IMAGE_TOKENS
    pixels = proc(images=_draw(shape, rgb, centre, side), return_tensors="pt")["pixel_values"]
    assert tuple(pixels.shape) == (1, 3, side, side)
    with torch.no_grad():
        out = model.generate(
            **ids,
            pixel_values=pixels.to(torch.float16),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert shape in answer and colour in answer, answer


def test_ships_with_the_package() -> None:
    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text(encoding="utf-8")
    assert '"weights/vision/*"' in setup
