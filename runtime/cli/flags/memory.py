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
from typing import TYPE_CHECKING

from runtime.cli.converters import fraction, kv_bytes, positive_int
from runtime.cli.flags.families import flag_group
from runtime.deploy.config import DeploymentConfig
from runtime.deploy.devices import uses_cuda
from runtime.ranks import memory

if TYPE_CHECKING:
    from runtime.ranks.model.config import ModelConfig


def add_kv_flags(run: argparse.ArgumentParser) -> None:
    run = flag_group(run, "memory")  # every flag below
    run.add_argument(
        "--num-pages",
        metavar="N",
        type=positive_int,
        help="KV cache pages per rank; overrides --kv-cache-memory and "
        "--gpu-memory-utilization (default: as many as the KV budget holds)",
    )
    run.add_argument(
        "--kv-cache-memory",
        metavar="BYTES",
        type=kv_bytes,
        help="KV cache budget per rank: bytes, or 4GiB, 512MiB...; on CUDA it replaces "
        "the --gpu-memory-utilization rule (default: "
        f"{memory.format_bytes(memory.DEFAULT_CPU_KV_CACHE_BYTES)} on CPU)",
    )
    run.add_argument(
        "--gpu-memory-utilization",
        metavar="FRACTION",
        type=fraction,
        default=memory.DEFAULT_GPU_MEMORY_UTILIZATION,
        help="CUDA: the fraction of each device for weights, activations, CUDA graphs and "
        "the KV cache, in (0, 1]",
    )
    run.add_argument(
        "--page-size", metavar="N", type=positive_int, default=16, help="tokens per KV page"
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
