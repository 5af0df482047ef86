"""scripts/bench_vision.py's pieces that need no deployment: the text twin of
an image prompt (the same length and prefill work, no image) and its percentiles."""

from __future__ import annotations

import random
from types import SimpleNamespace

from scripts.bench_vision import pct, text_twin

IMAGE = 512


def test_a_text_twin_keeps_the_length_and_replaces_only_the_image_tokens():
    ids = [1, 2, 3, *[IMAGE] * 4, 7, 8, *[IMAGE] * 4, 9]
    images = [SimpleNamespace(start=3, length=4), SimpleNamespace(start=9, length=4)]
    twin, twin_images = text_twin(ids, images, random.Random(0))
    assert twin_images == ()
    assert len(twin) == len(ids)
    assert IMAGE not in twin
    kept = [i for i in range(len(ids)) if ids[i] != IMAGE]
    assert [twin[i] for i in kept] == [ids[i] for i in kept]
    assert set(twin) <= {1, 2, 3, 7, 8, 9}  # drawn from the prompt's own text tokens
    other, _ = text_twin(ids, images, random.Random(1))
    assert other != twin  # twins differ: they share no more cached prefix than images did


def test_percentiles_take_the_nearest_rank():
    assert pct([5.0, 1.0, 3.0], 50) == 3.0
    assert pct([float(v) for v in range(101)], 99) == 99.0
    assert pct([], 50) != pct([], 50)  # nan: no sample
