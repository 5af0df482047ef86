"""`flare run` flag handling: config files, fail-fast errors naming the flag."""

from __future__ import annotations

import pytest

from runtime.cli import build_parser, deployment_config


def configure(argv: list[str]):
    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    return args, deployment_config(args, parser, argv)


def test_config_file_fills_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(
        "[run]\nmax-concurrency = 16\nport = 9100\npage-size = 32\n"
        '[scheduler]\npreset = "throughput"\n[scheduler.policy]\nterminal_value = 99.0\n'
    )
    args, config = configure(["--config", str(path), "--page-size", "8"])
    assert config.max_concurrency == 16 and args.port == 9100
    assert config.page_size == 8  # given on the command line
    assert config.policy.terminal_value == 99.0
    assert config.policy.delivery_fairness == 0.0  # the throughput preset
    _, config = configure(["--config", str(path), "--scheduler-terminal-value", "5"])
    assert config.policy.terminal_value == 5.0 and config.policy.delivery_fairness == 0.0
    _, config = configure(["--config", str(path), "--scheduler-policy", "balanced"])
    assert config.policy.delivery_fairness > 0


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[run]\nbogus = 1\n", "bogus"),
        ("[run]\nmax-concurrency = 0\n", "max-concurrency"),
        ("[run]\ndevice = 'tpu'\n", "device"),
        ("[other]\nx = 1\n", "other"),
        ("[run\n", "--config"),
        ("[run]\nmixed-prefill = 'yes'\n", "mixed-prefill"),
        ("[run]\nno-cuda-graphs = 1\n", "no-cuda-graphs"),
    ],
)
def test_bad_config_files_fail_naming_the_key(tmp_path, capsys, toml, needle):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(SystemExit) as exit_info:
        configure(["--config", str(path)])
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--speculative-token-capacity", "8"], "--speculative-token-capacity"),
        (["--mtp-adaptive-verification-alpha", "0.5"], "--mtp-adaptive-verification-alpha"),
        (["--port", "0"], "--port"),
        (["--max-concurrency", "-1"], "--max-concurrency"),
        (["--scheduler-terminal-value", "-3"], "--scheduler"),
        (["--model", "/nonexistent/model"], "--model"),
        (["--startup-timeout", "0"], "--startup-timeout"),
        (["--startup-timeout", "nan"], "--startup-timeout"),
        (["--max-model-len", "100000"], "--max-model-len"),
    ],
)
def test_bad_flags_fail_fast_naming_the_flag(capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_info:
        configure(argv)
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_mixed_prefill_reaches_the_ranks_from_the_flag_and_the_config_file(tmp_path):
    _, config = configure([])
    assert not config.mixed_prefill and "--mixed-prefill" not in config.rank_args()
    _, config = configure(["--mixed-prefill"])
    assert config.mixed_prefill and "--mixed-prefill" in config.rank_args()
    path = tmp_path / "mixed.toml"
    path.write_text("[run]\nmixed-prefill = true\n")
    _, config = configure(["--config", str(path)])
    assert config.mixed_prefill and "--mixed-prefill" in config.rank_args()
    path.write_text("[run]\nmixed-prefill = false\n")
    _, config = configure(["--config", str(path)])
    assert not config.mixed_prefill


def test_rank_entry_point_prepares_mixed_programs_when_asked():
    from runtime.catalog import GraphKind
    from runtime.ranks.__main__ import parse_args
    from runtime.ranks.capacity import build_catalog

    base = ["--frames-endpoint", "ipc:///x/f", "--completions-endpoint", "ipc:///x/c"]
    assert not parse_args(base).capacity.mixed_prefill
    capacity = parse_args([*base, "--mixed-prefill", "--max-concurrency", "4"]).capacity
    assert capacity.mixed_prefill
    mixed = [d for d in build_catalog(capacity) if d.kind is GraphKind.MIXED]
    assert {d.batch_capacity for d in mixed} == {2, 4} and mixed
