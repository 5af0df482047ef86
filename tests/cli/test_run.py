"""`flare run` flag handling: config files, fail-fast errors naming the flag, the
vLLM-style names (aliases, positional model, `flare serve`).  The real command's
errors and runs are in tests/cli/test_app.py."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from runtime.cli.app import build_parser
from runtime.cli.commands.run import deployment_config


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
    check_bad_config(tmp_path, capsys, toml, needle)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--speculative-token-capacity", "8"], "--speculative-token-capacity"),
        (["--num-speculative-tokens", "2"], "--num-speculative-tokens"),
        (["--proposer", "draft"], "--proposer draft"),
        (["--proposer", "copy", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--proposer", "copy", "--prompt-lookup-min", "5"], "--prompt-lookup-min"),
        (["--proposer", "copy", "--speculative-token-capacity", "-1"], "--speculative-token"),
        (["--proposer", "copy", "--draft-model", "default"], "--draft-model"),
        (["--draft-model", "/nonexistent/draft"], "--draft-model"),
        (["--speculative-config", "{bad"], "--speculative-config"),
        (["--speculative-config", '{"method": "eagle"}'], "--speculative-config"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens"),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}',
            ],
            "bogus",
        ),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
                "--proposer",
                "copy",
            ],
            "--speculative-config",
        ),
        (["--proposer", "copy", "--direct"], "direct"),
        (
            ["--proposer", "copy", "--speculative-acceptance-prior", "0.5,0.7"],
            "--speculative-acceptance-prior",
        ),
        (
            ["--proposer", "copy", "--speculative-acceptance-prior", "x"],
            "--speculative-acceptance-prior",
        ),
        (["--speculative-acceptance-prior", "0.5"], "--speculative-acceptance-prior"),
        (["--mtp-adaptive-verification-alpha", "0"], "--mtp-adaptive-verification-alpha"),
        (["--mtp-adaptive-verification-alpha", "nan"], "--mtp-adaptive-verification-alpha"),
        (["--port", "0"], "--port"),
        (["--max-concurrency", "-1"], "--max-concurrency"),
        (["--scheduler-terminal-value", "-3"], "--scheduler"),
        (["--model", "/nonexistent/model"], "--model"),
        (["--startup-timeout", "0"], "--startup-timeout"),
        (["--startup-timeout", "nan"], "--startup-timeout"),
        (["--max-model-len", "100000"], "--max-model-len"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--kv-cache-memory", "0"], "--kv-cache-memory"),
        (["--kv-cache-memory", "4XB"], "--kv-cache-memory"),
        (["--frame-timeout-multiple", "0"], "--frame-timeout-multiple"),
        (["--frame-timeout-margin", "-1"], "--frame-timeout-margin"),
        (["--frame-timeout-margin", "inf"], "--frame-timeout-margin"),
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


# -- the vLLM-style names: aliases, positional model, `flare serve` --------------------------


def run_args(argv: list[str]):
    """`flare ARGV` through the real parser: (args, config) as cmd_run sees them."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args, deployment_config(args, parser, argv[1:])


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        (["--max-num-seqs", "16"], "max_concurrency", 16),
        (["--max-concurrency", "16"], "max_concurrency", 16),
        (["-tp", "2"], "tensor_parallel_size", 2),
        (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
        (["--max-num-batched-tokens", "128"], "max_prefill_tokens", 128),
        (["--max-prefill-tokens", "128"], "max_prefill_tokens", 128),
        (["--enforce-eager"], "cuda_graphs", False),
        (["--no-cuda-graphs"], "cuda_graphs", False),
        ([], "cuda_graphs", True),
        (["--dtype", "bfloat16"], "dtype", "bfloat16"),
        ([], "dtype", "auto"),
        ([], "max_concurrency", 32),  # the measured default (docs/serving.md)
    ],
)
def test_aliases_reach_the_deployment(flags, field, value):
    _, config = configure(flags)
    assert getattr(config, field) == value


def test_the_new_flags_reach_the_rank_command_line():
    _, config = configure(["--max-num-seqs", "16", "--dtype", "float16", "--enforce-eager"])
    args = config.rank_args()
    assert args[args.index("--max-concurrency") + 1] == "16"
    assert args[args.index("--dtype") + 1] == "float16"
    assert "--no-cuda-graphs" in args
    _, config = configure([])
    assert "--dtype" not in config.rank_args()  # auto: the rank's own choice per device


def test_kv_and_frame_timeout_flags_reach_the_rank_command_line(tmp_path):
    from runtime.cli.rank_process import parse_args

    base = ["--frames-endpoint", "ipc:///x/f", "--completions-endpoint", "ipc:///x/c"]
    _, config = configure([])
    assert (config.num_pages, config.kv_cache_memory_bytes) == (None, None)
    assert config.gpu_memory_utilization == 0.9
    assert (config.frame_timeout_multiple, config.frame_timeout_margin_s) == (20.0, 60.0)
    assert "--num-pages" not in config.rank_args()
    assert "--kv-cache-memory" not in config.rank_args()
    ranks = parse_args([*base, *config.rank_args()])
    assert (ranks.num_pages, ranks.kv_cache_memory, ranks.gpu_memory_utilization) == (
        None, None, 0.9,
    )  # fmt: skip
    assert (ranks.frame_timeout_multiple, ranks.frame_timeout_margin) == (20.0, 60.0)
    flags = ["--kv-cache-memory", "4GiB", "--gpu-memory-utilization", "0.5", "--num-pages", "64",
             "--frame-timeout-multiple", "5", "--frame-timeout-margin", "2.5"]  # fmt: skip
    _, config = configure(flags)
    assert (config.kv_cache_memory_bytes, config.gpu_memory_utilization) == (4 << 30, 0.5)
    assert (config.frame_timeout_multiple, config.frame_timeout_margin_s) == (5.0, 2.5)
    ranks = parse_args([*base, *config.rank_args()])
    assert (ranks.num_pages, ranks.kv_cache_memory, ranks.gpu_memory_utilization) == (
        64, 4 << 30, 0.5,
    )  # fmt: skip
    assert (ranks.frame_timeout_multiple, ranks.frame_timeout_margin) == (5.0, 2.5)
    path = tmp_path / "kv.toml"
    path.write_text(
        "[run]\nkv-cache-memory = '512MiB'\ngpu-memory-utilization = 0.8\n"
        "frame-timeout-margin = 90\n"
    )
    _, config = configure(["--config", str(path)])
    assert (config.kv_cache_memory_bytes, config.gpu_memory_utilization) == (512 << 20, 0.8)
    assert config.frame_timeout_margin_s == 90.0


def test_max_model_len_that_the_kv_budget_cannot_hold_is_refused_before_start(capsys):
    # The embedded model on the CPU, float32: 32768 bytes per page of 16 tokens.
    with pytest.raises(SystemExit) as exit_info:
        configure(["--device", "cpu", "--kv-cache-memory", "1MiB", "--max-model-len", "4096"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    for words in ("--kv-cache-memory 1048576", "--max-model-len 4096", "needs 256 pages",
                  "31 pages", "32768 bytes per page", "(1.0 MiB)"):  # fmt: skip
        assert words in err, (words, err)
    # --num-pages overrides the budget; the CPU default budget holds the whole context.
    _, config = configure(["--device", "cpu", "--kv-cache-memory", "1MiB", "--num-pages", "256",
                           "--max-model-len", "4096"])  # fmt: skip
    assert config.num_pages == 256
    configure(["--device", "cpu", "--max-model-len", "4096"])


def test_positional_model_equals_the_flag_and_serve_equals_run(tmp_path):
    from runtime.ranks.model import default_model_dir

    model = str(default_model_dir())
    _, by_flag = run_args(["run", "--model", model])
    _, positional = run_args(["run", model])
    _, served = run_args(["serve", model])
    _, both = run_args(["serve", model, "--model", model + "/"])  # the same directory twice
    assert by_flag == positional == served == both
    assert positional.model == model


def test_config_file_takes_the_new_long_names(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0].content }}")
    path = tmp_path / "serve.toml"
    path.write_text(
        "[run]\nmax-num-seqs = 16\nmax-num-batched-tokens = 128\nenforce-eager = true\n"
        f'dtype = "bfloat16"\ntensor-parallel-size = 2\nchat-template = "{template}"\n'
        "max-choices-per-request = 7\n"
    )
    args, config = configure(["--config", str(path)])
    assert (config.max_concurrency, config.max_prefill_tokens) == (16, 128)
    assert not config.cuda_graphs and config.dtype == "bfloat16"
    assert config.tensor_parallel_size == 2
    assert args.chat_template == str(template) and args.max_choices_per_request == 7
    # Aliases too, and the command line (short form included) still wins.
    path.write_text("[run]\nmax-concurrency = 12\nno-cuda-graphs = true\n")
    _, config = configure(["--config", str(path), "-tp", "2"])
    assert config.max_concurrency == 12 and not config.cuda_graphs
    assert config.tensor_parallel_size == 2
    _, config = configure(["--config", str(path), "--max-num-seqs", "3"])
    assert config.max_concurrency == 3


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[run]\nmax-num-seqs = 100\n", "max-num-seqs"),
        ("[run]\nmax-num-seqs = 4\nmax-concurrency = 4\n", "set the same flag"),
        ("[run]\ndtype = 'float8'\n", "dtype"),
        ("[run]\nenforce-eager = 'yes'\n", "enforce-eager"),
        ("[run]\nmax-choices-per-request = 0\n", "max-choices-per-request"),
        ("[run]\nchat-template = 3\n", "chat-template"),
        ("[run]\ngpu-memory-utilization = 2\n", "gpu-memory-utilization"),
        ("[run]\nkv-cache-memory = 'much'\n", "kv-cache-memory"),
    ],
)
def test_bad_new_config_keys_fail_naming_the_key(tmp_path, capsys, toml, needle):
    check_bad_config(tmp_path, capsys, toml, needle)


def check_bad_config(tmp_path, capsys, toml: str, needle: str) -> None:
    """``--config`` with ``toml`` exits 2 with one stderr line containing ``needle``."""
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(SystemExit) as exit_info:
        configure(["--config", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and needle in err and len(err.splitlines()) == 1


def test_every_run_flag_states_its_default_in_help():
    from runtime.cli.parsing import HelpFormatter
    from runtime.cli.parsing import run_parser as _run_parser

    run = _run_parser(build_parser())
    formatter = HelpFormatter("flare run")
    for action in run._actions:
        if action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        text = formatter._expand_help(action)
        assert "default" in text, f"{action.option_strings or action.dest}: {text!r}"


def test_serve_options_and_the_coordinator_get_the_new_flags(tmp_path, monkeypatch):
    """`flare serve DIR ...` hands ServeOptions the template and the choice bound, and
    the coordinator's command line parses to the same deployment."""
    import signal

    import runtime.cli as cli
    import runtime.cli.coordinator_process as coordinator
    import runtime.coordinator.engine.main as coordinator_main
    import runtime.frontend.serve as frontend_serve
    from runtime.ranks.model import default_model_dir

    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0].content }}")
    model = str(default_model_dir())
    seen = {}
    monkeypatch.setattr(frontend_serve, "serve", lambda opts: seen.setdefault("opts", opts) and 0)
    argv = ["serve", model, "--chat-template", str(template), "--max-choices-per-request", "7",
            "--max-num-seqs", "16", "-tp", "2", "--dtype", "float32", "--enforce-eager",
            "--api-key", "sekrit"]  # fmt: skip
    assert cli.main(argv) == 0
    opts = seen["opts"]
    assert opts.chat_template == str(template) and opts.max_choices_per_request == 7
    assert opts.model_dir == model and "sekrit" not in opts.coordinator_args

    class FakeDeployment:
        def __init__(self, config):
            seen["config"] = config

        def start(self):
            raise KeyboardInterrupt  # stop before any process starts

        def stop(self):
            return []

    monkeypatch.setattr(coordinator_main, "LocalDeployment", FakeDeployment)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        api = ["--api-requests", "ipc:///x/r", "--api-outputs", "ipc:///x/o"]
        assert coordinator.main([*opts.coordinator_args, *api]) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    config = seen["config"]
    _, expected = run_args(argv)
    assert config == dataclasses.replace(expected, external_publication=True)
    assert config.max_concurrency == 16 and config.tensor_parallel_size == 2
    assert config.dtype == "float32" and not config.cuda_graphs and config.model == model


def test_the_verification_alpha_reaches_the_policy():
    _, config = configure(["--mtp-adaptive-verification-alpha", "0.5"])
    assert config.policy.adaptive_verification_alpha == 0.5
    assert configure([])[1].policy.adaptive_verification_alpha == 1.0


def test_speculation_flags_and_vllms_speculative_config():
    _, config = configure(["--proposer", "copy"])
    spec = config.speculation
    assert (spec.proposer, spec.selection, spec.widths, spec.fixed_width) == (
        "copy",
        "adaptive",
        (2, 3, 4),
        0,
    )
    assert "--device-allocation" in config.rank_args()
    _, config = configure(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
         '"prompt_lookup_min": 1, "prompt_lookup_max": 3}']
    )  # fmt: skip
    spec = config.speculation
    assert (spec.proposer, spec.selection, spec.widths, spec.fixed_width) == (
        "copy",
        "fixed",
        (3,),
        3,
    )
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 3)
    args = config.rank_args()
    assert args[args.index("--speculative-widths") + 1] == "3"
    assert "--device-allocation" not in args
    _, config = configure(["--draft-model", "default", "--num-speculative-tokens", "7",
                           "--speculative-token-capacity", "64"])  # fmt: skip
    spec = config.speculation
    assert spec.proposer == "draft" and spec.widths == (2, 3, 4, 8)
    assert spec.draft_model.startswith("/") and spec.token_capacity == 64
    _, config = configure(["--proposer", "copy", "--speculative-acceptance-prior", "0.8,0.6"])
    assert config.speculation.acceptance_prior == (0.8, 0.6)
    _, config = configure([])
    assert config.speculation is None


def test_prefix_caching_is_on_by_default_and_the_flags_reach_the_engine(tmp_path):
    from runtime.deploy.local import LocalDeployment

    _, config = configure([])
    assert config.enable_prefix_caching is True and config.debug_page_accounting is False
    engine = LocalDeployment(config).engine.config
    assert engine.enable_prefix_caching is True and engine.debug_page_accounting is False
    _, config = configure(["--no-enable-prefix-caching", "--debug-page-accounting"])
    assert config.enable_prefix_caching is False and config.debug_page_accounting is True
    engine = LocalDeployment(config).engine.config
    assert engine.enable_prefix_caching is False and engine.debug_page_accounting is True
    _, config = configure(["--no-enable-prefix-caching", "--enable-prefix-caching"])
    assert config.enable_prefix_caching is True  # the last one wins
    # --config's [run] takes either name; the --no- name turns caching off.
    for toml, on in [
        ("enable-prefix-caching = false", False),
        ("no-enable-prefix-caching = true", False),
        ("no-enable-prefix-caching = false", True),
        ("debug-page-accounting = true", True),
    ]:
        path = tmp_path / "run.toml"
        path.write_text(f"[run]\n{toml}\n")
        _, config = configure(["--config", str(path)])
        assert config.enable_prefix_caching is on, toml
    _, config = configure(["--config", str(path)])
    assert config.debug_page_accounting is True
    path.write_text("[run]\nenable-prefix-caching = false\n")
    _, config = configure(["--config", str(path), "--enable-prefix-caching"])
    assert config.enable_prefix_caching is True  # the command line wins


def test_the_prefix_cache_flags_show_in_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--debug-page-accounting",
    ):
        assert flag in out


@pytest.mark.parametrize(
    ("flags", "env", "keys"),
    [
        ([], None, ()),
        ([], "", ()),
        ([], "e1", ("e1",)),
        ([], "e1,e2", ("e1", "e2")),
        (["--api-key", "k1"], "e1", ("k1",)),  # the flag beats the environment
        (["--api-key", "k1,k2"], None, ("k1", "k2")),
        (["--api-key", "k1", "--api-key=k2", "--api-key", "k3, k1"], None, ("k1", "k2", "k3")),
    ],
)
def test_api_keys_from_the_flag_repeated_or_listed_or_the_environment(
    monkeypatch, flags, env, keys
):
    if env is None:
        monkeypatch.delenv("FLARE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("FLARE_API_KEY", env)
    args, _ = configure(flags)
    assert args.api_key == keys


def test_an_empty_api_key_fails_naming_the_flag(monkeypatch, capsys):
    monkeypatch.delenv("FLARE_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        configure(["--api-key", "k1", "--api-key", " , "])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--api-key" in err and len(err.splitlines()) == 1


def test_every_api_key_is_kept_off_the_coordinator_command_line():
    from runtime.cli.flags.security import without_secrets as _without_secrets

    argv = ["--api-key", "k1", "--api-key=k2,k3", "--port", "1", "--api-key", "k4"]
    assert _without_secrets(argv) == ("--port", "1")


def test_packed_prefill_is_on_by_default_and_the_flag_turns_it_off():
    _, config = configure([])
    assert config.packed_prefill and "--packed-prefill" in config.rank_args()
    _, config = configure(["--no-packed-prefill"])
    assert not config.packed_prefill and "--packed-prefill" not in config.rank_args()


def test_scored_prefill_is_on_by_default_and_the_flag_turns_it_off():
    _, config = configure([])
    assert config.scored_prefill and "--scored-prefill" in config.rank_args()
    _, config = configure(["--no-scored-prefill"])
    assert not config.scored_prefill and "--scored-prefill" not in config.rank_args()
