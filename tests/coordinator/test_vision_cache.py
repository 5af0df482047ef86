"""Vision in the scheduler, continued: image digests in the prefix cache's
page keys, and the vision pair search's cohort choice against brute force
(docs/vision.md, "Scheduling")."""

from __future__ import annotations

import itertools
import random

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.scheduler import Scheduler
from runtime.coordinator.vision_select import choose_cohort
from runtime.image_spans import ImageSpan
from tests.support.vision_rig import CATALOG, Sim, digest, spans

# ---------------------------------------------------------------------------
# (4) image digests in the prefix cache's page keys


def test_the_same_tokens_with_different_images_share_no_cached_page():
    tokens = tuple(random.Random(1).randrange(50_000) for _ in range(100))
    sim = Sim(window_rows=64)
    first = sim.admit(100, 2, spans(32, length=40, first_digest=1), tokens=tokens)
    sim.run()
    assert sim.s.request(first) is None  # retired: its pages are published
    other = sim.admit(100, 2, spans(32, length=40, first_digest=2), tokens=tokens)
    r = sim.s.request(other)
    assert r is not None and r.consumed_prompt == 32  # the two pages before the image only
    assert r.vision is not None and r.vision.first == 0  # its own image is encoded
    sim.run()
    same = sim.admit(100, 2, spans(32, length=40, first_digest=1), tokens=tokens)
    r = sim.s.request(same)
    assert r is not None and r.consumed_prompt == 99  # everything but its last token
    assert r.vision is not None and r.vision.first == 1  # no image left to encode
    sim.run()


def test_a_cached_prefix_never_ends_inside_an_image_span():
    """A sibling's full pages published mid-flight end inside an image span:
    the match is cut back to the span's start, and the image is encoded again."""
    tokens = tuple(random.Random(2).randrange(50_000) for _ in range(120))
    sim = Sim(window_rows=64)
    images = (ImageSpan(16, 40, digest(7)), ImageSpan(60, 30, digest(8)))
    first = sim.admit(120, 4, images, tokens=tokens)
    r = sim.s.request(first)
    while r.consumed_prompt < 56:
        sim.step()
    published = r.consumed_prompt // 16 * 16
    assert any(s.start < published < s.end for s in images)  # (the case under test)
    sibling = sim.admit(120, 4, images, tokens=tokens)
    q = sim.s.request(sibling)
    cut = next(s.start for s in images if s.start < published < s.end)
    assert q is not None and q.consumed_prompt == cut
    assert q.vision is not None and q.vision.spans[q.vision.first].start == cut
    sim.run()


# ---------------------------------------------------------------------------
# (5) the cohort choice against brute force


@pytest.mark.parametrize("seed", range(40))
def test_choose_cohort_is_exact(seed):
    rng = random.Random(seed)
    groups = []
    for _ in range(rng.randrange(1, 6)):
        options, images = [], 0
        for _ in range(rng.randrange(1, 4)):
            images += rng.randrange(1, 3)
            options.append((images, round(rng.uniform(0.5, 50.0), 3)))
        groups.append(options)
    budget, rows = rng.randrange(1, 7), rng.randrange(1, 4)
    best = None
    for choice in itertools.product(*[[None, *range(len(g))] for g in groups]):
        picked = [(g, o) for g, o in enumerate(choice) if o is not None]
        images = sum(groups[g][o][0] for g, o in picked)
        if not picked or len(picked) > rows or images > budget:
            continue
        value = sum(groups[g][o][1] for g, o in picked)
        best = value if best is None else max(best, value)
    got = choose_cohort(groups, budget, rows)
    if best is None:
        assert got is None
        return
    assert got is not None
    value, picks = got
    assert value == pytest.approx(best)
    assert len(picks) <= rows and len({g for g, _ in picks}) == len(picks)
    assert sum(groups[g][o][0] for g, o in picks) <= budget
    assert value == pytest.approx(sum(groups[g][o][1] for g, o in picks))


def test_an_image_longer_than_a_packed_capacity_leaves_that_shape_out():
    """A packed prefill shape whose capacity cannot hold the image span at a
    row's position offers nothing for that row (no empty cohort), and the
    request completes on a larger shape."""
    catalog = (*CATALOG, GraphDescriptor(GraphKind.PREFILL, 2, prompt_capacity=64))
    sim = Sim(window_rows=128)
    sim.s = Scheduler(list(catalog), sim.s.config)
    a = sim.admit(200, 3, spans(0, length=100), seed=1)
    b = sim.admit(150, 3, spans(20, length=90, first_digest=9), seed=2)
    sim.run()
    assert sim.out[a.id] == [7] * 3 and sim.out[b.id] == [7] * 3
