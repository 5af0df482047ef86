"""Vision on the command line (issue 27, docs/vision.md "Running"): the vision
capacity flags reach every rank's CapacityConfig (DeploymentConfig.rank_args, the
rank's parser) and the config file, bad values fail naming the flag, and
`flare run --prompt TEXT --image FILE` runs a tiny random LLaVA end to end (TP=1,
real processes); a text-only model or a missing file fails naming the flag."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from runtime.cli.app import build_parser
from runtime.cli.commands.run import cmd_run, deployment_config
from runtime.cli.rank_process import parse_args as rank_args
from runtime.deploy.config import DeploymentConfig
from runtime.ranks.capacity import (
    DEFAULT_MAX_VISION_IMAGES,
    DEFAULT_VISION_WINDOWS,
    VisionCapacity,
)
from runtime.ranks.model import default_model_dir
from tests.support.images import animated_gif, png, png_header, truncated_png

ROOT = Path(__file__).resolve().parents[2]
RANK_BASE = ["--frames-endpoint", "ipc:///x/f", "--completions-endpoint", "ipc:///x/c"]
IMAGE_ID = 512  # <image>, added to the default tokenizer's 512 tokens
PER_IMAGE = 16  # CLIP 32 px, patch 8
# A template that renders content parts: each image as <image>, then the text.
TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<image>\\n' }}{% else %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def write_llava(path: Path) -> Path:
    """A tiny random LLaVA directory as transformers writes it: CLIP 32 px / patch 8
    (16 image tokens), a one-layer Llama decoder, the default tokenizer with
    ``<image>`` added, a CLIP image processor and a chat template."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(default_model_dir(), "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    assert tok.token_to_id("<image>") == IMAGE_ID
    tok.save(str(path / "tokenizer.json"))
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, vocab_size=IMAGE_ID + 1,
                       max_position_embeddings=512)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_ID)
    torch.manual_seed(3)
    LlavaForConditionalGeneration(config).save_pretrained(str(path))
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32).save_pretrained(str(path))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return write_llava(tmp_path_factory.mktemp("vision-run") / "llava")


def configure(argv: list[str]) -> DeploymentConfig:
    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    return deployment_config(args, parser, argv)


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        configure(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


# -- the flags -----------------------------------------------------------------------------


def test_the_vision_flags_reach_every_ranks_capacity():
    config = configure([])
    assert (config.vision_windows, config.vision_window_rows, config.max_vision_images) == (
        DEFAULT_VISION_WINDOWS, 0, DEFAULT_MAX_VISION_IMAGES
    )  # fmt: skip
    capacity = rank_args([*RANK_BASE, *config.rank_args()]).capacity
    assert (capacity.vision_windows, capacity.window_rows, capacity.max_vision_images) == (
        DEFAULT_VISION_WINDOWS, 0, DEFAULT_MAX_VISION_IMAGES
    )  # fmt: skip
    argv = ["--vision-windows", "3", "--vision-window-rows", "48", "--max-vision-images", "8"]
    config = configure(argv)
    fields = (config.vision_windows, config.vision_window_rows, config.max_vision_images)
    assert fields == (3, 48, 8)
    capacity = rank_args([*RANK_BASE, *config.rank_args()]).capacity
    assert (capacity.vision_windows, capacity.window_rows, capacity.max_vision_images) == (3, 48, 8)
    store = VisionCapacity.of(capacity, PER_IMAGE)
    assert (store.windows, store.window_rows) == (3, 48)


def test_the_config_file_sets_them_and_the_command_line_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[run]\nvision-windows = 2\nmax-vision-images = 2\nvision-window-rows = 64\n")
    config = configure(["--config", str(path), "--max-vision-images", "16"])
    assert (config.vision_windows, config.vision_window_rows, config.max_vision_images) == (
        2, 64, 16
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--vision-windows", "0", "must be >= 1"),
        ("--vision-windows", "two", "must be an integer"),
        ("--vision-window-rows", "-1", "must be >= 0"),
        ("--max-vision-images", "0", "must be >= 1"),
        ("--max-vision-images", "65", "must be at most 64"),
    ],
)
def test_a_bad_value_names_the_flag(flag, value, words, capsys):
    err = refused([flag, value], capsys)
    assert f"argument {flag}: {words}" in err, err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--vision-windows", "0"), ("--vision-window-rows", "-2"), ("--max-vision-images", "99")],
)
def test_the_rank_refuses_a_bad_value_naming_its_flag(flag, value, capsys):
    with pytest.raises(SystemExit):
        rank_args([*RANK_BASE, flag, value])
    assert f"{flag} must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("field", "value"),
    [("vision_windows", 0), ("vision_window_rows", -1), ("max_vision_images", 65),
     ("vision_windows", True)],
)  # fmt: skip
def test_deployment_config_refuses_a_bad_value_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must"):
        DeploymentConfig(**{field: value})


def test_a_window_smaller_than_one_image_names_the_flag(llava, capsys):
    config = configure(["--model", str(llava), "--vision-window-rows", str(PER_IMAGE)])
    assert config.vision_window_rows == PER_IMAGE  # one image: enough
    err = refused(["--model", str(llava), "--vision-window-rows", str(PER_IMAGE - 1)], capsys)
    assert "--vision-window-rows 15" in err and "cannot hold one image of 16" in err, err


def test_a_text_only_model_ignores_the_flags():
    config = configure(["--vision-window-rows", "1"])  # below any image: nothing to hold
    assert config.vision_window_rows == 1


# -- --image before anything starts ---------------------------------------------------------


def test_image_needs_a_prompt(llava, tmp_path, capsys):
    image = tmp_path / "a.png"
    image.write_bytes(png(40, 30))
    err = refused(["--model", str(llava), "--image", str(image)], capsys)
    assert "--image needs --prompt" in err, err


def test_a_missing_or_unreadable_image_names_the_flag_and_the_path(llava, tmp_path, capsys):
    missing = tmp_path / "missing.png"
    err = refused(["--model", str(llava), "--prompt", "hi", "--image", str(missing)], capsys)
    assert f"--image {missing}: cannot be read (No such file or directory)" in err, err
    err = refused(["--model", str(llava), "--prompt", "hi", "--image", str(tmp_path)], capsys)
    assert f"--image {tmp_path}: cannot be read" in err, err


def test_an_image_over_the_byte_limit_is_refused_before_it_is_read(llava, tmp_path, capsys):
    image = tmp_path / "big.png"
    image.write_bytes(png(64, 64))
    argv = ["--model", str(llava), "--prompt", "hi", "--image", str(image)]
    err = refused([*argv, "--max-image-bytes", "100"], capsys)
    assert f"--image {image}: holds" in err and "(--max-image-bytes)" in err, err


def test_a_text_only_model_refuses_images_naming_a_vision_model(tmp_path, capsys):
    image = tmp_path / "a.png"
    image.write_bytes(png(40, 30))
    text_only = str(default_model_dir())
    err = refused(["--model", text_only, "--prompt", "hi", "--image", str(image)], capsys)
    assert "--image:" in err and "does not accept images (it is a text-only model)" in err
    assert "give a vision model" in err, err


def prepared_refusal(argv: list[str], capsys) -> str:
    """``flare run ARGV``'s refusal while preparing the prompt (before any process)."""
    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    with pytest.raises(SystemExit) as info:
        cmd_run(args, parser, argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("data", "flags", "words"),
    [
        (png_header(100_000, 100_000), [], "declares an image of 100000 x 100000"),
        (truncated_png(), [], "cannot be decoded as a PNG image"),
        (b"just text, no picture", [], "is not a PNG, JPEG, WebP or GIF image"),
        (animated_gif(5), ["--max-image-frames", "2"], "more than 2 frames"),
        (png(1, 2000), ["--max-image-pixels", "40000"], "would be resized to"),
    ],
)
def test_a_hostile_image_gets_the_servers_refusal_naming_the_file(
    llava, tmp_path, capsys, data, flags, words
):
    image = tmp_path / "hostile.png"
    image.write_bytes(data)
    argv = ["--model", str(llava), "--prompt", "hi", "--image", str(image), *flags]
    err = prepared_refusal(argv, capsys)
    assert f"--image {image} " in err and words in err, err


def test_the_image_limit_and_the_typed_placeholder_name_their_flags(llava, tmp_path, capsys):
    image = tmp_path / "a.png"
    image.write_bytes(png(40, 30))
    base = ["--model", str(llava), "--image", str(image)]
    err = prepared_refusal([*base, "--image", str(image), "--prompt", "hi",
                            "--limit-mm-per-prompt", "image=1"], capsys)  # fmt: skip
    assert "--image: messages has at least 2 images" in err and "--limit-mm-per-prompt" in err
    err = prepared_refusal([*base, "--prompt", "look: <image>"], capsys)
    assert "--prompt contains '<image>'" in err, err


def test_image_without_a_model_runs_the_embedded_vision_model(tmp_path, capsys):
    from runtime.cli.flags.vision import default_vision_dir

    image = tmp_path / "a.png"
    image.write_bytes(png(40, 30))
    argv = ["--prompt", "hi", "--image", str(image)]
    if os.path.isdir(default_vision_dir()):
        assert configure(argv).model == default_vision_dir()
    else:  # not committed yet: the error names it
        err = refused(argv, capsys)
        assert f"the default vision model {default_vision_dir()}: no such directory" in err


# -- end to end (real processes) ------------------------------------------------------------


def flare(args: list[str], timeout: float = 300.0) -> tuple[int, str, str, list[str]]:
    """``python -m runtime.cli ARGS`` with a fresh, short TMPDIR (the ranks' ipc
    socket paths must stay short): (exit code, stdout, stderr, what it left there)."""
    tmpdir = tempfile.mkdtemp(prefix="flv-")
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=tmpdir)
        done = subprocess.run(
            [sys.executable, "-m", "runtime.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return done.returncode, done.stdout, done.stderr, os.listdir(tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


RUN = ["--device", "cpu", "--max-tokens", "6", "--num-pages", "64", "--max-concurrency", "2",
       "--max-prefill-tokens", "128", "--log-level", "warning"]  # fmt: skip


def transformers_completion(model_dir: Path, argv: list[str]) -> str:
    """The completion transformers' greedy ``generate`` gives for ``flare run ARGV``'s
    prepared prompt (the chat route's ids and pixels), as ``flare run`` prints it."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlavaForConditionalGeneration

    from runtime.cli.commands.image_prompt import image_request
    from runtime.cli.commands.prompt import completion_text
    from runtime.cli.commands.run import checked_run

    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    config, model = checked_run(args, parser, argv)
    request = image_request(args, parser, config, model, None, model.max_position_embeddings)
    ids = list(request.prompt_token_ids)
    pixels = torch.stack([torch.from_numpy(image.array().copy()) for image in request.images])
    hf = LlavaForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pixel_values=pixels, do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=0,
        )  # fmt: skip
    new = out[0, len(ids) :].tolist()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return completion_text(tokenizer, ids, new)


@pytest.mark.process
def test_flare_run_with_images_prints_transformers_completion(llava, tmp_path):
    first, second = tmp_path / "a.png", tmp_path / "b.jpg"
    first.write_bytes(png(40, 30, seed=1))
    second.write_bytes(png(20, 50, seed=2))  # PNG bytes under a .jpg name: sniffed, not named
    trace = tmp_path / "trace.jsonl"
    argv = [str(llava), "--prompt", "What is in these pictures?", "--image", str(first),
            "--image", str(second), *RUN]  # fmt: skip
    started = time.monotonic()
    code, out, err, _ = flare(["run", *argv, "--trace", str(trace)])
    assert code == 0, err
    print(f"flare run --image: {time.monotonic() - started:.1f} s\n{err}{out}")
    assert f"2 images: {first}, {second}" in err, err
    assert "==> completion (6 generated tokens" in err, err
    kinds = [json.loads(line).get("kind") for line in trace.read_text().splitlines()]
    assert "vision" in kinds and "prefill" in kinds, kinds  # the images were encoded
    assert out == transformers_completion(llava, argv) + "\n"


@pytest.mark.process
def test_flare_run_refuses_a_hostile_image_as_the_server_does(llava, tmp_path):
    bad = tmp_path / "cut.png"
    bad.write_bytes(truncated_png())
    code, out, err, _ = flare(["run", str(llava), "--prompt", "hi", "--image", str(bad), *RUN])
    assert code == 2 and not out, err
    assert f"--image {bad} cannot be decoded as a PNG image" in err, err
    assert "Traceback" not in err


@pytest.mark.process
def test_flare_run_with_a_text_only_model_and_an_image_exits_naming_it(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(png(40, 30))
    code, out, err, left = flare(
        ["run", str(default_model_dir()), "--prompt", "hi", "--image", str(image), *RUN]
    )
    assert code != 0 and not out
    assert "does not accept images (it is a text-only model)" in err, err
    assert "Traceback" not in err
    assert left == []  # nothing started


def test_the_config_file_names_an_image_too(llava, tmp_path, capsys):
    path = tmp_path / "run.toml"
    missing = tmp_path / "gone.png"
    path.write_text(f'[run]\nimage = "{missing}"\nprompt = "hi"\nmodel = "{llava}"\n')
    err = refused(["--config", str(path)], capsys)
    assert f"--image {missing}: cannot be read" in err, err
