"""``flare run``'s KV cache flags, and the pool they ask for before any rank starts.

``--num-pages`` (an override), ``--kv-cache-memory``, ``--gpu-memory-utilization``
and ``--page-size`` reach the ranks, which size their cache with
``runtime.ranks.memory``; the command line checks the same pool first whenever
it is known without a device (everything but the CUDA utilization rule).
``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` (vLLM's flags, on by
default) reach the coordinator, which keeps the prefix cache.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from runtime.cli_groups import flag_group
from runtime.ranks import memory

if TYPE_CHECKING:
    from runtime.local import DeploymentConfig
    from runtime.ranks.model.config import ModelConfig


def parse_fraction_flag(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text!r}")
    return value


def add_kv_flags(run: argparse.ArgumentParser, positive: Callable[[str], int]) -> None:
    run = flag_group(run, "memory")  # every flag below
    run.add_argument(
        "--num-pages",
        metavar="N",
        type=positive,
        help="KV cache pages per rank; overrides --kv-cache-memory and "
        "--gpu-memory-utilization (default: as many as the KV budget holds)",
    )
    run.add_argument(
        "--kv-cache-memory",
        metavar="BYTES",
        type=memory.bytes_flag,
        help="KV cache budget per rank: bytes, or 4GiB, 512MiB...; on CUDA it replaces "
        "the --gpu-memory-utilization rule (default: "
        f"{memory.format_bytes(memory.DEFAULT_CPU_KV_CACHE_BYTES)} on CPU)",
    )
    run.add_argument(
        "--gpu-memory-utilization",
        metavar="FRACTION",
        type=parse_fraction_flag,
        default=memory.DEFAULT_GPU_MEMORY_UTILIZATION,
        help="CUDA: the fraction of each device for weights, activations, CUDA graphs and "
        "the KV cache, in (0, 1]",
    )
    run.add_argument(
        "--page-size", metavar="N", type=positive, default=16, help="tokens per KV page"
    )


def add_prefix_cache_flags(run: argparse.ArgumentParser) -> None:
    run = flag_group(run, "memory")  # every flag below
    run.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV pages of equal prompt prefixes between requests (of equal "
        "cache_salt); --no-enable-prefix-caching turns it off",
    )


def prefix_cache_config(args: argparse.Namespace) -> dict[str, object]:
    """The DeploymentConfig fields of the prefix-cache flags."""
    return {"enable_prefix_caching": bool(args.enable_prefix_caching)}


def uses_cuda(device: str) -> bool:
    """Whether the ranks will run on CUDA (``auto``: when this machine has it)."""
    from runtime.devices import uses_cuda as on_cuda

    return on_cuda(device)


def kv_pool(config: DeploymentConfig, model: ModelConfig) -> memory.KVPool | None:
    """The KV pool each rank will hold, when known before they start (None: the
    ranks measure their devices, the ``--gpu-memory-utilization`` rule)."""
    return memory.plan_deployment_pool(
        model,
        config.tensor_parallel_size,
        config.page_size,
        config.dtype,
        uses_cuda(config.device),
        num_pages=config.num_pages,
        kv_cache_memory=config.kv_cache_memory_bytes,
    )
