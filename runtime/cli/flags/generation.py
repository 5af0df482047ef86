"""The generation flags of ``flare run``: one completion instead of a server
(``flare run --prompt TEXT``), its length and sampling, and their checks."""

from __future__ import annotations

import argparse
import os

from runtime.cli.converters import nonnegative_float, positive_float, positive_int, top_k
from runtime.cli.flags.families import flag_group
from runtime.deploy.config import DeploymentConfig
from runtime.ranks.memory import KVPool
from runtime.transport.fields import ProtocolError
from runtime.transport.sampling import SamplingParams


def add_generation_flags(run: argparse.ArgumentParser) -> None:
    generation = flag_group(run, "generation")
    generation.add_argument(
        "--prompt",
        metavar="TEXT",
        help="generate one completion for TEXT, print it and exit (default: serve HTTP)",
    )
    generation.add_argument(
        "--max-tokens",
        metavar="N",
        type=positive_int,
        default=32,
        help="--prompt: tokens to generate",
    )
    generation.add_argument(
        "--temperature",
        metavar="T",
        type=nonnegative_float,
        default=0.0,
        help="--prompt: sampling temperature (0: greedy)",
    )
    generation.add_argument(
        "--top-p",
        metavar="P",
        type=positive_float,
        default=1.0,
        help="--prompt: nucleus sampling mass, in (0, 1]",
    )
    generation.add_argument(
        "--top-k",
        metavar="N",
        type=top_k,
        default=-1,
        help="--prompt: top-k sampling, -1 for all",
    )
    generation.add_argument(
        "--seed", metavar="N", type=int, default=0, help="--prompt: sampling seed"
    )


def sampling(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SamplingParams:
    """The sampling flags as one value; a bad combination fails naming the flag."""
    try:
        return SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    except ProtocolError as exc:
        parser.error(f"--{exc.field.replace('_', '-')}: {exc.reason}")
        raise  # unreachable
    except ValueError as exc:
        parser.error(f"sampling flags: {exc}")
        raise  # unreachable


def load_tokenizer(model_dir: str, parser: argparse.ArgumentParser):
    """The model's tokenizer, or a one-line error naming the file."""
    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the tokenizers library raises plain Exceptions
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        parser.error(f"{path}: not a tokenizers tokenizer.json ({reason})")


def check_prompt(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    config: DeploymentConfig,
    pool: KVPool | None,
    context: int,
    ids: list[int],
) -> None:
    """``--prompt`` + ``--max-tokens`` must fit the context and the KV pool (when known)."""
    if not ids:
        parser.error("--prompt encodes to no tokens")
    total = len(ids) + args.max_tokens
    request = f"--prompt ({len(ids)} tokens) + --max-tokens {args.max_tokens} = {total} tokens"
    if total > context:
        parser.error(f"--max-tokens {args.max_tokens}: {request} exceed the context of {context}")
    pages = -(-total // config.page_size)
    if pool is not None and pages > pool.num_pages:
        parser.error(
            f"{pool.origin}: {request} need {pages} KV pages of {config.page_size} tokens, "
            f"the pool holds {pool.num_pages}; raise {pool.flag} or lower --max-tokens"
        )
