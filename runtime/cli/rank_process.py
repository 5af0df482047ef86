"""The argv of a rank process: ``torchrun --nproc-per-node N -m runtime.ranks ...``.

``flare run`` starts its ranks with these flags (``DeploymentConfig.rank_args``,
runtime/deploy/config.py); with ``--ranks external`` the operator runs the same
command under torchrun on every node (docs/deploy.md).  The endpoints come from
``--frames-endpoint`` / ``--completions-endpoint`` / ``--heartbeat-endpoint`` or
the environment variables FLARE_FRAMES_ENDPOINT / FLARE_COMPLETIONS_ENDPOINT /
FLARE_HEARTBEAT_ENDPOINT.  :func:`main` parses and checks them, then hands them
to the process body, :func:`runtime.ranks.process.run`.
"""

from __future__ import annotations

import argparse
import os
import re

from runtime.cli.converters import LOG_LEVELS, device, kv_bytes
from runtime.cli.flags.liveness import (
    add_heartbeat_endpoint_flag,
    add_heartbeat_flags,
    check_heartbeat_args,
)
from runtime.cli.flags.security import add_rank_transport_flags, rank_keys
from runtime.deploy.config import DTYPES
from runtime.ranks import memory
from runtime.ranks.capacity import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_VISION_IMAGES,
    DEFAULT_VISION_WINDOWS,
    CapacityConfig,
    CapacityError,
)
from runtime.ranks.proposals import ProposerConfig

DESCRIPTION = "Rank process entry point: ``torchrun --nproc-per-node N -m runtime.ranks ...``."
RANK_DTYPES = ["auto", *sorted(name for name in DTYPES if name != "auto")]


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model, its endpoints and the catalog's shapes."""
    p.add_argument("--model", help="Hugging Face style directory (default: the embedded model)")
    p.add_argument("--frames-endpoint", default=os.environ.get("FLARE_FRAMES_ENDPOINT"))
    p.add_argument("--completions-endpoint", default=os.environ.get("FLARE_COMPLETIONS_ENDPOINT"))
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY)
    p.add_argument("--min-prefill-tokens", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context limit (default: the model's max_position_embeddings)",
    )
    p.add_argument("--num-pages", type=int, default=None, help="default: from the budget")
    p.add_argument(
        "--kv-cache-memory",
        type=kv_bytes,
        default=None,
        help="KV budget per rank in bytes (default: CPU 512 MiB, CUDA --gpu-memory-utilization)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=memory.DEFAULT_GPU_MEMORY_UTILIZATION,
        help="CUDA: the device fraction for weights, activations, graphs and the KV cache",
    )
    _add_vision_flags(p)


def _add_vision_flags(p: argparse.ArgumentParser) -> None:
    """A vision model's feature store and vision programs (text-only models ignore them)."""
    p.add_argument(
        "--vision-windows",
        type=int,
        default=DEFAULT_VISION_WINDOWS,
        help="feature store windows (one per request encoding images at a time)",
    )
    p.add_argument(
        "--vision-window-rows",
        type=int,
        default=0,
        help="feature rows per window (0: four images' tokens)",
    )
    p.add_argument(
        "--max-vision-images",
        type=int,
        default=DEFAULT_MAX_VISION_IMAGES,
        help="the most images one vision frame encodes (programs at every power of two)",
    )


# CapacityConfig's field names in a refusal, as the rank's flags.
CAPACITY_FLAGS = {
    "max_concurrency": "--max-concurrency",
    "min_prefill_tokens": "--min-prefill-tokens",
    "max_prefill_tokens": "--max-prefill-tokens",
    "speculative_widths": "--speculative-widths",
    "speculative_token_capacity": "--speculative-token-capacity",
    "device_allocation": "--device-allocation",
    "vision_windows": "--vision-windows",
    "window_rows": "--vision-window-rows",
    "max_vision_images": "--max-vision-images",
}


def capacity_message(text: str) -> str:
    """A CapacityError's text with each field named as its flag."""
    return re.sub(
        r"\b(" + "|".join(CAPACITY_FLAGS) + r")\b", lambda m: CAPACITY_FLAGS[m.group(1)], text
    )


def _add_debug_flags(p: argparse.ArgumentParser) -> None:
    """Hang detection, consistency checks, identity, logs and profiles."""
    p.add_argument(
        "--frame-timeout-multiple",
        type=float,
        default=20.0,
        help="a frame hangs after this many times its expected duration + the margin",
    )
    p.add_argument("--frame-timeout-margin", type=float, default=60.0, help="seconds")
    p.add_argument(
        "--check-ranks",
        action="store_true",
        help="report a CRC of the sampled tokens every frame (the coordinator compares ranks)",
    )
    p.add_argument(
        "--verify-weights",
        action="store_true",
        help="also hash every weight byte for the start-up agreement (reads the whole checkpoint)",
    )
    p.add_argument(
        "--log-level",
        choices=list(LOG_LEVELS),
        default="warning",
        help="info also logs the KV pool and the prepared catalog (default: warning)",
    )
    p.add_argument(
        "--log-dir", default=None, help="also write this rank's log to DIR/rank<r>.log (0600)"
    )
    p.add_argument(
        "--profile-dir",
        default=None,
        help="where Control('profile') writes DIR/profile-<nonce>/rank<r>.json (default: refused)",
    )


def _add_execution_flags(p: argparse.ArgumentParser) -> None:
    """Device, dtype, programs and speculation."""
    p.add_argument(
        "--device",
        type=device,
        default="auto",
        help="auto, cpu, cuda (rank r on cuda:LOCAL_RANK) or cuda:N (on cuda:N+LOCAL_RANK)",
    )
    p.add_argument(
        "--dtype",
        choices=RANK_DTYPES,
        default="auto",
        help="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="run programs eagerly on CUDA")
    p.add_argument(
        "--mixed-prefill",
        action="store_true",
        help="also prepare mixed prefill/decode programs (capacity.mixed_shapes)",
    )
    p.add_argument(
        "--packed-prefill",
        action="store_true",
        help="also prepare packed prefill programs (capacity.packed_prefill_shapes)",
    )
    p.add_argument(
        "--scored-prefill",
        action="store_true",
        help="also prepare scored prefill programs (prompt log probabilities; "
        "capacity.scored_prefill_shapes)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="a draft model directory for learned proposals ('default': the embedded draft)",
    )
    p.add_argument(
        "--proposer",
        choices=["draft", "copy"],
        default=None,
        help="prepare speculative rounds with this proposal source (default: none)",
    )
    p.add_argument(
        "--speculative-widths",
        default="",
        help="comma-separated round widths W >= 2 to prepare (D = W - 1)",
    )
    p.add_argument(
        "--device-allocation",
        action="store_true",
        help="also prepare prefix-limit (device-allocated) rounds at the widest width",
    )
    p.add_argument("--speculative-token-capacity", type=int, default=0)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.ranks", description=DESCRIPTION)
    _add_model_flags(p)
    _add_debug_flags(p)
    _add_execution_flags(p)
    p.add_argument("--handshake-timeout", type=float, default=120.0, help="seconds")
    add_heartbeat_endpoint_flag(p)
    add_heartbeat_flags(p)
    add_rank_transport_flags(p)
    p.add_argument(
        "--poll-spin-us",
        type=int,
        default=0,
        help="busy-poll this long for the next frame after each completion (0: never)",
    )
    return p


def _check_sizes(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not args.frames_endpoint or not args.completions_endpoint:
        p.error("--frames-endpoint and --completions-endpoint (or FLARE_*_ENDPOINT) are required")
    if args.max_model_len is not None and args.max_model_len < 64:
        p.error("--max-model-len must be >= 64")
    if not 0 <= args.poll_spin_us <= 100_000:
        p.error("--poll-spin-us must lie in [0, 100000]")
    check_heartbeat_args(args, p)
    args.transport_client_keys = rank_keys(args, p)  # CURVE (docs/security.md)
    if args.page_size < 1:
        p.error("--page-size must be >= 1")
    if args.num_pages is not None and args.num_pages < 1:
        p.error("--num-pages must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error(f"--gpu-memory-utilization must lie in (0, 1], got {args.gpu_memory_utilization}")
    for name in ("frame_timeout_multiple", "frame_timeout_margin"):
        if not 0 < getattr(args, name) < float("inf"):
            p.error(f"--{name.replace('_', '-')} must be a finite number > 0")


def _check_speculation(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[int, ...]:
    """The round widths to prepare; ``args.proposer_config`` set."""
    try:
        widths = tuple(int(w) for w in args.speculative_widths.split(",") if w.strip())
    except ValueError:
        p.error(
            f"--speculative-widths: integers separated by commas, got {args.speculative_widths!r}"
        )
    if widths and args.proposer is None:
        p.error("--speculative-widths needs --proposer")
    if args.proposer == "draft" and not args.draft_model:
        p.error("--proposer draft needs --draft-model")
    args.proposer_config = None
    if args.proposer is not None:
        if not widths:
            p.error("--proposer needs --speculative-widths")
        try:
            args.proposer_config = ProposerConfig(
                args.proposer, args.prompt_lookup_min, args.prompt_lookup_max
            )
        except ValueError as exc:
            p.error(str(exc))
    return widths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The rank's flags, checked (``args.capacity``, ``args.proposer_config`` and
    ``args.transport_client_keys`` added); a problem exits 2 naming the flag."""
    p = build_parser()
    args = p.parse_args(argv)
    _check_sizes(args, p)
    widths = _check_speculation(args, p)
    try:
        args.capacity = CapacityConfig(
            max_concurrency=args.max_concurrency,
            min_prefill_tokens=args.min_prefill_tokens,
            max_prefill_tokens=args.max_prefill_tokens,
            mixed_prefill=args.mixed_prefill,
            packed_prefill=args.packed_prefill,
            scored_prefill=args.scored_prefill,
            speculative_widths=widths,
            speculative_token_capacity=args.speculative_token_capacity,
            device_allocation=args.device_allocation,
            vision_windows=args.vision_windows,
            window_rows=args.vision_window_rows,
            max_vision_images=args.max_vision_images,
        )
    except CapacityError as exc:
        p.error(capacity_message(str(exc)))
    return args


def main(argv: list[str] | None = None) -> int:
    """``python -m runtime.ranks``: parse, then run this rank until shutdown."""
    args = parse_args(argv)
    from runtime.ranks.process import run

    return run(args)
