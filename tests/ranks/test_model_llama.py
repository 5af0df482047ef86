"""The rank model against Hugging Face transformers, at TP=1 and TP=2 (gloo).

Tiny random Llama (llama3 RoPE scaling, padded vocabulary at TP=2), Qwen2 (q/k/v
bias, linear RoPE scaling, tied embeddings) and Qwen3 (QK-norm, explicit head_dim,
one KV head replicated over two ranks) checkpoints are written with transformers,
loaded with our loader and run through the paged cache. The same scenario
function runs in this process (TP=1) and in two spawned gloo ranks (TP=2); the
module-scoped fixtures run each once and the tests compare.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.ranks.model.attention import AttentionMetadata
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.model.loader import load_model
from runtime.ranks.model.parallel import TPGroup

pytestmark = pytest.mark.process

PAGE_SIZE = 4
NUM_PAGES = 96
SEQ_LEN = 16  # (b): chunks of 6 and 5, then 5 decode steps
PROMPTS = [[5, 17, 33, 3, 60], [9, 9, 9, 41, 77, 12, 3, 50, 21], [88]]
MAX_NEW_TOKENS = 6
ATOL = 1e-4

MODELS = ["llama", "qwen2", "qwen3"]


# -- checkpoints ---------------------------------------------------------------------


def _hf_config(kind: str) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        max_position_embeddings=256,
    )
    if kind == "llama":
        return LlamaConfig(
            vocab_size=101,  # odd: padded to 102 at TP=2
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            tie_word_embeddings=False,
            **common,
        )
    if kind == "qwen2":
        return Qwen2Config(
            vocab_size=96,
            num_key_value_heads=2,
            rope_theta=1_000_000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            tie_word_embeddings=True,
            eos_token_id=95,
            **common,
        )
    return Qwen3Config(
        vocab_size=101,
        num_key_value_heads=1,  # replicated over the two ranks at TP=2
        head_dim=32,  # not hidden / heads
        tie_word_embeddings=False,
        **common,
    )


def _hf_model(kind: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3}[kind])
    model = AutoModelForCausalLM.from_config(_hf_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():  # zero biases and unit norms would hide loader mistakes
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.1)
            elif "norm" in name:
                param.copy_(1 + torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per model: its directory and the transformers reference outputs."""
    out: dict[str, dict[str, Any]] = {}
    gen = torch.Generator().manual_seed(0)
    for kind in MODELS:
        hf = _hf_model(kind)
        path = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(path)
        vocab = hf.config.vocab_size
        seq = torch.randint(0, vocab, (SEQ_LEN,), generator=gen)
        with torch.no_grad():
            full = hf(seq.unsqueeze(0)).logits[0]  # (SEQ_LEN, vocab)
            greedy = []
            for prompt in PROMPTS:
                ids = torch.tensor([prompt])
                gen_out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=MAX_NEW_TOKENS,
                    pad_token_id=0,
                )
                greedy.append(gen_out[0, len(prompt) :].tolist())
        out[kind] = {"dir": str(path), "seq": seq, "logits": full, "greedy": greedy}
    return out


# -- the scenarios (run by every rank) -----------------------------------------------------


class _Pages:
    """A shuffled free list standing in for the coordinator's page allocator."""

    def __init__(self, num_pages: int, seed: int) -> None:
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // PAGE_SIZE)
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def _step(
    model: LlamaForCausalLM,
    lanes: Sequence[tuple[list[int], int, list[int]]],
    *,
    logits_for: Sequence[Sequence[int]] | None = None,
    num_tokens: int | None = None,
    num_lanes: int | None = None,
    max_pages: int | None = None,
    max_query_len: int | None = None,
    inactive_at: Sequence[int] = (),
) -> list[torch.Tensor]:
    """One forward over packed lanes (new token ids, context length after, pages).

    ``logits_for[i]`` lists lane i's new-token offsets whose logits are returned
    (default: its last token); ``inactive_at`` inserts q_len-0 lanes at those lane
    positions. Returns per lane (len(logits_for[i]), vocab).
    """
    order: list[tuple[list[int], int, list[int]] | None] = list(lanes)
    for at in inactive_at:
        order.insert(at, None)
    q_lens = [0 if lane is None else len(lane[0]) for lane in order]
    ctx_lens = [0 if lane is None else lane[1] for lane in order]
    tables = [[] if lane is None else lane[2] for lane in order]
    meta, positions = AttentionMetadata.build(
        query_lens=q_lens,
        context_lens=ctx_lens,
        page_tables=tables,
        page_size=PAGE_SIZE,
        num_tokens=num_tokens,
        num_lanes=num_lanes,
        max_pages=max_pages,
        max_query_len=max_query_len,
    )
    ids = torch.zeros(meta.num_tokens, dtype=torch.int64)  # (N,)
    wanted: list[list[int]] = []
    start = 0
    lane_no = 0
    for lane, q in zip(order, q_lens):
        if lane is not None:
            ids[start : start + q] = torch.tensor(lane[0])
            offsets = [q - 1] if logits_for is None else list(logits_for[lane_no])
            wanted.append([start + o for o in offsets])
            lane_no += 1
        start += q
    flat = torch.tensor([i for w in wanted for i in w], dtype=torch.int64)  # (M,)
    logits = model(ids, positions, meta, flat)  # (M, vocab)
    return list(logits.split([len(w) for w in wanted]))


def _greedy(model: LlamaForCausalLM, prompt: list[int], pages: _Pages) -> list[int]:
    eos = set(model.config.eos_token_ids)
    table = pages.take(len(prompt) + MAX_NEW_TOKENS)
    (logits,) = _step(model, [(prompt, len(prompt), table)])
    out = [int(logits[-1].argmax())]
    while len(out) < MAX_NEW_TOKENS and out[-1] not in eos:
        (logits,) = _step(model, [([out[-1]], len(prompt) + len(out), table)])
        out.append(int(logits[-1].argmax()))
    return out


def run_scenarios(model_dir: str, seq: torch.Tensor, group: TPGroup) -> dict[str, Any]:
    model = load_model(model_dir, group)
    cache = model.allocate_kv_cache(NUM_PAGES, PAGE_SIZE)
    pages = _Pages(NUM_PAGES, seed=7)
    s = seq.tolist()
    out: dict[str, Any] = {}

    # (a) one prefill of 11 tokens, logits at every position.
    table = pages.take(11)
    (out["prefill"],) = _step(model, [(s[:11], 11, table)], logits_for=[range(11)])

    # (b) two prefill chunks (6 + 5), then 5 decode steps.
    table = pages.take(SEQ_LEN)
    (first,) = _step(model, [(s[:6], 6, table)], logits_for=[range(6)])
    (second,) = _step(model, [(s[6:11], 11, table)], logits_for=[range(5)])
    steps = [first, second]
    for pos in range(11, SEQ_LEN):
        (logits,) = _step(model, [([s[pos]], pos + 1, table)])
        steps.append(logits)
    out["chunked"] = torch.cat(steps)  # (SEQ_LEN, vocab)

    # (c) greedy decoding.
    out["greedy"] = [_greedy(model, p, pages) for p in PROMPTS]

    # (d) one prefill lane and two decode lanes packed (with padding) vs alone.
    a, b, c = s[2:9], s[:6], s[5:15]  # 7-token prompt; contexts of 5 and 9, +1 each
    alone: list[torch.Tensor] = []
    for prefix, new in ((b[:5], b[5:]), (c[:9], c[9:])):
        table = pages.take(len(prefix) + 1)
        _step(model, [(prefix, len(prefix), table)])
        (logits,) = _step(model, [(new, len(prefix) + 1, table)])
        alone.append(logits)
    table = pages.take(len(a))
    (a_alone,) = _step(model, [(a, len(a), table)], logits_for=[range(len(a))])
    tables = [pages.take(6), pages.take(len(a)), pages.take(10)]
    _step(model, [(b[:5], 5, tables[0])])
    _step(model, [(c[:9], 9, tables[2])])
    before = cache.key(0).clone(), cache.value(1).clone()
    mixed = _step(
        model,
        [(b[5:], 6, tables[0]), (a, len(a), tables[1]), (c[9:], 10, tables[2])],
        logits_for=[[0], range(len(a)), [0]],
        num_tokens=16,
        num_lanes=5,
        max_pages=6,
        max_query_len=8,
        inactive_at=(2,),
    )
    out["mixed"] = mixed
    out["alone"] = [alone[0], a_alone, alone[1]]
    # Only the lanes' own new slots changed: padding and the inactive lane wrote nothing.
    written = {(tables[0][1], 1), (tables[2][2], 1)} | {
        (tables[1][p // PAGE_SIZE], p % PAGE_SIZE) for p in range(len(a))
    }
    changed = set()
    for old, new in ((before[0], cache.key(0)), (before[1], cache.value(1))):
        diff = (old != new).any(-1).any(-1)  # (pages, page_size)
        changed |= {(int(p), int(o)) for p, o in diff.nonzero().tolist()}
    out["changed_outside"] = sorted(changed - written)
    return out


# -- TP=1 and TP=2 runs --------------------------------------------------------------------


def _tp2_worker(rank: int, store: str, jobs: list[tuple[str, str, torch.Tensor]], out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = TPGroup.from_process_group()
        results = {kind: run_scenarios(path, seq, group) for kind, path, seq in jobs}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(checkpoints: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory):
    """{tp: {model: scenario outputs}}; TP=2 also keeps rank 1's for comparison."""
    tp1 = {k: run_scenarios(v["dir"], v["seq"], TPGroup.single()) for k, v in checkpoints.items()}
    work: Path = tmp_path_factory.mktemp("tp2")
    jobs = [(k, v["dir"], v["seq"]) for k, v in checkpoints.items()]
    torch.multiprocessing.spawn(
        _tp2_worker, args=(str(work / "store"), jobs, str(work)), nprocs=2, join=True
    )
    rank0 = torch.load(work / "rank0.pt")
    rank1 = torch.load(work / "rank1.pt")
    return {1: tp1, 2: rank0, "rank1": rank1}


CASES = [(kind, tp) for tp in (1, 2) for kind in MODELS]
IDS = [f"{kind}-tp{tp}" for kind, tp in CASES]


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=IDS)
def test_prefill_matches_transformers(checkpoints, results, kind: str, tp: int) -> None:
    ref = checkpoints[kind]["logits"][:11]
    torch.testing.assert_close(results[tp][kind]["prefill"], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=IDS)
def test_chunked_prefill_and_decode_match_transformers(
    checkpoints, results, kind: str, tp: int
) -> None:
    ref = checkpoints[kind]["logits"]  # (SEQ_LEN, vocab)
    torch.testing.assert_close(results[tp][kind]["chunked"], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=IDS)
def test_greedy_matches_generate(checkpoints, results, kind: str, tp: int) -> None:
    assert results[tp][kind]["greedy"] == checkpoints[kind]["greedy"]


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=IDS)
def test_mixed_batch_matches_lanes_alone(results, kind: str, tp: int) -> None:
    got = results[tp][kind]
    for mixed, alone in zip(got["mixed"], got["alone"]):
        torch.testing.assert_close(mixed, alone, atol=1e-5, rtol=0)
    assert got["changed_outside"] == []


@pytest.mark.parametrize("kind", MODELS)
def test_tp2_ranks_agree_bitwise(results, kind: str) -> None:
    a, b = results[2][kind], results["rank1"][kind]
    for key in ("prefill", "chunked"):
        assert torch.equal(a[key], b[key])
    assert a["greedy"] == b["greedy"]
