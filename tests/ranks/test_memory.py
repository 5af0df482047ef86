"""KV cache sizing (runtime/ranks/memory.py): bytes per page under the tensor-parallel
split, budgets to pages, the refusals and their numbers, the CUDA budget formula,
and the rank entry point's sizing; the dummy forward of the CUDA profile runs on
the CPU too."""

from __future__ import annotations

import pytest
import torch

from runtime.ranks import memory
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.memory import DeviceMemory, KVCacheSizeError, KVPool
from runtime.ranks.model import LlamaForCausalLM, ModelConfig, TPGroup
from runtime.ranks.model.parallel import QKVParallelLinear
from runtime.ranks.shapes import ProgramShape

ENDPOINTS = ["--frames-endpoint", "ipc:///x/f", "--completions-endpoint", "ipc:///x/c"]


def config(kv_heads: int = 2, max_positions: int = 4096) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=96, hidden_size=128,
        intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=max_positions,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kv_heads", "world", "local_heads"),
    [(2, 1, 2), (2, 2, 1), (4, 2, 2), (2, 4, 1)],  # (2, 4): a head replicated on 2 ranks
)
def test_bytes_per_page_follow_the_tensor_parallel_split(kv_heads, world, local_heads):
    cfg = config(kv_heads)
    # The model code's split: the local KV heads of QKVParallelLinear on rank 0.
    qkv = QKVParallelLinear(128, 32, 4, kv_heads, bias=False, group=TPGroup(0, world))
    assert qkv.num_kv_heads == local_heads
    # layers x (K, V) x page_size x local KV heads x head_dim x dtype bytes
    assert memory.kv_bytes_per_page(cfg, world, 16, 4) == 4 * 2 * 16 * local_heads * 32 * 4
    assert memory.kv_bytes_per_page(cfg, world, 16, 2) == 4 * 2 * 16 * local_heads * 32 * 2


def test_a_budget_holds_the_pages_the_cache_allocates():
    model = LlamaForCausalLM(config())
    page_bytes = memory.kv_bytes_per_page(model.config, 1, 16, 4)
    assert page_bytes == 32768  # the embedded model's shape at TP=1, float32
    cache = model.allocate_kv_cache(10, 16)
    assert cache.nbytes == memory.kv_cache_bytes(10, page_bytes, 16)  # the scratch token too
    assert memory.pages_for_budget(cache.nbytes, page_bytes, 16) == 10
    assert memory.pages_for_budget(cache.nbytes - 1, page_bytes, 16) == 9
    assert memory.pages_for_budget(1 << 20, page_bytes, 16) == 31  # 32 less the scratch token
    assert memory.pages_for_budget(100, page_bytes, 16) == 0


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("512 mib", 512 << 20),
     ("1.5GB", 1_500_000_000), ("64KiB", 65536), ("2kb", 2000), ("0.5GiB", 1 << 29)],
)  # fmt: skip
def test_byte_counts_parse_with_and_without_units(text, value):
    assert memory.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "1.5", "4XB", "0", "-1", "4 GiB B", "0.1B"])
def test_bad_byte_counts_are_refused(text):
    with pytest.raises(ValueError, match=r"4GiB|byte"):
        memory.parse_bytes(text)


def test_max_model_len_refusal_names_the_numbers():
    page_bytes = memory.kv_bytes_per_page(config(), 1, 16, 4)
    pool = memory.plan_pool(page_bytes, 16, kv_cache_memory=1 << 20)
    assert (pool.num_pages, pool.flag, pool.budget_bytes) == (31, "--kv-cache-memory", 1 << 20)
    pool.check(4096, None)  # no --max-model-len: a smaller pool bounds each request
    with pytest.raises(KVCacheSizeError) as info:
        pool.check(4096, 4096)
    message = str(info.value)
    for words in ("--kv-cache-memory 1048576", "--max-model-len 4096", "needs 256 pages",
                  "31 pages", "32768 bytes per page", "(1.0 MiB)",
                  "raise --kv-cache-memory"):  # fmt: skip
        assert words in message, (words, message)
    assert len(message.splitlines()) == 1


def test_each_source_of_the_pool_is_named():
    by_pages = memory.plan_pool(32768, 16, num_pages=3, kv_cache_memory=1 << 30)
    assert (by_pages.num_pages, by_pages.flag, by_pages.budget_bytes) == (3, "--num-pages", None)
    with pytest.raises(KVCacheSizeError, match=r"^--num-pages 3: .* at least 64 tokens"):
        by_pages.check(4096, None)  # 48 tokens: not even the shortest context
    default = memory.plan_pool(32768, 16)
    assert default.budget_bytes == memory.DEFAULT_CPU_KV_CACHE_BYTES == 512 << 20
    assert default.num_pages == 16383
    assert default.origin == "--kv-cache-memory (default on CPU: 536870912 bytes = 512.0 MiB)"
    measured = DeviceMemory(0.5, 64 << 30, 8 << 30, 1 << 30, 2 << 30, 1 << 30)
    by_device = memory.plan_pool(1 << 20, 16, device_budget=measured)
    assert by_device.budget_bytes == 20 << 30 and by_device.num_pages == (20 << 10) - 1
    assert by_device.flag == "--gpu-memory-utilization"


def test_deployment_pools_are_known_before_the_ranks_start_except_on_cuda():
    cfg = config()
    assert memory.plan_deployment_pool(cfg, 1, 16, "auto", cuda=True) is None  # measured
    cpu = memory.plan_deployment_pool(cfg, 2, 16, "auto", cuda=False)
    assert cpu is not None and cpu.page_bytes == 16384  # float32, one KV head per rank
    cuda = memory.plan_deployment_pool(cfg, 1, 16, "auto", cuda=True, kv_cache_memory=1 << 20)
    assert cuda is not None and cuda.page_bytes == 16384  # bfloat16
    half = memory.plan_deployment_pool(cfg, 1, 16, "float16", cuda=False, num_pages=5)
    assert half is not None and (half.num_pages, half.page_bytes) == (5, 16384)


def test_the_cuda_budget_formula_and_the_graph_pool_check():
    gib = 1 << 30
    m = DeviceMemory(
        utilization=0.9, total_bytes=100 * gib, weights_bytes=20 * gib, other_bytes=gib,
        activation_bytes=3 * gib, reserve_bytes=memory.GRAPH_POOL_RESERVE_BYTES,
    )  # fmt: skip
    assert gib == memory.GRAPH_POOL_RESERVE_BYTES
    assert m.kv_bytes == int(0.9 * 100 * gib) - 25 * gib
    text = m.describe()
    for words in ("--gpu-memory-utilization 0.9", "100.00 GiB total", "20.00 GiB weights",
                  "3.00 GiB peak activations", "1.00 GiB graph-pool reserve",
                  f"= {m.kv_bytes} bytes"):  # fmt: skip
        assert words in text, (words, text)
    assert DeviceMemory(0.1, 100 * gib, 20 * gib, 0, 0).kv_bytes == 0  # never negative
    memory.check_programs_fit(m, 4 * gib)  # activations + reserve
    with pytest.raises(KVCacheSizeError) as info:
        memory.check_programs_fit(m, 4 * gib + 1)
    message = str(info.value)
    assert f"took {4 * gib + 1} bytes" in message and f"{4 * gib} bytes" in message
    assert "--gpu-memory-utilization" in message


def test_largest_shapes_are_the_most_tokens_and_the_most_lanes():
    capacity = CapacityConfig(max_concurrency=6, max_prefill_tokens=512)
    assert memory.largest_shapes(capacity, 4096) == [
        ProgramShape(512, 1, 512),
        ProgramShape(8, 8, 1),
    ]
    assert memory.largest_shapes(capacity, 256) == [
        ProgramShape(256, 1, 256),
        ProgramShape(8, 8, 1),
    ]
    mixed = CapacityConfig(max_concurrency=6, max_prefill_tokens=512, mixed_prefill=True)
    assert memory.largest_shapes(mixed, 4096) == [ProgramShape(512 + 7, 8, 512, 1)]


@pytest.mark.parametrize(("mixed", "packed"), [(False, False), (True, False), (False, True)])
def test_the_profile_forward_runs_at_the_largest_shapes(mixed, packed):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config(max_positions=256))
    for parameter in model.parameters():  # constructed, not loaded: give it values
        parameter.data.normal_(0.0, 0.05)
    model.allocate_kv_cache(1, 16)  # one page: the forward writes nothing
    capacity = CapacityConfig(
        max_concurrency=3, max_prefill_tokens=128, mixed_prefill=mixed, packed_prefill=packed
    )
    shapes = memory.largest_shapes(capacity, 256)
    if packed:  # the packed prefill of 2 rows over 128 tokens has the most tokens
        assert shapes[0] == ProgramShape(128, 2, 128)
    for shape in shapes:
        top = memory.dummy_forward(model, shape, 256, 16)
        assert top.shape == (shape.lanes,) and torch.isfinite(top).all()


def test_the_profile_forward_packs_every_shape_with_every_lane_active():
    """A packed prefill's B rows share C tokens: the longest first, every one
    active; the other kinds as before (a mixed prompt row first, full lanes)."""
    assert memory.packed_lengths(128, [128] * 4) == [125, 1, 1, 1]
    assert memory.packed_lengths(64, [64] * 64) == [1] * 64
    assert memory.packed_lengths(64 + 3, [64, 1, 1, 1]) == [64, 1, 1, 1]  # mixed (4, 1, 64)
    assert memory.packed_lengths(8, [4, 4]) == [4, 4]  # a rectangular round
    assert memory.packed_lengths(4, [1] * 4) == [1] * 4  # decode
    model = LlamaForCausalLM(config(max_positions=256))
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.05)
    model.allocate_kv_cache(1, 16)
    for shape in (ProgramShape(128, 4, 128), ProgramShape(64, 64, 64)):  # packed prefills
        top = memory.dummy_forward(model, shape, 256, 16)
        assert top.shape == (shape.lanes,) and torch.isfinite(top).all()


def test_the_rank_entry_point_sizes_its_cache_from_the_flags():
    from runtime.cli.rank_process import parse_args
    from runtime.ranks.process import size_kv_cache

    model = LlamaForCausalLM(config())
    args = parse_args([*ENDPOINTS, "--kv-cache-memory", "1MiB", "--device", "cpu"])
    pool, measured = size_kv_cache(args, model, 1, False, 4096)
    assert (pool.num_pages, measured) == (31, None)
    pool, _ = size_kv_cache(parse_args(ENDPOINTS), model, 1, False, 4096)
    assert pool.num_pages == 16383  # the CPU default budget
    pool, _ = size_kv_cache(parse_args([*ENDPOINTS, "--num-pages", "7"]), model, 1, False, 4096)
    assert isinstance(pool, KVPool) and pool.num_pages == 7
    refused = parse_args([*ENDPOINTS, "--kv-cache-memory", "1MiB", "--max-model-len", "1024"])
    with pytest.raises(KVCacheSizeError, match="--max-model-len 1024 tokens, which needs 64"):
        size_kv_cache(refused, model, 1, False, 1024)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--frame-timeout-multiple", "0"], "--frame-timeout-multiple"),
        (["--frame-timeout-margin", "inf"], "--frame-timeout-margin"),
        (["--num-pages", "0"], "--num-pages"),
    ],
)
def test_the_rank_entry_point_refuses_bad_sizing_flags(capsys, flags, needle):
    from runtime.cli.rank_process import parse_args

    with pytest.raises(SystemExit):
        parse_args([*ENDPOINTS, *flags])
    assert needle in capsys.readouterr().err


def test_the_cuda_profile_measures_one_forward_at_the_largest_shapes(monkeypatch):
    """The CUDA measurement's flow, with torch.cuda's counters faked on the CPU."""
    model = LlamaForCausalLM(config(max_positions=256))
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.05)
    allocated = iter([1000, 1100])  # after loading (weights), then with the one-page cache
    fakes = {
        "synchronize": lambda *a: None,
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda *a: None,
        "memory_allocated": lambda *a: next(allocated),
        "max_memory_allocated": lambda *a: 5100,
        "memory_reserved": lambda *a: 30_000,
        "mem_get_info": lambda *a: (60_000, 100_000),
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    shapes = []
    real_forward = memory.dummy_forward

    def forward(model, shape, max_context, page_size):
        assert model.kv_cache is not None and model.kv_cache.num_pages == 1
        shapes.append(shape)
        return real_forward(model, shape, max_context, page_size)

    monkeypatch.setattr(memory, "dummy_forward", forward)
    capacity = CapacityConfig(max_concurrency=3, max_prefill_tokens=128)
    measured = memory.profile_cuda(model, capacity, 256, 16, 0.9)
    assert shapes == [ProgramShape(128, 1, 128), ProgramShape(4, 4, 1)]
    assert measured == DeviceMemory(
        0.9, 100_000, 1000, 10_000, 4000, memory.GRAPH_POOL_RESERVE_BYTES
    )
    assert model.kv_cache is None  # the worker allocates the real one


def test_the_rank_entry_point_sizes_a_cuda_cache_by_the_utilization_rule(monkeypatch):
    from runtime.cli.rank_process import parse_args
    from runtime.ranks.process import size_kv_cache

    model = LlamaForCausalLM(config())  # float32: 32768 bytes per page
    device = DeviceMemory(0.5, 10 * 1 << 30, 1 << 30, 0, 1 << 30, 3 * (1 << 30) - (1 << 20))
    assert device.kv_bytes == 1 << 20
    seen = []
    monkeypatch.setattr(memory, "profile_cuda", lambda *a: seen.append(a[-1]) or device)
    args = parse_args([*ENDPOINTS, "--gpu-memory-utilization", "0.5"])
    pool, measured = size_kv_cache(args, model, 1, True, 4096)
    assert (pool.num_pages, measured, seen) == (31, device, [0.5])
    assert pool.origin.startswith("--gpu-memory-utilization 0.5: 0.5 x 10.00 GiB total")
    args = parse_args([*ENDPOINTS, "--max-model-len", "1024"])
    with pytest.raises(
        KVCacheSizeError, match=r"^--gpu-memory-utilization 0\.5: .* needs 64 pages"
    ):
        size_kv_cache(args, model, 1, True, 1024)
    # --kv-cache-memory and --num-pages measure nothing.
    seen.clear()
    pool, measured = size_kv_cache(
        parse_args([*ENDPOINTS, "--kv-cache-memory", "2MiB"]), model, 1, True, 4096
    )
    assert (pool.num_pages, measured, seen) == (63, None, [])


def test_the_rank_worker_gets_the_sized_pool_and_the_frame_timeouts():
    from runtime.cli.rank_process import parse_args
    from runtime.ranks.process import build_worker

    model = LlamaForCausalLM(config(max_positions=256))
    flags = ["--kv-cache-memory", "1MiB", "--max-concurrency", "2", "--max-prefill-tokens", "64",
             "--frame-timeout-multiple", "3", "--frame-timeout-margin", "1.5"]  # fmt: skip
    worker = build_worker(parse_args([*ENDPOINTS, *flags]), model, "/models/tiny", False, None)
    assert worker.report().num_pages == 31 and model.kv_cache.num_pages == 31
    assert (worker.frame_timeout_multiple, worker.frame_timeout_margin_s) == (3.0, 1.5)
    refused = parse_args([*ENDPOINTS, "--num-pages", "2"])  # 32 tokens: under one prefill
    with pytest.raises(KVCacheSizeError, match=r"^--num-pages 2: .* at least 64 tokens"):
        build_worker(refused, model, "/models/tiny", False, None)
