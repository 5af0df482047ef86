"""``flare run --config FILE``: a TOML file of ``[scheduler]`` (a policy, as in
``configs/``) and ``[run]`` (any ``flare run`` flag by a long name, aliases
included, e.g. ``max-num-seqs = 16``); flags given on the command line win."""

from __future__ import annotations

import argparse
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from runtime.cli.parsing import explicit, run_parser


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser, argv) -> dict:
    """Fill flags not given on the command line from ``--config``'s [run]; its data.

    A [run] key is any long flag name (an alias too: ``max-num-seqs`` or
    ``max-concurrency``), without the dashes in front.
    """
    if not args.config:
        return {}
    try:
        with open(args.config, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        parser.error(f"--config {args.config}: {exc}")
    unknown = set(data) - {"run", "scheduler"}
    if unknown:
        parser.error(f"--config {args.config}: unknown table(s) {sorted(unknown)}")
    run = data.get("run", {})
    if not isinstance(run, dict):
        parser.error(f"--config {args.config}: [run] must be a table")
    actions = {
        option[2:]: action
        for action in run_parser(parser)._actions
        for option in action.option_strings
        if option.startswith("--")
    }
    given = explicit(parser, argv)
    if args.model_dir is not None:
        given.add("model")
    seen: dict[str, str] = {}
    for key, value in run.items():
        action = actions.get(key) or actions.get(key.replace("_", "-"))
        dest = action.dest if action is not None else None
        if action is None or dest in ("config", "api_requests", "api_outputs", "api_debug", "help"):
            parser.error(f"--config {args.config}: unknown [run] key {key!r}")
        if dest in seen:
            parser.error(f"--config {args.config}: [run] {seen[dest]} and {key} set the same flag")
        seen[dest] = key
        if dest in given:
            continue
        try:
            if action.type is not None:
                value = action.type(str(value))
            elif action.choices is not None and value not in action.choices:
                raise argparse.ArgumentTypeError(f"must be one of {sorted(action.choices)}")
            elif action.nargs == 0 and not isinstance(value, bool):  # a switch
                raise argparse.ArgumentTypeError(f"must be true or false, got {value!r}")
            elif action.nargs == 0 and isinstance(action, argparse.BooleanOptionalAction):
                # no-enable-prefix-caching = true: the --no- form turns the switch off
                value = value != key.replace("_", "-").startswith("no-")
            elif action.nargs != 0 and not isinstance(value, str):
                raise argparse.ArgumentTypeError(f"must be a string, got {value!r}")
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"--config {args.config}: [run] {key}: {exc}")
        setattr(args, dest, value)
    return data
