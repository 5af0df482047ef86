"""``flare run``'s speculative decoding flags (docs/speculation.md).

``--draft-model DIR`` (``default``: the draft trained beside the embedded
model) turns on learned proposals, ``--proposer copy`` proposals copied from
the request's own tokens; ``--speculative-config JSON`` is vLLM's spelling of
either.  ``--num-speculative-tokens`` sets the deepest round,
``--speculative-selection`` fixed width or adaptive, ``--speculative-token-
capacity`` the target-row envelope.  Every problem is a one-line usage error
naming the flag.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from runtime.cli.converters import positive_float, probabilities
from runtime.cli.flags.families import flag_group
from runtime.speculation import MAX_SPECULATIVE_TOKENS, SpeculationConfig, SpeculationError

if TYPE_CHECKING:
    from runtime.ranks.model.config import ModelConfig


FLAGS = {  # SpeculationConfig field -> the flag that sets it
    "num_speculative_tokens": "--num-speculative-tokens",
    "prompt_lookup_min": "--prompt-lookup-min",
    "prompt_lookup_max": "--prompt-lookup-max",
    "speculative token capacity": "--speculative-token-capacity",
    "selection": "--speculative-selection",
    "acceptance prior": "--speculative-acceptance-prior",
}


def add_speculation_flags(run: argparse.ArgumentParser) -> None:
    group = flag_group(run, "speculation")  # every flag below
    group.add_argument(  # the scheduler's policy reads it (flags/scheduling.py)
        "--mtp-adaptive-verification-alpha",
        metavar="ALPHA",
        type=positive_float,
        help="the exponent on prefix-survival estimates in speculative selection scores "
        "(projections use the plain estimates; default: the preset's, 1)",
    )
    group.add_argument(
        "--draft-model",
        metavar="DIR",
        help="learned proposals from this draft model (a smaller decoder sharing the "
        "target's vocabulary; 'default': the draft trained beside the embedded model; "
        "default: none)",
    )
    group.add_argument(
        "--proposer",
        choices=["draft", "copy"],
        help="the proposal source: draft (needs --draft-model) or copy (n-gram lookup in "
        "the request's own tokens); default: draft with --draft-model, else off",
    )
    group.add_argument(
        "--num-speculative-tokens",
        metavar="N",
        type=int,
        help=f"proposals of the deepest round, 1..{MAX_SPECULATIVE_TOKENS} (default: 3)",
    )
    group.add_argument(
        "--speculative-selection",
        choices=["adaptive", "fixed"],
        help="adaptive: the scheduler picks each round's width by expected value per time "
        "(default); fixed: every round verifies --num-speculative-tokens",
    )
    group.add_argument(
        "--prompt-lookup-min", metavar="N", type=int, help="copy: the shortest n-gram (default: 2)"
    )
    group.add_argument(
        "--prompt-lookup-max", metavar="N", type=int, help="copy: the longest n-gram (default: 4)"
    )
    group.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='vLLM\'s form: {"method": "ngram"|"draft_model", "model": DIR, '
        '"num_speculative_tokens": N, "prompt_lookup_min": N, "prompt_lookup_max": N}; '
        "fixed selection unless --speculative-selection says adaptive (default: none)",
    )
    group.add_argument(
        "--speculative-acceptance-prior",
        metavar="S1,S2,...",
        type=probabilities,
        help="prefix-survival means s_1, s_2, ... that start every request's acceptance "
        "estimates instead of 0.5^d (an offline measurement of the proposer; default: 0.5^d)",
    )
    group.add_argument(
        "--speculative-token-capacity",
        metavar="N",
        type=int,
        help="the target-row envelope R: speculative programs with more target rows "
        "than R are not prepared (default: no envelope)",
    )


def speculation_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, model: ModelConfig
) -> SpeculationConfig | None:
    """The deployment's speculation from the flags (None: off); usage errors name
    the flag.  A draft directory is checked (config, vocabulary) before any
    process starts."""
    overrides = {
        key: value
        for key, value in (
            ("num_speculative_tokens", args.num_speculative_tokens),
            ("selection", args.speculative_selection),
            ("prompt_lookup_min", args.prompt_lookup_min),
            ("prompt_lookup_max", args.prompt_lookup_max),
            ("token_capacity", args.speculative_token_capacity),
            ("acceptance_prior", args.speculative_acceptance_prior),
        )
        if value is not None
    }
    try:
        if args.speculative_config is not None:
            if args.draft_model or args.proposer:
                parser.error("--speculative-config: give it alone, or --draft-model / --proposer")
            config = SpeculationConfig.from_vllm(args.speculative_config, **overrides)
        elif args.draft_model or args.proposer:
            proposer = args.proposer or "draft"
            if proposer == "draft" and not args.draft_model:
                parser.error("--proposer draft: needs --draft-model DIR (or 'default')")
            if proposer == "copy" and args.draft_model:
                parser.error("--draft-model: copy proposals (--proposer copy) take no draft")
            config = SpeculationConfig(proposer, args.draft_model, **overrides)
        else:
            if overrides:
                flag = "--" + next(iter(overrides)).replace("_", "-")
                flag = flag.replace("--selection", "--speculative-selection")
                flag = flag.replace("--token-capacity", "--speculative-token-capacity")
                flag = flag.replace("--acceptance-prior", "--speculative-acceptance-prior")
                parser.error(f"{flag}: needs --draft-model, --proposer or --speculative-config")
            return None
    except SpeculationError as exc:
        message = str(exc)
        if not message.startswith("--"):  # name the flag, not the field
            for field, flag in FLAGS.items():
                message = message.replace(field, flag, 1) if message.startswith(field) else message
        parser.error(message)
        raise  # unreachable
    if config.draft_model:
        config = _checked_draft(config, parser, model)
    return config


def _checked_draft(
    config: SpeculationConfig, parser: argparse.ArgumentParser, model: ModelConfig
) -> SpeculationConfig:
    from dataclasses import replace

    from runtime.ranks.model.checkpoint import check_model_dir
    from runtime.ranks.model.errors import LoadError, ModelConfigError

    path = config.draft_model
    assert path is not None
    if path == "default":
        from runtime.ranks.model import default_draft_dir

        path = str(default_draft_dir())
    if not os.path.isdir(path):
        parser.error(f"--draft-model {path}: no such directory")
    try:
        draft = check_model_dir(path)
    except (ModelConfigError, LoadError) as exc:
        parser.error(f"--draft-model {path}: {exc}")
    if draft.vocab_size != model.vocab_size:
        parser.error(
            f"--draft-model {path}: its vocabulary ({draft.vocab_size} tokens) is not the "
            f"target's ({model.vocab_size}); a draft must share the target's tokenizer"
        )
    return replace(config, draft_model=os.path.abspath(path))
