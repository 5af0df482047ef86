"""The flag families of ``flare run`` / ``flare serve``: its ``--help`` groups.

Every flag names its family where it is defined::

    serving = flag_group(run, "serving")
    serving.add_argument("--port", ...)

The groups are made first, in :data:`FAMILIES` order (:func:`add_flag_groups`),
so ``--help`` lists them in that order whatever order the modules add their
flags in.  A module whose flags are all of one family rebinds its parser
argument at the top (``run = flag_group(run, "memory")``), so a flag added there
later joins that family too.  tests/cli/test_families.py checks that every flag
is in a family and has help text.
"""

from __future__ import annotations

import argparse

# title -> description, in --help order.
FAMILIES: dict[str, str] = {
    "serving": "The OpenAI-compatible HTTP server: address, API limits, shutdown.",
    "generation": "One completion instead of a server: flare run --prompt TEXT.",
    "model": "The model and how it runs: directory, dtype, context, execution.",
    "memory": "The KV cache of each rank and the prefix cache.",
    "scheduling": "Request slots, prompt chunks and the scheduling policy.",
    "speculation": "Speculative decoding (docs/speculation.md).",
    "deployment": "Ranks and devices: tensor parallelism, ranks on other machines "
    "(docs/deploy.md), start-up, liveness and hang detection.",
    "security": "API keys, HTTPS, and the CURVE keys of the rank transport (docs/security.md).",
    "debugging": "Logs, traces, frame recordings and consistency checks (docs/debugging.md).",
}


def add_flag_groups(parser: argparse.ArgumentParser) -> None:
    """Make the families' groups, in order, before any flag is added."""
    for title, description in FAMILIES.items():
        parser.add_argument_group(title, description)


def flag_group(parser: argparse.ArgumentParser, family: str) -> argparse._ArgumentGroup:
    """``parser``'s group of ``family``; a parser without the families (a test's
    bare parser) gets a group of that name made on first use."""
    if family not in FAMILIES:
        raise ValueError(f"unknown flag family {family!r}; one of {list(FAMILIES)}")
    for group in parser._action_groups:
        if group.title == family:
            return group
    return parser.add_argument_group(family, FAMILIES[family])


def family_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str | None:
    """The family ``action`` was added to (None: none of them)."""
    for group in parser._action_groups:
        if group.title in FAMILIES and action in group._group_actions:
            return group.title
    return None
