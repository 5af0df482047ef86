"""`--help` of `flare`, `flare run` / `flare serve` and `flare bench`: every run flag
in one of the named families (runtime/cli/flags/families.py), listed in their order, with
help text and a real metavar; every bench flag with help text; no RST markup."""

from __future__ import annotations

import argparse
import re

import pytest

from runtime.cli.app import build_parser
from runtime.cli.commands.bench import build_parser as bench_parser
from runtime.cli.flags.families import FAMILIES, family_of
from runtime.cli.parsing import run_parser as _run_parser

GENERAL = {"help", "config"}  # the "general" group: --help and --config only


def visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS]


def test_every_run_flag_is_in_a_family_with_help_and_a_metavar():
    run = _run_parser(build_parser())
    assert [g.title for g in run._action_groups if g.title in FAMILIES] == list(FAMILIES)
    general = next(g for g in run._action_groups if g.title == "general")
    assert {a.dest for a in general._group_actions if a.help != argparse.SUPPRESS} == GENERAL
    for action in visible(run):
        name = action.option_strings[-1] if action.option_strings else action.dest
        if action.dest in GENERAL:
            continue
        assert family_of(run, action) is not None, f"{name}: in no family of {list(FAMILIES)}"
        assert action.help and action.help.strip(), f"{name}: no help text"
        if action.nargs != 0 and action.choices is None:  # takes a value
            # A chosen metavar (N, SECONDS, BYTES, FILE...), not argparse's upper-cased dest.
            assert action.metavar, f"{name}: no metavar"


def test_the_families_hold_the_flags_one_looks_for_there():
    run = _run_parser(build_parser())
    where = {flag: family_of(run, a) for a in visible(run) for flag in a.option_strings}
    expected = {
        "--port": "serving",
        "--drain-timeout": "serving",
        "--max-waiting-requests": "serving",
        "--prompt": "generation",
        "--dtype": "model",
        "--max-model-len": "model",
        "--kv-cache-memory": "memory",
        "--enable-prefix-caching": "memory",
        "--max-concurrency": "scheduling",
        "--scheduler-policy": "scheduling",
        "--draft-model": "speculation",
        "--tensor-parallel-size": "deployment",
        "--device": "deployment",
        "--heartbeat-timeout": "deployment",
        "--ranks": "deployment",
        "--api-key": "security",
        "--ssl-certfile": "security",
        "--transport-keys": "security",
        "--log-level": "debugging",
        "--trace": "debugging",
    }
    assert {flag: where[flag] for flag in expected} == expected


@pytest.mark.parametrize("command", ["run", "serve"])
def test_run_help_lists_the_families_in_order_under_a_short_usage(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    # `flare serve` is the same parser: its usage names `flare run`.
    assert text.splitlines()[0] == "usage: flare run [MODEL_DIR] [--prompt TEXT] [OPTIONS]"
    titles = [line[:-1] for line in text.splitlines() if re.fullmatch(r"[a-z]+:", line)]
    assert titles == ["general", *FAMILIES]
    for metavar in ("--port PORT", "--kv-cache-memory BYTES", "--startup-timeout SECONDS",
                    "--chat-template FILE", "--host HOST", "--model DIR", "--log-dir DIR",
                    "--drain-timeout SECONDS", "--frames-port PORT"):  # fmt: skip
        assert metavar in text, metavar


def test_every_bench_flag_has_help_text():
    parser = bench_parser()
    for action in visible(parser):
        name = action.option_strings[-1]
        assert action.help and action.help.strip(), f"{name}: no help text"
        if action.nargs != 0 and action.choices is None:
            assert action.metavar, f"{name}: no metavar"


def test_top_level_help_has_no_rst_markup(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text
    assert "flare run" in text and "flare bench" in text
