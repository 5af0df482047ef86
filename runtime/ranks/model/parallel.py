"""Tensor-parallel layers: each owns its shard shape and a weight loader that takes
its shard out of a full checkpoint tensor (or a safetensors slice, so a rank reads
only the bytes it keeps).

Communication lives here and nowhere else: one all-reduce in RowParallelLinear
(the end of each attention and MLP half), one in VocabParallelEmbedding, and one
all-gather in ParallelLMHead. Model code reads like single-device code.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.ranks.model.errors import LoadError

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RowParallelLinear",
    "ShardPart",
    "TPGroup",
    "VocabParallelEmbedding",
    "WeightSource",
    "default_weight_loader",
    "source_shape",
]


# -- the group ------------------------------------------------------------------


class ReleaseClock:
    """How long a frame's first collective held this rank (``perf_counter_ns``).

    The rank arms it just before running a program; the first collective
    that runs afterwards records the time from entering it to its return.  A
    synchronous collective (gloo on CPU) returns once every rank has reached
    it, so that time is this rank waiting for the last one to launch: the
    program's *launch wait* (the compute before the collective is not in it).
    A captured CUDA graph's collectives run on the device, where the host
    cannot see them: there it stays unarmed (0).
    """

    __slots__ = ("armed", "wait_ns")

    def __init__(self) -> None:
        self.armed = False
        self.wait_ns = 0

    def arm(self) -> None:
        self.armed, self.wait_ns = True, 0

    def enter(self) -> int:
        """The time a collective starts, when armed (else 0)."""
        return time.perf_counter_ns() if self.armed else 0

    def note(self, entered_ns: int) -> None:
        if self.armed and entered_ns:
            self.armed, self.wait_ns = False, time.perf_counter_ns() - entered_ns

    def take(self) -> int:
        """The first collective's wait in the last armed run (0: none ran), disarmed."""
        self.armed = False
        return self.wait_ns


RELEASE = ReleaseClock()  # one tensor-parallel group per process


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group.

    ``group`` is the torch.distributed process group; None means the default group
    when ``world_size > 1``. With ``world_size == 1`` torch.distributed is never
    touched (it need not be initialized).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup | None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1, None)

    @classmethod
    def from_process_group(cls, group: Any = None) -> TPGroup:
        """The group of an initialized torch.distributed (the default group if None)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        entered = RELEASE.enter()
        dist.all_reduce(x, group=self.group)
        RELEASE.note(entered)
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        """Stack every rank's ``x`` (same shape everywhere): (world_size, *x.shape)."""
        if self.world_size == 1:
            return x.unsqueeze(0)
        import torch.distributed as dist

        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))  # concatenated
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        entered = RELEASE.enter()
        gather(out, x.contiguous(), group=self.group)
        RELEASE.note(entered)
        return out.view(self.world_size, *x.shape)


# -- weight sources ---------------------------------------------------------------


class _Slice(Protocol):  # safetensors' PySafeSlice
    def get_shape(self) -> list[int]: ...
    def __getitem__(self, index: Any) -> Tensor: ...


WeightSource = Tensor | _Slice  # a full tensor, or a lazy slice of one in a file


def source_shape(src: WeightSource) -> tuple[int, ...]:
    if isinstance(src, Tensor):
        return tuple(src.shape)
    return tuple(src.get_shape())


def _read(src: WeightSource, dim: int, start: int, length: int) -> Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of the source."""
    index: tuple[slice, ...] = (slice(None),) * dim + (slice(start, start + length),)
    return src[index]


def _check_shape(src: WeightSource, expected: tuple[int, ...]) -> None:
    got = source_shape(src)
    if got != expected:
        raise LoadError(f"has shape {list(got)}, expected {list(expected)}")


def default_weight_loader(param: Tensor, src: WeightSource) -> None:
    """Copy a replicated (unsharded) tensor, checking its shape."""
    _check_shape(src, tuple(param.shape))
    with torch.no_grad():
        param.copy_(_read(src, 0, 0, param.shape[0]))


# -- column parallel ----------------------------------------------------------------


@dataclass(frozen=True)
class ShardPart:
    """One checkpoint tensor's rows inside a column-parallel weight on this rank."""

    full_size: int  # rows of the checkpoint tensor
    start: int  # first checkpoint row this rank keeps
    local_size: int  # rows this rank keeps
    local_offset: int  # where they start in the local weight


def _even_parts(output_sizes: Sequence[int], group: TPGroup) -> list[ShardPart]:
    parts, offset = [], 0
    for size in output_sizes:
        if size % group.world_size:
            raise ValueError(
                f"output size {size} is not divisible by the tensor-parallel size "
                f"{group.world_size}"
            )
        local = size // group.world_size
        parts.append(ShardPart(size, group.rank * local, local, offset))
        offset += local
    return parts


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split over the ranks: each rank
    computes its slice of the outputs and nothing is communicated.

    Several checkpoint tensors may be merged into one weight (``parts``); the loader
    is then called once per part with its ``shard_id``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        group: TPGroup,
        dtype: torch.dtype | None = None,
        parts: Sequence[ShardPart] | None = None,
        shard_ids: Sequence[Hashable] = (None,),
    ) -> None:
        super().__init__()
        self.group = group
        self.input_size = input_size
        self.parts = list(parts) if parts is not None else _even_parts([output_size], group)
        self.shard_ids = list(shard_ids)
        if len(self.shard_ids) != len(self.parts):
            raise ValueError("one shard id per part")
        self.output_size_per_partition = sum(p.local_size for p in self.parts)
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_partition, input_size, dtype=dtype),
            requires_grad=False,
        )  # (out_local, in)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=dtype), requires_grad=False
            )  # (out_local,)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)  # (N, out_local)

    def weight_loader(self, param: Tensor, src: WeightSource, shard_id: Hashable = None) -> None:
        if shard_id not in self.shard_ids:
            raise LoadError(f"unknown shard {shard_id!r}; expected one of {self.shard_ids}")
        part = self.parts[self.shard_ids.index(shard_id)]
        expected = (part.full_size, self.input_size) if param.dim() == 2 else (part.full_size,)
        _check_shape(src, expected)
        with torch.no_grad():
            dst = param[part.local_offset : part.local_offset + part.local_size]
            dst.copy_(_read(src, 0, part.start, part.local_size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul
    (gate and up of SwiGLU); shard ids are the indices 0, 1, ..."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        group: TPGroup,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size,
            sum(output_sizes),
            bias=bias,
            group=group,
            dtype=dtype,
            parts=_even_parts(output_sizes, group),
            shard_ids=range(len(output_sizes)),
        )
        self.output_sizes = list(output_sizes)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split by heads; shard ids "q", "k", "v".

    Local layout: [q heads of this rank | kv heads | kv heads]. With fewer KV heads
    than ranks, ``world_size / num_kv_heads`` consecutive ranks hold (replicate) the
    same KV head, the one their query heads attend with.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        group: TPGroup,
        dtype: torch.dtype | None = None,
    ) -> None:
        ws, rank = group.world_size, group.rank
        if num_heads % ws:
            raise ValueError(f"num_heads {num_heads} not divisible by tensor-parallel size {ws}")
        if (num_kv_heads >= ws and num_kv_heads % ws) or (num_kv_heads < ws and ws % num_kv_heads):
            raise ValueError(f"num_kv_heads {num_kv_heads} does not split over {ws} ranks")
        self.num_heads = num_heads // ws
        self.num_kv_heads = max(1, num_kv_heads // ws)
        self.head_dim = head_dim
        q_local = self.num_heads * head_dim
        kv_local = self.num_kv_heads * head_dim
        kv_start = (rank * num_kv_heads // ws) * head_dim
        q_full, kv_full = num_heads * head_dim, num_kv_heads * head_dim
        parts = [
            ShardPart(q_full, rank * q_local, q_local, 0),
            ShardPart(kv_full, kv_start, kv_local, q_local),
            ShardPart(kv_full, kv_start, kv_local, q_local + kv_local),
        ]
        super().__init__(
            hidden_size,
            q_full + 2 * kv_full,
            bias=bias,
            group=group,
            dtype=dtype,
            parts=parts,
            shard_ids=("q", "k", "v"),
        )
        self.q_size = q_local
        self.kv_size = kv_local


# -- row parallel -----------------------------------------------------------------------


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split over the ranks: each rank
    multiplies its slice of the input, then the partial sums are all-reduced (the
    one all-reduce of each attention and MLP half). The bias is added once, after."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        group: TPGroup,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if input_size % group.world_size:
            raise ValueError(
                f"input size {input_size} is not divisible by the tensor-parallel size "
                f"{group.world_size}"
            )
        self.group = group
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size // group.world_size
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=dtype),
            requires_grad=False,
        )  # (out, in_local)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)  # (N, out) partial sum over this rank's inputs
        y = self.group.all_reduce(y)  # (N, out)
        if self.bias is not None:
            y = y + self.bias
        return y

    def weight_loader(self, param: Tensor, src: WeightSource, shard_id: Hashable = None) -> None:
        if shard_id is not None:
            raise LoadError(f"unknown shard {shard_id!r}")
        if param.dim() == 1:  # bias: replicated
            default_weight_loader(param, src)
            return
        _check_shape(src, (self.output_size, self.input_size))
        local = self.input_size_per_partition
        with torch.no_grad():
            param.copy_(_read(src, 1, self.group.rank * local, local))


# -- vocabulary parallel -------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows. The vocabulary is padded to a
    multiple of the group size (padding rows are zero); each rank looks up the ids
    it holds, writes zeros for the others, and the group all-reduces."""

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        *,
        group: TPGroup,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.padded_vocab_size = -(-vocab_size // group.world_size) * group.world_size
        self.vocab_size_per_partition = self.padded_vocab_size // group.world_size
        self.vocab_start = group.rank * self.vocab_size_per_partition
        self.vocab_end = self.vocab_start + self.vocab_size_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.vocab_size_per_partition, embedding_dim, dtype=dtype),
            requires_grad=False,
        )  # (vocab_local, dim)

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.group.world_size == 1:
            return F.embedding(input_ids, self.weight)  # (N, dim)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # (N,)
        local_ids = (input_ids - self.vocab_start) * mine  # (N,) 0 where not mine
        x = F.embedding(local_ids, self.weight) * mine.unsqueeze(1).to(self.weight.dtype)
        return self.group.all_reduce(x)  # (N, dim)

    def weight_loader(self, param: Tensor, src: WeightSource, shard_id: Hashable = None) -> None:
        if shard_id is not None:
            raise LoadError(f"unknown shard {shard_id!r}")
        _check_shape(src, (self.vocab_size, self.embedding_dim))
        real = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        with torch.no_grad():
            if real:
                param[:real].copy_(_read(src, 0, self.vocab_start, real))
            param[real:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection split by vocabulary rows: local logits, then an all-gather
    to the full vocabulary with the padding columns trimmed. Its weight may be the
    embedding's (tied): the shards match."""

    def forward(self, hidden: Tensor) -> Tensor:  # type: ignore[override]
        logits = F.linear(hidden, self.weight)  # (M, vocab_local)
        if self.group.world_size > 1:
            gathered = self.group.all_gather(logits)  # (ws, M, vocab_local)
            logits = gathered.permute(1, 0, 2).reshape(hidden.shape[0], self.padded_vocab_size)
        return logits[:, : self.vocab_size]  # (M, vocab)
