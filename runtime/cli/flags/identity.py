"""The start-up agreement flags of ``flare run``, in the deployment family: see
:mod:`runtime.identity` and docs/runtime.md."""

from __future__ import annotations

import argparse

from runtime.cli.flags.families import flag_group


def add_identity_flags(run: argparse.ArgumentParser) -> None:
    run = flag_group(run, "deployment")  # every flag below
    run.add_argument(
        "--verify-weights",
        action="store_true",
        help="start-up agreement: every rank (and the coordinator, when its model directory "
        "holds the weights) also hashes every weight byte, not only the safetensors headers "
        "and sizes; reads the whole checkpoint (default: off)",
    )
    run.add_argument(
        "--allow-code-mismatch",
        action="store_true",
        help="start-up agreement: a rank running other flare code than the coordinator "
        "(another version or changed source files) is logged as a warning instead of "
        "failing start-up (default: off)",
    )


def identity_config(args: argparse.Namespace) -> dict[str, bool]:
    """The DeploymentConfig fields of these flags."""
    return {
        "verify_weights": bool(args.verify_weights),
        "allow_code_mismatch": bool(args.allow_code_mismatch),
    }
