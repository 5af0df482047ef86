"""Scored prefill programs (SCORED_PREFILL, issue 27): a prefill that also returns,
for every packed prompt token, the log probability of the next prompt token and
the top-k alternatives (docs/scored-prefill.md).

The prompt log probabilities equal transformers' fp32 log-softmax at every
position, to 1e-4, at TP=1 and TP=2 (gloo), across chunk boundaries (a
100-token prompt in a 64-token chunk and the rest, the chunk's last position
scored through the frame's ``score_next``) and in packed rows; the first output
token is the greedy one and the KV and pending tokens are what plain prefill
programs leave.  A ``score_next`` outside the vocabulary is refused with nothing
changed; the wire refuses malformed scored frames, naming the field.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig, build_catalog
from runtime.ranks.model import load_model
from runtime.ranks.model.parallel import TPGroup
from runtime.ranks.shapes import ProgramError, ProgramShape
from runtime.ranks.worker import RankWorker
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import tensor_to_torch
from tests.support.checkpoints import greedy, write_tiny
from tests.support.rank_state import changed, snapshot
from tests.support.tp_runs import tp1_and_tp2

PAGE = 16
PAGES_PER_SLOT = 8
PROMPTS = [
    [5, 17, 33, 3, 60],
    [9, 9, 9, 41, 77, 12, 3, 50, 21],
    [88],
    list(range(3, 103)),  # 100 tokens: a 64-token chunk, then 36
    [(7 * i + 3) % 120 + 2 for i in range(50)],  # 50 tokens: 27, then 23 across a page
]
K = 3
CAPACITY = CapacityConfig(
    max_concurrency=4, min_prefill_tokens=64, max_prefill_tokens=256,
    packed_prefill=True, scored_prefill=True,
)  # fmt: skip


def scored(b: int, c: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.SCORED_PREFILL, b, prompt_capacity=c)


def plain(b: int, c: int) -> GraphDescriptor:
    return GraphDescriptor(GraphKind.PREFILL, b, prompt_capacity=c)


# (program size (B, C), rows (slot, start, end)): packed rows, a chunk that ends
# inside the prompt (scored to its last position through score_next), the rest
# of two prompts over their cached prefixes, and a one-token prompt alone.
SCHEDULE = [
    ((4, 256), [(3, 0, 64), (0, 0, 5), (1, 0, 9), (4, 0, 27)]),
    ((2, 128), [(3, 64, 100), (4, 27, 50)]),
    ((1, 64), [(2, 0, 1)]),
]


def pages(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT))


def make_worker(path, group: TPGroup | None = None, rank: int = 0, world: int = 1) -> RankWorker:
    return RankWorker(
        load_model(path, group), CAPACITY, num_pages=6 * PAGES_PER_SLOT, page_size=PAGE,
        rank=rank, world_size=world,
    )  # fmt: skip


def lane(slot: int, start: int, end: int) -> FrameLane:
    prompt = PROMPTS[slot]
    table = pages(slot) if start == 0 else ()
    last = int(end == len(prompt))
    return FrameLane(slot, 1, "prefill", start, tuple(prompt[start:end]), start, table, last,
                     SamplingParams())  # fmt: skip


def following(slot: int, end: int) -> int:
    prompt = PROMPTS[slot]
    return prompt[end] if end < len(prompt) else -1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The checkpoint, transformers' greedy first tokens and its fp32 log-softmax
    at every prompt position."""
    path = tmp_path_factory.mktemp("llama-scored")
    model = write_tiny("llama", path, seed=21)
    with torch.no_grad():
        logp = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in PROMPTS]
    return path, greedy(model, PROMPTS, 1), logp


def scenario(path: str, group: TPGroup, rank: int, world: int) -> dict:
    """The schedule on scored programs (rows per slot: each packed token's values
    and ids, in prompt order) and on plain prefill programs (KV and pending
    tokens, to compare)."""
    out: dict = {"rows": {}, "ids": {}, "tokens": {}}
    caches = []
    for kind in (scored, plain):
        w = make_worker(path, group, rank, world)
        for fence, ((b, c), rows) in enumerate(SCHEDULE, 1):
            lanes = [lane(*row) for row in rows]
            extra = {}
            if kind is scored:
                extra = {"score_next": [following(s, end) for s, _, end in rows], "score_k": K}
            frame = Frame.from_lanes(fence, kind(b, c), lanes, **extra)
            completion = w.execute(frame)
            assert completion.error is None
            if rank != 0:
                assert "prompt_logprobs" not in completion.sidecars  # rank 0's alone
                continue
            if kind is scored:
                values = tensor_to_torch(completion.sidecars["prompt_logprobs"])
                ids = tensor_to_torch(completion.sidecars["prompt_logprob_token_ids"])
                assert values.dtype == torch.float32 and ids.dtype == torch.int32
                assert values.shape == (sum(e - s for _, s, e in rows), 1 + K)
                at = 0
                for slot, start, end in rows:
                    out["rows"].setdefault(slot, []).append(values[at : at + end - start])
                    out["ids"].setdefault(slot, []).append(ids[at : at + end - start])
                    at += end - start
                for result in completion.lane_results():
                    out["tokens"].setdefault(result.slot, []).extend(result.tokens)
            else:
                assert "prompt_logprobs" not in completion.sidecars
        cache = w.model.kv_cache
        caches.append(cache._storage[:, :, : cache.num_slots].clone())
        out[f"{kind.__name__}-pending"] = [int(w.arena.pending[s]) for s in range(len(PROMPTS))]
    out["kv_max_diff"] = float((caches[0] - caches[1]).abs().max())
    out["kv_written"] = float(caches[0].abs().sum())
    for key in ("rows", "ids"):
        out[key] = {s: torch.cat(parts) for s, parts in out[key].items()}
    return out


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    path, _, _ = checkpoint
    return tp1_and_tp2(scenario, str(path), tmp_path_factory.mktemp("scored-tp2"))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.process
def test_prompt_logprobs_equal_transformers_log_softmax_at_every_position(checkpoint, runs, tp):
    _, first, reference = checkpoint
    got = runs[tp]
    for slot, prompt in enumerate(PROMPTS):
        rows, ids = got["rows"][slot], got["ids"][slot]
        assert rows.shape == (len(prompt), 1 + K)
        logp = reference[slot]  # (L, V)
        positions = torch.arange(len(prompt) - 1)
        want = logp[positions, torch.tensor(prompt[1:], dtype=torch.long)]
        torch.testing.assert_close(rows[:-1, 0], want, atol=1e-4, rtol=0)
        assert float(rows[-1, 0]) == 0.0  # the prompt's end: no next prompt token
        top = logp.topk(K, dim=-1)  # the alternatives, every position (the last too)
        torch.testing.assert_close(rows[:, 1:], top.values, atol=1e-4, rtol=0)
        assert torch.equal(ids.long(), top.indices)
    # The first output token is sampled at the prompt's end as a prefill samples it.
    assert [got["tokens"][s] for s in range(len(PROMPTS))] == first


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.process
def test_scored_programs_leave_the_state_plain_prefills_leave(checkpoint, runs, tp):
    _, first, _ = checkpoint
    got = runs[tp]
    assert got["kv_max_diff"] < 1e-5 and got["kv_written"] > 0
    assert got["scored-pending"] == got["plain-pending"] == [t[0] for t in first]


@pytest.mark.process
def test_tp2_ranks_agree(runs):
    assert runs["rank1"]["scored-pending"] == runs[2]["scored-pending"]
    assert runs["rank1"]["rows"] == {}  # only rank 0 reports


def test_the_capacity_builds_scored_shapes_like_the_prefill_shapes(checkpoint):
    path, _, _ = checkpoint
    w = make_worker(path)
    kinds = {GraphKind.PREFILL: [], GraphKind.SCORED_PREFILL: []}
    for d in w.report().descriptors:
        if d.kind in kinds:
            kinds[d.kind].append((d.batch_capacity, d.prompt_capacity))
    assert kinds[GraphKind.SCORED_PREFILL] == kinds[GraphKind.PREFILL] == [
        (1, 64), (1, 128), (1, 256), (2, 128), (2, 256), (4, 256)
    ]  # fmt: skip
    assert all(scored(b, c).key in w.programs for b, c in kinds[GraphKind.SCORED_PREFILL])
    assert ProgramShape.of(scored(4, 256)) == ProgramShape(256, 4, 256, scored=True)
    off = dataclasses.replace(CAPACITY, scored_prefill=False)
    assert not [d for d in build_catalog(off) if d.kind is GraphKind.SCORED_PREFILL]


def test_a_score_next_outside_the_vocabulary_is_refused_with_nothing_changed(checkpoint):
    path, _, _ = checkpoint
    w = make_worker(path)
    rows = [lane(0, 0, 5), lane(3, 0, 64)]
    before = snapshot(w)
    frame = Frame.from_lanes(1, scored(2, 128), rows, score_next=[-1, 128], score_k=2)
    with pytest.raises(ProgramError, match=r"score_next\[1\]: token 128 outside the vocabulary"):
        w.execute(frame)
    assert changed(before, snapshot(w)) == []
    ok = Frame.from_lanes(1, scored(2, 128), rows, score_next=[-1, 67], score_k=0)
    completion = w.execute(ok)  # k = 0: the next token's log probability alone
    assert tensor_to_torch(completion.sidecars["prompt_logprobs"]).shape == (69, 1)
    assert tensor_to_torch(completion.sidecars["prompt_logprob_token_ids"]).shape == (69, 0)


def test_the_wire_refuses_malformed_scored_frames():
    rows = [lane(0, 0, 5), lane(1, 0, 9)]
    for kwargs, field, program in [
        ({"score_next": [-1]}, "score_next", scored(2, 128)),  # one entry per lane
        ({"score_next": [-1, -2]}, r"score_next\[1\]", scored(2, 128)),
        ({"score_next": [-1, -1], "score_k": 21}, "score_k", scored(2, 128)),
        ({"score_next": [-1, -1]}, "score_next", plain(2, 128)),  # a plain prefill has none
        ({"score_k": 2}, "score_k", plain(2, 128)),
    ]:
        with pytest.raises(ProtocolError, match=field):
            Frame.from_lanes(1, program, rows, **kwargs)
    decode = FrameLane(1, 1, "decode", 0, (), 9, (), 1)
    with pytest.raises(ProtocolError, match=r"phase\[1\].*prefill lanes only"):
        Frame.from_lanes(1, scored(2, 128), [rows[0], decode], score_next=[-1, -1])
    frame = Frame.from_lanes(1, scored(2, 128), rows, score_next=[-1, 41], score_k=4)
    again = Frame.from_wire(frame.to_wire())
    assert again == frame and list(again.score_next) == [-1, 41] and again.score_k == 4
    assert np.array_equal(np.frombuffer(again.score_next, np.int64), [-1, 41])
