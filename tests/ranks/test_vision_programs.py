"""Vision on the ranks (issue 27): the feature store, VISION programs and prompt
frames reading features, through real frames into a RankWorker.

A tiny random LLaVA checkpoint (a CLIP encoder of 32-pixel images in 8-pixel
patches, 16 feature rows per image, and a Llama decoder) is written with
transformers.  At TP=1 and TP=2 (gloo):

* a vision frame of 2 images, then one packed prefill frame reading their
  features (and a text-only row), then decode frames, give transformers'
  ``LlavaForConditionalGeneration.generate`` greedy tokens;
* a prompt whose two images are split over two one-image windows (a vision
  frame, the prompt's first chunk, a second vision frame written from offset
  zero over the consumed window, the second chunk) gives the tokens of one
  window holding both, and transformers'.

Refusals name the field and leave the rank (slots, arena, KV, feature store)
unchanged; a text-only model's catalog, arenas and report are unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.arena import int_size
from runtime.ranks.capacity import CapacityConfig, CapacityError, VisionCapacity, build_catalog
from runtime.ranks.model import load_model
from runtime.ranks.model.parallel import TPGroup
from runtime.ranks.shapes import ProgramError
from runtime.ranks.worker import RankWorker
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams
from tests.support.checkpoints import write_tiny
from tests.support.llava import IMAGE, N, hf_model, until_eos
from tests.support.rank_state import changed, snapshot
from tests.support.tp_runs import tp1_and_tp2

PAGE = 16
PAGES_PER_SLOT = 4  # 64 tokens per request
NEW = 6
IMG = [IMAGE] * N
# (prompt, its images' indices into the pixels); slots are the indices here.
PROMPTS: list[tuple[list[int], list[int]]] = [
    ([1, 5, *IMG, 17, 33], [0]),
    ([1, 9, 40, *IMG, 41, 3], [1]),
    ([1, 7, 8, 9], []),
    ([1, 5, *IMG, 17, 33, 8, *IMG, 41, 3], [2, 3]),  # images at 2..17 and 21..36
]
SPLIT = 21  # the multi-image prompt's first chunk ends before its second image
CAPACITY = CapacityConfig(
    max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=256, packed_prefill=True,
    max_vision_images=2,
)  # fmt: skip
ONE_IMAGE_WINDOW = dataclasses.replace(CAPACITY, vision_windows=1, window_rows=N)


def vision(b: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.VISION, b)


def prefill(b: int, c: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, b, prompt_capacity=c)


def pixels(count: int = 4) -> torch.Tensor:
    """(count, 3, 32, 32) float32 images, the same in every process."""
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The LLaVA checkpoint and transformers' greedy tokens per prompt."""
    path = tmp_path_factory.mktemp("llava-ranks")
    model = hf_model()
    model.save_pretrained(path)
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
        # The features decide the tokens: the two-image prompt's images swapped.
        swapped = model.generate(
            torch.tensor([PROMPTS[3][0]]), pixel_values=images[[3, 2]], do_sample=False,
            max_new_tokens=NEW, pad_token_id=0,
        )  # fmt: skip
    assert until_eos(swapped[0, len(PROMPTS[3][0]) :].tolist()) != out[3]
    return path, out


# -- frames ----------------------------------------------------------------------------


def pages(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))


def lane(slot: int, start: int = 0, end: int | None = None) -> FrameLane:
    prompt = PROMPTS[slot][0]
    end = len(prompt) if end is None else end
    table = pages(slot) if start == 0 else ()
    return FrameLane(slot, 1, "prefill", start, tuple(prompt[start:end]), start, table,
                     int(end == len(prompt)), SamplingParams())  # fmt: skip


def rows(ids: list[int], bases: list[int]) -> list[int]:
    """Each token's store row: image ``k``'s tokens read ``bases[k] + 0..N-1``."""
    out, seen = [], 0
    for token in ids:
        if token != IMAGE:
            out.append(-1)
            continue
        k, j = divmod(seen, N)
        out.append(bases[k] + j)
        seen += 1
    return out


def encode(fence: int, which: list[int], bases: list[int], b: int = 2) -> Frame:
    data = pixels()[which].contiguous().numpy().astype("<f4").tobytes()
    return Frame.vision(fence, vision(b), bases, data)


def decode(worker: RankWorker, fence: int, slots: list[int], tokens: dict[int, list[int]]) -> int:
    """NEW - 1 decode frames after the prefill's token (every rank runs them; rank
    0 reports the tokens); the next fence."""
    for step in range(NEW - 1):
        lanes = [FrameLane(s, 1, "decode", 0, (), len(PROMPTS[s][0]) + step, (), 1) for s in slots]
        b = 1 << (len(lanes) - 1).bit_length()
        frame = Frame.from_lanes(fence + step, GraphDescriptor(GraphKind.DECODE, b), lanes)
        collect(worker.execute(frame), tokens)
    return fence + NEW - 1


def collect(completion, tokens: dict[int, list[int]]) -> None:
    assert completion.error is None
    for result in completion.lane_results():
        tokens.setdefault(result.slot, []).extend(result.tokens)


def make_worker(path, capacity=CAPACITY, group=None, rank=0, world=1) -> RankWorker:
    return RankWorker(
        load_model(path, group), capacity, num_pages=8 * PAGES_PER_SLOT, page_size=PAGE,
        rank=rank, world_size=world,
    )  # fmt: skip


def scenario(path: str, group: TPGroup, rank: int, world: int) -> dict:
    """(a) slots 0-2 packed after one vision frame; (b) slot 3's two images in one
    window (worker ``a``) and split over two one-image windows (worker ``b``)."""
    out: dict = {}
    a = make_worker(path, CAPACITY, group, rank, world)
    tokens: dict[int, list[int]] = {}
    done = a.execute(encode(1, [0, 1], [0, 64]))  # windows 0 and 1
    assert done.error is None and done.num_lanes == 0 and not done.sidecars
    assert done.device_ns > 0
    feature = rows(PROMPTS[0][0], [0]) + rows(PROMPTS[1][0], [64]) + rows(PROMPTS[2][0], [])
    frame = Frame.from_lanes(2, prefill(4, 256), [lane(0), lane(1), lane(2)], feature_rows=feature)
    collect(a.execute(frame), tokens)
    decode(a, 3, [0, 1, 2], tokens)
    out["packed"] = [tokens.get(s, []) for s in range(3)]
    # (b), one window holding both images (window 2).
    tokens = {}
    a.execute(encode(20, [2, 3], [128, 144]))
    ids = PROMPTS[3][0]
    frame = Frame.from_lanes(21, prefill(1, 64), [lane(3)], feature_rows=rows(ids, [128, 144]))
    collect(a.execute(frame), tokens)
    decode(a, 22, [3], tokens)
    out["one_window"] = tokens.get(3, [])
    # (b), two windows: the second image written from offset zero once the first is read.
    b = make_worker(path, ONE_IMAGE_WINDOW, group, rank, world)
    tokens = {}
    b.execute(encode(1, [2], [0], b=1))
    first = Frame.from_lanes(2, prefill(1, 64), [lane(3, 0, SPLIT)],
                             feature_rows=rows(ids[:SPLIT], [0]))  # fmt: skip
    collect(b.execute(first), tokens)
    assert tokens.get(3, []) == []  # a chunk inside the prompt commits nothing
    b.execute(encode(3, [3], [0], b=1))
    second = Frame.from_lanes(4, prefill(1, 64), [lane(3, SPLIT)],
                              feature_rows=rows(ids[SPLIT:], [0]))  # fmt: skip
    collect(b.execute(second), tokens)
    decode(b, 5, [3], tokens)
    out["two_windows"] = tokens.get(3, [])
    out["report"] = (b.report().vision_windows, b.report().window_rows, b.report().image_tokens)
    return out


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    return tp1_and_tp2(scenario, str(path), tmp_path_factory.mktemp("vision-tp2"))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.process
def test_vision_then_packed_prefill_and_decode_give_transformers_greedy_tokens(
    checkpoint, runs, tp
):
    _, want = checkpoint
    got = runs[tp]
    assert [until_eos(t) for t in got["packed"]] == want[:3]
    assert runs["rank1"]["packed"] == [[], [], []]  # rank 0 reports the lanes


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.process
def test_images_split_over_two_windows_give_the_tokens_of_one_window(checkpoint, runs, tp):
    _, want = checkpoint
    got = runs[tp]
    assert got["two_windows"] == got["one_window"]
    assert until_eos(got["one_window"]) == want[3]
    assert got["report"] == (1, N, N)


# -- refusals ------------------------------------------------------------------------


def store_and_state(worker: RankWorker) -> tuple[dict, torch.Tensor]:
    assert worker.store is not None
    return snapshot(worker), worker.store.features.clone()


def test_refused_vision_and_prompt_frames_name_the_field_and_change_nothing(checkpoint):
    path, _ = checkpoint
    w = make_worker(path)
    assert w.store is not None and w.store.rows == 4 * 4 * N  # 4 windows of 4 images
    w.execute(encode(1, [0, 1], [0, 64]))
    before, features = store_and_state(w)
    good = pixels()[[0]].numpy().tobytes()
    for frame, message in [
        (Frame.vision(2, vision(2), [0], good[:-12]), r"pixels: .* 1 float32 images of 3 x 32"),
        (Frame.vision(2, vision(2), [w.store.rows - 8], good), r"image_base\[0\]: rows .* outside"),
        (Frame.vision(2, vision(2), [0, 8], good * 2), r"image_base\[1\]: .* overlap"),
        (Frame.vision(2, vision(8), [0], good), "unknown"),
        (Frame.from_lanes(2, prefill(1, 64), [lane(0)],
                          feature_rows=[w.store.rows] * len(PROMPTS[0][0])),
         r"feature_rows\[0\]: row 256 outside the feature store \(256 rows\)"),
    ]:  # fmt: skip
        with pytest.raises(ProgramError, match=message):
            w.execute(frame)
        after, now = store_and_state(w)
        assert changed(before, after) == [] and torch.equal(features, now)
    # The store's last image rows are legal; a vision frame changes only its rows.
    w.execute(Frame.vision(3, vision(1), [w.store.rows - N], good))
    assert changed(before, snapshot(w)) == ["frames"]
    moved = (w.store.features != features).any(dim=1).nonzero().flatten().tolist()
    assert moved == list(range(w.store.rows - N, w.store.rows))


def test_the_wire_refuses_malformed_vision_fields():
    data = b"\0" * (3 * 32 * 32 * 4)
    decode_lane = FrameLane(1, 1, "decode", 0, (), 9, (), 1)
    for build, field in [
        (lambda: Frame(1, vision(2), pixels=data), "image_base"),  # no image
        (lambda: Frame.vision(1, vision(2), [0, 16, 32], data * 3), "image_base"),  # over B
        (lambda: Frame.vision(1, vision(2), [-1], data), r"image_base\[0\]"),
        (lambda: Frame.vision(1, vision(2), [0], data[:-1]), "pixels"),
        (lambda: Frame.vision(1, vision(2), [0], b""), "pixels"),
        (lambda: Frame(1, vision(2), image_base=[0], pixels=data, release_slots=(3,)),
         "release_slots"),
        (lambda: Frame(1, vision(2), image_base=[0], pixels=data, feature_rows=[1]),
         "feature_rows"),
        (lambda: Frame(1, vision(2), image_base=[0], pixels=data, copies=((1, 2),)), "copies"),
        (lambda: Frame.from_lanes(1, vision(2), [lane(2)]), "slot"),
        (lambda: Frame(1, prefill(1, 64), image_base=[0]), "image_base"),
        (lambda: Frame(1, prefill(1, 64), pixels=data), "pixels"),
        (lambda: Frame.from_lanes(1, prefill(1, 64), [lane(2)], feature_rows=[-1]),
         "feature_rows"),  # one entry per prompt token
        (lambda: Frame.from_lanes(1, prefill(1, 64), [lane(2)], feature_rows=[-1, -2, 0, 0]),
         r"feature_rows\[1\]"),
        (lambda: Frame.from_lanes(1, GraphDescriptor(GraphKind.DECODE, 1), [decode_lane],
                                  feature_rows=[0]), "feature_rows"),
    ]:  # fmt: skip
        with pytest.raises(ProtocolError, match=field):
            build()
    frame = Frame.vision(4, vision(2), [0, 16], data * 2)
    again = Frame.from_wire(frame.to_wire())
    assert again == frame and list(again.image_base) == [0, 16] and again.pixels == data * 2
    prompt = Frame.from_lanes(5, prefill(1, 64), [lane(2)], feature_rows=[-1, 3, 4, -1])
    assert list(Frame.from_wire(prompt.to_wire()).feature_rows) == [-1, 3, 4, -1]


# -- sizes and the text-only model -----------------------------------------------------


def test_the_capacity_sizes_the_store_and_the_vision_buckets(checkpoint):
    path, _ = checkpoint
    assert CapacityConfig(max_vision_images=5).vision_batches() == (1, 2, 4, 8)
    assert VisionCapacity.of(CapacityConfig(), N) == VisionCapacity(4, 4 * N, N)
    assert VisionCapacity.of(ONE_IMAGE_WINDOW, N).rows == N
    with pytest.raises(CapacityError, match="window_rows"):
        VisionCapacity.of(dataclasses.replace(CAPACITY, window_rows=N - 1), N)
    with pytest.raises(CapacityError, match="vision_windows"):
        CapacityConfig(vision_windows=0)
    w = make_worker(path)
    vision_keys = [d.batch_capacity for d in w.catalog if d.kind is GraphKind.VISION]
    assert vision_keys == [1, 2] and set(w.vision) == {vision(1).key, vision(2).key}
    report = w.report()
    assert (report.vision_windows, report.window_rows, report.image_tokens) == (4, 4 * N, N)
    assert CatalogReport.from_wire(report.to_wire()) == report
    with pytest.raises(ProtocolError, match="window_rows"):
        dataclasses.replace(report, window_rows=N - 1)
    # Prompt programs carry one feature row per packed token; decode programs none.
    for program in w.programs.values():
        base = int_size(program.shape.tokens, program.shape.lanes)
        if program.desc.kind in (GraphKind.PREFILL, GraphKind.MIXED):
            assert program.store is w.store and program.int_size == base + program.shape.tokens
        else:
            assert program.store is None and program.int_size == base
    assert w.store is not None
    assert w.store.nbytes == (4 * 4 * N + 1) * 64 * 4


def test_a_text_only_model_is_unchanged(tmp_path):
    write_tiny("llama", tmp_path, seed=5)
    w = make_worker(tmp_path)
    assert w.store is None and w.vision == {}
    assert build_catalog(CAPACITY, w.max_context) == w.catalog
    assert not [d for d in w.catalog if d.kind is GraphKind.VISION]
    for program in w.programs.values():
        assert program.store is None
        assert program.int_size == int_size(program.shape.tokens, program.shape.lanes)
    report = w.report()
    assert (report.vision_windows, report.window_rows, report.image_tokens) == (0, 0, 0)
    frame = Frame.from_lanes(1, prefill(1, 64), [lane(2)], feature_rows=[-1, -1, -1, -1])
    before = snapshot(w)
    with pytest.raises(ProgramError, match=r"feature_rows: .* reads no image features"):
        w.execute(frame)
    assert changed(before, snapshot(w)) == []
    completion = w.execute(dataclasses.replace(frame, feature_rows=np.zeros(0, np.int64).tolist()))
    assert completion.error is None and completion.num_lanes == 1
    with pytest.raises(ValueError, match="encodes no images"):
        RankWorker(load_model(tmp_path), CAPACITY, num_pages=8, page_size=PAGE,
                   catalog=[*w.catalog, vision(1)])  # fmt: skip


def test_scored_and_mixed_frames_read_features_at_their_prompt_tokens(checkpoint):
    """A scored prefill (its feature rows after score_next in the arena) and a
    mixed frame (the prompt row's rows at its packed offset, after a decode
    row) give the first tokens transformers gives."""
    path, want = checkpoint
    capacity = dataclasses.replace(CAPACITY, mixed_prefill=True, scored_prefill=True)
    w = make_worker(path, capacity)
    scored_program = GraphDescriptor(GraphKind.SCORED_PREFILL, 1, prompt_capacity=64)
    mixed = GraphDescriptor(GraphKind.MIXED, 2, prompt_capacity=64)
    assert w.programs[scored_program.key].store is w.store
    assert w.programs[mixed.key].store is w.store
    tokens: dict[int, list[int]] = {}
    w.execute(encode(1, [0, 1], [0, 64]))
    ids = PROMPTS[0][0]
    frame = Frame.from_lanes(2, scored_program, [lane(0)], score_next=[-1], score_k=1,
                             feature_rows=rows(ids, [0]))  # fmt: skip
    collect(w.execute(frame), tokens)
    collect(w.execute(Frame.from_lanes(3, prefill(1, 64), [lane(2)])), tokens)  # text only
    decode_lane = FrameLane(2, 1, "decode", 0, (), len(PROMPTS[2][0]), (), 1)
    frame = Frame.from_lanes(4, mixed, [decode_lane, lane(1)], prompt_row=1,
                             feature_rows=rows(PROMPTS[1][0], [64]))  # fmt: skip
    collect(w.execute(frame), tokens)
    assert tokens[0] == want[0][:1] and tokens[1] == want[1][:1] and tokens[2] == want[2][:2]


def test_vision_frames_cross_the_codec():
    from runtime.transport.codec import decode as unwire
    from runtime.transport.codec import encode as wire

    data = pixels()[[0, 1]].numpy().astype("<f4").tobytes()
    frame = Frame.vision(7, vision(2), [0, 16], data, expected_ns=5)
    assert unwire(wire(frame)) == frame
    prompt = Frame.from_lanes(8, prefill(1, 64), [lane(0)], feature_rows=rows(PROMPTS[0][0], [3]))
    assert unwire(wire(prompt)) == prompt
