"""KV cache size: how many pages a rank's paged KV cache holds, as vLLM users expect.

The pool of every rank comes from the first of:

1. ``--num-pages N``: exactly N pages, on any device.
2. ``--kv-cache-memory BYTES``: as many pages as fit that many bytes per rank.
3. CPU: :data:`DEFAULT_CPU_KV_CACHE_BYTES` per rank.
4. CUDA: ``--gpu-memory-utilization U`` of the device, less what the rank
   needs besides the cache, measured at start-up (:func:`profile_cuda`)::

       KV bytes = U x total - weights - other - peak activations - graph-pool reserve

   ``other`` is device memory in use outside torch's allocator (the CUDA
   context, NCCL buffers, other processes); ``peak activations`` is the peak
   of one forward at the catalog's largest shapes (the graphs' pool holds one
   copy of it), for a vision model with its feature store held throughout and
   one encode of the largest vision frame (:func:`vision_dummies`); the
   reserve (:data:`GRAPH_POOL_RESERVE_BYTES`) covers what capture takes
   beyond that.  :func:`check_programs_fit` checks it after
   capture.

A page holds ``page_size`` tokens of K and V for every layer and this rank's
KV heads: heads split over the tensor-parallel ranks, replicated when there
are fewer heads than ranks (:meth:`ModelConfig.local_kv_heads`, as
``QKVParallelLinear`` splits them).  The cache also holds one scratch token
per layer (``PagedKVCache``), counted against the budget.

Every refusal is a :class:`KVCacheSizeError` whose message starts with the
flag that sized the pool and names the numbers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from runtime.catalog import PROMPT_ALIGNMENT

if TYPE_CHECKING:
    import torch

    from runtime.ranks.capacity import CapacityConfig
    from runtime.ranks.model.config import ModelConfig
    from runtime.ranks.model.llama import LlamaForCausalLM
    from runtime.ranks.shapes import ProgramShape

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
# CPU ranks have no device to measure: a fixed budget per rank.  512 MiB holds
# 16,383 pages of 16 tokens of the embedded model (float32, TP=1) and about
# 22k tokens of a 0.5B Qwen2 in float32; allocating it takes about 0.5 s.
DEFAULT_CPU_KV_CACHE_BYTES = 512 * MIB
# What CUDA graph capture may take beyond one copy of the peak activations:
# later graphs' outputs, pool fragmentation, cuBLAS workspaces, graph objects.
GRAPH_POOL_RESERVE_BYTES = 1 * GIB
MIN_CONTEXT = PROMPT_ALIGNMENT  # the shortest context the ranks serve (one prefill bucket)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": MIB, "gib": GIB, "tib": 1 << 40})
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


class KVCacheSizeError(ValueError):
    """The KV pool cannot be sized as asked; the message names the flag and the numbers."""


def format_bytes(n: int | float) -> str:
    """``1.50 GiB``, ``512.0 MiB``, ``64.0 KiB``: for messages, beside exact counts."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def parse_bytes(text: str) -> int:
    """A byte count: ``4294967296``, ``4GiB``, ``512 MiB``, ``1.5GB`` (KiB/MiB/GiB/TiB
    are powers of 1024, KB/MB/GB/TB of 1000; any case); ValueError if not one."""
    match = _SIZE.fullmatch(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ValueError(f"must be a byte count such as 4294967296, 4GiB or 512MiB, got {text!r}")
    if unit == 1 and "." in match.group(1):
        raise ValueError(f"must be a whole number of bytes, got {text!r}")
    value = math.floor(Fraction(match.group(1)) * unit)
    if value < 1:
        raise ValueError(f"must be at least 1 byte, got {text!r}")
    return value


def kv_bytes_per_token(config: ModelConfig, world_size: int, dtype_bytes: int) -> int:
    """K and V of one token, every layer, this rank's KV heads."""
    heads = config.local_kv_heads(world_size)
    return config.num_hidden_layers * 2 * heads * config.head_dim * dtype_bytes


def kv_bytes_per_page(
    config: ModelConfig, world_size: int, page_size: int, dtype_bytes: int
) -> int:
    """layers x 2 (K, V) x page_size x local KV heads x head_dim x dtype bytes."""
    return page_size * kv_bytes_per_token(config, world_size, dtype_bytes)


def kv_cache_bytes(num_pages: int, page_bytes: int, page_size: int) -> int:
    """What a cache of ``num_pages`` pages allocates (its scratch token included)."""
    return num_pages * page_bytes + page_bytes // page_size


def pages_for_budget(budget_bytes: int, page_bytes: int, page_size: int) -> int:
    """The most pages whose cache (scratch token included) fits ``budget_bytes``."""
    return max(0, (budget_bytes - page_bytes // page_size) // page_bytes)


def pages_for_tokens(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass(frozen=True)
class KVPool:
    """A rank's KV pool and where its size came from (for the messages)."""

    num_pages: int
    page_size: int
    page_bytes: int  # per page, on each rank
    origin: str  # what sized it: the flag first, then the budget in bytes
    flag: str  # the flag to raise when it is too small
    budget_bytes: int | None = None  # None: --num-pages, no budget

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    def _held(self) -> str:
        pages = f"{self.num_pages} page{'s' if self.num_pages != 1 else ''}"
        held = f"the KV pool ({pages} of {self.page_size} tokens = {self.tokens} tokens"
        return held + f", {self.page_bytes} bytes per page on each rank)"

    def check(self, context: int, max_model_len: int | None) -> None:
        """The pool must hold one request.

        With ``max_model_len`` it must hold one request of ``context`` tokens
        (as vLLM requires); without it, a pool smaller than the model's
        context bounds each request's prompt + max_tokens instead, and must
        hold at least :data:`MIN_CONTEXT` tokens.
        """
        needed = pages_for_tokens(context, self.page_size)
        if max_model_len is not None and self.tokens < context:
            raise KVCacheSizeError(
                f"{self.origin}: {self._held()} cannot hold one request of --max-model-len "
                f"{context} tokens, which needs {needed} pages "
                f"({needed * self.page_bytes} bytes); raise {self.flag} or lower --max-model-len"
            )
        if self.tokens < MIN_CONTEXT:
            raise KVCacheSizeError(
                f"{self.origin}: {self._held()} cannot hold one request: flare needs at least "
                f"{MIN_CONTEXT} tokens ({pages_for_tokens(MIN_CONTEXT, self.page_size)} pages), "
                f"and one request of the model's context of {context} tokens needs {needed} "
                f"pages; raise {self.flag}"
            )

    def shortfall(self, context: int) -> str | None:
        """A warning when the pool, though it passes :meth:`check`, holds fewer tokens
        than one request of the whole context (``--max-model-len``, or the model's
        context when not given): every request's prompt + max_tokens is then bounded
        by the pool, not by the context.  None when one full request fits."""
        if self.tokens >= context:
            return None
        needed = pages_for_tokens(context, self.page_size)
        return (
            f"{self.origin}: {self._held()} cannot hold one request of the --max-model-len "
            f"context ({context} tokens; default: the model's), which needs {needed} pages "
            f"({needed * self.page_bytes} bytes), so a request's prompt + max_tokens is "
            f"limited to {self.tokens} tokens; raise {self.flag}, or set --max-model-len "
            f"{self.tokens} or lower"
        )


def plan_pool(
    page_bytes: int,
    page_size: int,
    *,
    num_pages: int | None = None,
    kv_cache_memory: int | None = None,
    device_budget: DeviceMemory | None = None,
) -> KVPool:
    """The pool the flags ask for: ``num_pages``, else ``kv_cache_memory`` bytes,
    else ``device_budget`` (CUDA, measured), else the CPU default budget."""
    if num_pages is not None:
        return KVPool(num_pages, page_size, page_bytes, f"--num-pages {num_pages}", "--num-pages")
    if kv_cache_memory is not None:
        origin = f"--kv-cache-memory {kv_cache_memory} ({format_bytes(kv_cache_memory)})"
        flag, budget = "--kv-cache-memory", kv_cache_memory
    elif device_budget is not None:
        origin, flag = device_budget.describe(), "--gpu-memory-utilization"
        budget = device_budget.kv_bytes
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
        origin = f"--kv-cache-memory (default on CPU: {budget} bytes = {format_bytes(budget)})"
        flag = "--kv-cache-memory"
    pages = pages_for_budget(budget, page_bytes, page_size)
    return KVPool(pages, page_size, page_bytes, origin, flag, budget)


def plan_deployment_pool(
    config: ModelConfig,
    world_size: int,
    page_size: int,
    dtype: str,
    cuda: bool,
    *,
    num_pages: int | None = None,
    kv_cache_memory: int | None = None,
) -> KVPool | None:
    """The pool the ranks of a deployment will hold, known before they start
    (``dtype`` as ``--dtype`` spells it, auto: bfloat16 on CUDA, float32 on CPU);
    None when the ranks measure it (CUDA, no ``--num-pages`` or ``--kv-cache-memory``)."""
    if cuda and num_pages is None and kv_cache_memory is None:
        return None
    dtype_bytes = DTYPE_BYTES[dtype] if dtype != "auto" else (2 if cuda else 4)
    page_bytes = kv_bytes_per_page(config, world_size, page_size, dtype_bytes)
    return plan_pool(page_bytes, page_size, num_pages=num_pages, kv_cache_memory=kv_cache_memory)


# -- CUDA: the utilization rule ----------------------------------------------------------


@dataclass(frozen=True)
class DeviceMemory:
    """One CUDA rank's memory, measured at start-up, and the KV budget it leaves."""

    utilization: float
    total_bytes: int
    weights_bytes: int
    other_bytes: int  # outside torch's allocator: CUDA context, NCCL, other processes
    activation_bytes: int  # peak of one forward at the catalog's largest shapes
    reserve_bytes: int = GRAPH_POOL_RESERVE_BYTES

    @property
    def kv_bytes(self) -> int:
        """utilization x total - weights - other - peak activations - reserve (>= 0)."""
        usable = math.floor(self.utilization * self.total_bytes)
        spent = self.weights_bytes + self.other_bytes + self.activation_bytes + self.reserve_bytes
        return max(0, usable - spent)

    def describe(self) -> str:
        g = format_bytes
        return (
            f"--gpu-memory-utilization {self.utilization:g}: {self.utilization:g} x "
            f"{g(self.total_bytes)} total - {g(self.weights_bytes)} weights - "
            f"{g(self.other_bytes)} other - {g(self.activation_bytes)} peak activations - "
            f"{g(self.reserve_bytes)} graph-pool reserve = {self.kv_bytes} bytes "
            f"({g(self.kv_bytes)}) for the KV cache"
        )


def check_programs_fit(memory: DeviceMemory, programs_bytes: int) -> None:
    """After capture: what preparing the programs took beyond the KV cache (their
    buffers and the CUDA graph pool) must fit the peak activations plus the reserve."""
    planned = memory.activation_bytes + memory.reserve_bytes
    if programs_bytes > planned:
        raise KVCacheSizeError(
            f"{memory.describe()}; but the prepared programs (buffers and CUDA graph pool) "
            f"took {programs_bytes} bytes ({format_bytes(programs_bytes)}), over the "
            f"{planned} bytes ({format_bytes(planned)}) planned for them (peak activations + "
            "graph-pool reserve); lower --gpu-memory-utilization, or size the cache with "
            "--kv-cache-memory or --num-pages"
        )


def largest_shapes(capacity: CapacityConfig, max_context: int) -> list[ProgramShape]:
    """The catalog's shapes with the most tokens and with the most lanes."""
    from runtime.ranks.capacity import build_catalog, forward_programs
    from runtime.ranks.shapes import ProgramShape

    catalog = forward_programs(build_catalog(capacity, max_context))
    shapes = [ProgramShape.of(d) for d in catalog]
    most_tokens = max(shapes, key=lambda s: (s.tokens, s.lanes, s.scored))
    most_lanes = max(shapes, key=lambda s: (s.lanes, s.tokens))
    return [most_tokens] if most_lanes == most_tokens else [most_tokens, most_lanes]


def packed_lengths(tokens: int, bounds: list[int]) -> list[int]:
    """Every lane active (one token at least), the ``tokens`` filled in lane order
    up to each lane's bound: the prompt row first (mixed), every lane full
    (decode, rectangular rounds), or, when the lanes share fewer tokens than
    their bounds sum to (a packed prefill's B rows over C tokens), the first
    rows longest.  Sums to ``tokens`` when they fit."""
    lens = [1] * len(bounds)
    left = tokens - len(bounds)
    for i, bound in enumerate(bounds):
        extra = max(0, min(bound - 1, left))
        lens[i] += extra
        left -= extra
    return lens


def dummy_forward(
    model: LlamaForCausalLM, shape: ProgramShape, max_context: int, page_size: int
) -> torch.Tensor:
    """One forward at ``shape`` over the whole context width (as captured programs
    attend), every lane active and the tokens full (:func:`packed_lengths`),
    writing no KV; then the sampler's (L, vocab) temporaries (a float copy,
    softmax, a sort for top-p).  Any device."""
    import torch

    from runtime.ranks.model.attention import AttentionMetadata
    from runtime.ranks.shapes import SCORE_ROWS
    from runtime.transport.sampling import MAX_LOGPROBS

    device = model.model.embed_tokens.weight.device
    n, lanes, q = shape.tokens, shape.lanes, shape.max_query_len
    row = shape.row_query_len if shape.mixed else q
    lens = packed_lengths(n, [q] + [row] * (lanes - 1))
    starts = [sum(lens[:i]) for i in range(lanes)]
    if starts[-1] + lens[-1] != n:
        raise ValueError(f"shape {shape} does not pack {lens}")
    positions = [max_context - length + j for length in lens for j in range(length)]

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    max_pages = pages_for_tokens(max_context, page_size)
    metadata = AttentionMetadata(
        query_start=ints(starts),
        query_lens=ints(lens),
        context_lens=ints([max_context] * lanes),
        page_tables=torch.zeros(lanes, max_pages, dtype=torch.int64, device=device),  # (L, P)
        slot_mapping=ints([-1] * n),  # write nothing
        max_query_len=q,
        prefill_row=ints([0]) if shape.mixed else None,
        row_query_len=shape.row_query_len,
    )
    last = ints([s + length - 1 for s, length in zip(starts, lens)])  # (L,)
    if shape.scored:  # a scored prefill: logits at every token, then its lanes' last
        every = model(ints([0] * n), ints(positions), metadata, ints(list(range(n))))  # (N, V)
        k = min(MAX_LOGPROBS, every.shape[-1])
        scored = torch.log_softmax(every[:SCORE_ROWS].float(), -1).topk(k, -1)
        logits = every.index_select(0, last).float() + scored.values[:1, :1]  # (L, V)
    else:
        logits = model(ints([0] * n), ints(positions), metadata, last).float()  # (L, V)
    probs = logits.softmax(-1)  # (L, V)
    return probs.sort(dim=-1, descending=True).values[:, 0]  # (L,)


def vision_dummies(model: LlamaForCausalLM, capacity: CapacityConfig) -> torch.Tensor | None:
    """A vision model: a feature store of the size the rank allocates (returned,
    so the caller holds it across its forwards) after one encode of the largest
    vision frame's images into it; None for a text-only model."""
    import torch

    from runtime.ranks.vision_programs import FeatureStore

    vision = model.config.vision
    if vision is None:
        return None
    store = FeatureStore.for_model(model, capacity)
    assert store is not None
    enc = vision.encoder
    images = max(capacity.vision_batches())
    size = (images, enc.num_channels, enc.image_size, enc.image_size)
    device = store.features.device
    features = model.encode_images(torch.zeros(size, device=device))  # type: ignore[operator]
    n = store.capacity.image_tokens
    rows = torch.full((images * n,), store.scratch, dtype=torch.int64, device=device)
    store.features.index_copy_(0, rows, features.reshape(images * n, -1).to(store.features.dtype))
    return store.features


def profile_cuda(
    model: LlamaForCausalLM,
    capacity: CapacityConfig,
    max_context: int,
    page_size: int,
    utilization: float,
    reserve_bytes: int = GRAPH_POOL_RESERVE_BYTES,
) -> DeviceMemory:
    """Measure a CUDA rank before its KV cache exists: weights (allocated now),
    the peak of :func:`dummy_forward` at :func:`largest_shapes` over a one-page
    temporary cache (``torch.cuda.max_memory_allocated``), and the memory in
    use outside torch.  The model has no cache bound afterwards."""
    import torch

    device = model.model.embed_tokens.weight.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    model.allocate_kv_cache(1, page_size)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    store = vision_dummies(model, capacity)  # held across the forwards below
    for shape in largest_shapes(capacity, max_context):
        dummy_forward(model, shape, max_context, page_size)
    del store
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    model.kv_cache = None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = max(0, total - free - torch.cuda.memory_reserved(device))
    return DeviceMemory(utilization, total, weights, other, peak, reserve_bytes)


def device_used_bytes(device: torch.device) -> int:
    """CUDA: memory in use on ``device`` (every process), after releasing torch's
    cached blocks."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free
