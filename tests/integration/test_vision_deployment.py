"""Images end to end through a deployment (issue 27, docs/vision.md): the
engine turns the scheduler's vision plans into vision frames (pixels and store
rows), its prompt plans into frames reading the features, and window
transitions into state rows; every request gets transformers' greedy tokens
for the same random-weight LLaVA checkpoint, at TP=1 and TP=2.

A request whose images span three windows (one image per window) gives the
tokens of a deployment whose window holds them all, and the same prompt with
other pixels shares no cached KV past the text before its image (the images'
digests key the pages)."""

from __future__ import annotations

import time

import pytest
import torch

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from runtime.transport.images import SubmitImage, pixel_digest
from tests.support.llava import IMAGE, N, hf_model, until_eos

pytestmark = pytest.mark.process

NEW = 6
IMG = [IMAGE] * N
# (prompt, indices of its images): one image each (the first two the same tokens with
# different pixels), none, and three.
ONE = [1, 7, 40, *IMG, 41, 3, 8]
THREE = [1, 7, 40, *IMG, 41, 3, 8, *IMG, 41, 3, 6, *IMG, 41, 3, 8]
PROMPTS: list[tuple[list[int], list[int]]] = [
    (ONE, [7]),
    (ONE, [8]),  # the same tokens, another image
    ([1, 7, 8, 9, 10, 11], []),
    (THREE, [9, 6, 2]),
]


def pixels(count: int = 12) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(11))


def submit_images(ids: list[int], which: list[int], images: torch.Tensor) -> list[SubmitImage]:
    """Each image's span (its run of image tokens, in order) and pixels."""
    starts = [i for i, t in enumerate(ids) if t == IMAGE and (i == 0 or ids[i - 1] != IMAGE)]
    out = []
    for start, k in zip(starts, which, strict=True):
        data = images[k].contiguous().numpy().tobytes()
        shape = tuple(images[k].shape)
        out.append(SubmitImage(start, N, pixel_digest(data, shape), data, shape))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A LLaVA directory (config, weights, preprocessor config) and transformers'
    greedy tokens per prompt."""
    from transformers import CLIPImageProcessor

    path = tmp_path_factory.mktemp("llava-deployment")
    model = hf_model()
    model.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32).save_pretrained(path)
    images, out = pixels(), []
    with torch.no_grad():
        for ids, which in PROMPTS:
            inp = torch.tensor([ids])
            extra = {"pixel_values": images[which]} if which else {}
            gen = model.generate(
                inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=NEW,
                pad_token_id=0, **extra,
            )  # fmt: skip
            out.append(until_eos(gen[0, len(ids) :].tolist()))
        # The images decide the tokens: another image, or the three in another order.
        assert out[0] != out[1]
        other = model.generate(
            torch.tensor([THREE]), pixel_values=images[[2, 6, 9]], do_sample=False,
            max_new_tokens=NEW, pad_token_id=0,
        )  # fmt: skip
        assert until_eos(other[0, len(THREE) :].tolist()) != out[3]
    return path, images, out


def run(path, images, prompts, tp: int, **vision) -> tuple[list[list[int]], dict, list[int]]:
    config = DeploymentConfig(
        model=str(path), tensor_parallel_size=tp, max_concurrency=4, max_prefill_tokens=128,
        num_pages=128, device="cpu", startup_timeout_s=120, **vision,
    )  # fmt: skip
    with LocalDeployment(config) as d:
        streams = []
        for ids, which in prompts:
            streams.append(d.engine.submit(ids, NEW, images=submit_images(ids, which, images)))
            time.sleep(0.01)
        got = [until_eos(s.result(timeout=300).token_ids) for s in streams]
        cached = [s.cached_tokens for s in streams]
        kinds = d.engine.stats.by_kind()
    return got, kinds, cached


@pytest.mark.parametrize("tp", [1, 2])
def test_images_give_transformers_tokens(checkpoint, tp):
    path, images, expected = checkpoint
    got, kinds, _ = run(path, images, PROMPTS, tp)
    assert got == expected
    assert kinds.get("vision", (0, 0))[0] >= 1  # vision frames ran and are counted per kind


def test_three_windows_give_the_tokens_of_one(checkpoint):
    path, images, expected = checkpoint
    one = run(path, images, PROMPTS[3:], 1)
    three = run(path, images, PROMPTS[3:], 1, vision_window_rows=N)
    assert one[0] == three[0] == expected[3:]
    assert three[1].get("snapshot", (0, 0))[0] >= 2  # two window transitions
    assert three[1].get("restore", (0, 0))[0] >= 2


def test_other_pixels_share_no_cached_page(checkpoint):
    path, images, _ = checkpoint
    # the same prompt twice with the same image, then with another image
    same = [(ONE, [7]), (ONE, [7]), (ONE, [8])]
    config = DeploymentConfig(
        model=str(path), tensor_parallel_size=1, max_concurrency=4, max_prefill_tokens=128,
        num_pages=128, device="cpu", startup_timeout_s=120,
    )  # fmt: skip
    with LocalDeployment(config) as d:
        cached = []
        for prompt, which in same:
            stream = d.engine.submit(prompt, NEW, images=submit_images(prompt, which, images))
            stream.result(timeout=300)
            cached.append(stream.cached_tokens)
    assert cached[0] == 0
    assert cached[1] >= 16  # a full page holding the image: shared with equal pixels
    # Another image: only the text before it (its KV does not depend on the image).
    assert cached[2] == ONE.index(IMAGE) == 3
