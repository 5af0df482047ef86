"""The argparse pieces every ``flare`` command shares: one-line usage errors and
help that states each flag's default."""

from __future__ import annotations

import argparse
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on ONE stderr line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help states it already
    (or there is none to state)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default in (None, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action) or help_text


def run_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``run`` subcommand's parser (``parser`` itself when it is that one)."""
    if parser._subparsers is None:
        return parser
    return parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]


def explicit(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the run flags given on the command line."""
    given = set()
    for action in run_parser(parser)._actions:
        for option in action.option_strings:
            if any(arg == option or arg.startswith(option + "=") for arg in argv):
                given.add(action.dest)
    return given
