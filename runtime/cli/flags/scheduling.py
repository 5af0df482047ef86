"""The scheduling flags of ``flare run``: request slots, prompt chunks and the
scheduling policy (a preset, ``--config``'s [scheduler] table, and overrides)."""

from __future__ import annotations

import argparse
import dataclasses

from runtime.catalog import MAX_BATCH_CAPACITY, PROMPT_ALIGNMENT
from runtime.cli.converters import int_in, prefill_tokens
from runtime.cli.flags.families import flag_group
from runtime.coordinator.config import PRESETS, ConfigError, PolicyConfig
from runtime.ranks.capacity import DEFAULT_MAX_CONCURRENCY


def add_scheduling_flags(run: argparse.ArgumentParser) -> None:
    scheduling = flag_group(run, "scheduling")
    scheduling.add_argument(
        "--max-num-seqs",
        "--max-concurrency",
        metavar="N",
        dest="max_concurrency",
        type=int_in(
            1,
            MAX_BATCH_CAPACITY,
            f" (the scheduler selects among at most {MAX_BATCH_CAPACITY} request slots)",
        ),
        default=DEFAULT_MAX_CONCURRENCY,
        help="resident request slots (--max-concurrency is an alias); requests also need "
        "their worst-case KV pages (prompt + max_tokens) to become resident",
    )
    scheduling.add_argument(
        "--max-prefill-tokens",
        "--max-num-batched-tokens",
        metavar="N",
        dest="max_prefill_tokens",
        type=prefill_tokens,
        default=512,
        help=f"the largest prompt capacity of a prepared program (a multiple of "
        f"{PROMPT_ALIGNMENT}); longer prompts run in chunks. flare has no per-step "
        "token budget: --max-num-batched-tokens is an alias of this flag",
    )
    scheduling.add_argument(
        "--mixed-prefill",
        action="store_true",
        help="also capture mixed prefill/decode programs (one prompt chunk "
        "beside decode rows in one forward)",
    )
    scheduling.add_argument(
        "--no-packed-prefill",
        action="store_true",
        help="capture no packed prefill programs (by default several waiting "
        "prompts share one prefill frame, up to one row per 64 prompt tokens)",
    )
    scheduling.add_argument(
        "--no-scored-prefill",
        action="store_true",
        help="capture no scored prefill programs (by default the prefill shapes "
        "are captured again as scored programs, which serve echo with logprobs and "
        "prompt_logprobs; without them such requests get a 400)",
    )
    scheduling.add_argument(
        "--scheduler-policy",
        choices=sorted(PRESETS),
        default=None,
        help="scheduling preset (default: balanced, or --config's [scheduler])",
    )
    scheduling.add_argument(
        "--scheduler-terminal-value",
        metavar="VALUE",
        type=float,
        help="the policy's terminal value (default: the preset's)",
    )
    scheduling.add_argument(
        "--scheduler-terminal-age-price",
        metavar="PRICE",
        type=float,
        help="the policy's terminal age price (default: the preset's)",
    )


def policy(args: argparse.Namespace, parser: argparse.ArgumentParser, data: dict) -> PolicyConfig:
    """The scheduling policy: ``--scheduler-policy`` (else ``--config``'s
    [scheduler], else balanced) with the terminal and verification overrides."""
    terminal = {
        "terminal_value": args.scheduler_terminal_value,
        "terminal_age_price": args.scheduler_terminal_age_price,
    }
    terminal["adaptive_verification_alpha"] = args.mtp_adaptive_verification_alpha
    terminal = {k: v for k, v in terminal.items() if v is not None}
    try:
        if args.scheduler_policy is None and "scheduler" in data:
            base = PolicyConfig.from_toml(args.config)
            return dataclasses.replace(base, **terminal)  # validates again
        return PolicyConfig.preset(args.scheduler_policy or "balanced", **terminal)
    except (ConfigError, TypeError) as exc:
        parser.error(f"--scheduler-* / --config: {exc}")
        raise  # unreachable
