"""What `flare run` prints: the README's first command shows the prompt and the
completion apart (the completion alone on stdout), no log line below WARNING at
the default --log-level, and labelled figures; at --log-level info the ranks'
catalog count is the one the summary gives.  Start-up warnings: a pool smaller
than one --max-model-len request, a model directory without a chat template."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import runtime.cli.commands.run as run_command
from runtime.cli import main as flare_main
from runtime.cli.commands.prompt import describe_summary
from runtime.frontend.chat import load_chat_template
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir
from tests.support.checkpoints import write_tiny

ROOT = Path(__file__).resolve().parents[2]
README = ["run", "--tensor-parallel-size", "2", "--prompt", "Hello"]  # the README's first command
COUNTS = r"catalog of (\d+ programs \(\d+ forward \+ \d+ state\))"


def flare(argv: list[str], tmp_path: Path, merged: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    env.pop("FLARE_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        timeout=300,
    )


@pytest.mark.process
def test_the_readme_command_prints_the_completion_apart_and_no_info_lines(short_tmp):
    done = flare(README, short_tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in [*done.stderr.splitlines(), *done.stdout.splitlines()]:
        assert not re.search(r"\b(INFO|DEBUG)\b", line), line
    # Warnings may show (a source file edited during start-up: a code-version warning).
    err = [line for line in done.stderr.splitlines() if not re.search(r"\] .*WARNING ", line)]
    # Else exactly: the summary, the prompt block, the completion's label, the figures.
    assert len(err) == 5, done.stderr
    assert re.fullmatch(
        rf"flare: serving flare-tiny-llama-v\d+ with TP=2, {COUNTS}, ready in [\d.]+ s", err[0]
    ), err[0]
    assert re.fullmatch(r"==> prompt \(\d+ tokens\)", err[1]), err[1]
    assert err[2] == "Hello"
    assert re.fullmatch(
        r"==> completion \(32 generated tokens in \d+ ms, finish: length\)", err[3]
    ), err[3]
    assert re.fullmatch(
        r"==> figures: \d+ frames, [\d.]+ ms of device time each; overhead over device time: "
        r"host -?[\d.]+% per frame \([\d.]+ ms round trip\), -?[\d.]+% over the busy span",
        err[4],
    ), err[4]
    # stdout: the completion alone, not glued to the prompt, no log line.
    assert done.stdout.strip() and done.stdout.endswith("\n")
    assert "==>" not in done.stdout and "Hello" not in done.stdout.splitlines()[0]
    assert "{" not in "\n".join(err)  # no raw JSON


@pytest.mark.process
def test_at_log_level_info_the_ranks_count_the_catalog_as_the_summary_does(short_tmp):
    done = flare([*README, "--max-tokens", "4", "--log-level", "info"], short_tmp, merged=True)
    assert done.returncode == 0, done.stdout[-3000:]
    lines = done.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("flare: serving "))
    (counts,) = re.findall(COUNTS, summary)
    for rank in (0, 1):
        logged = [line for line in lines if line.startswith(f"[rank {rank} pid ")]
        catalog = [line for line in logged if " INFO runtime.ranks: on cpu: catalog of " in line]
        assert len(catalog) == 1, logged
        assert re.findall(COUNTS, catalog[0]) == [counts], (catalog[0], summary)
        assert re.search(r"\), 0 captured as CUDA graphs; \d+ KV pages$", catalog[0])
    engine = [line for line in lines if "INFO engine started: " in line]
    assert len(engine) == 1 and re.findall(COUNTS, engine[0]) == [counts], engine
    # The blocks keep their order around the log lines.
    labels = [line for line in lines if line.startswith("==> ")]
    assert [label.split()[1] for label in labels] == ["prompt", "completion", "figures:"]
    prompt = lines.index(labels[0])
    assert lines[prompt + 1] == "Hello" and lines[prompt + 2] == labels[1]


def test_the_figures_line_names_what_it_counts():
    text = describe_summary(
        {
            "frames": 33,
            "queued_frames": 29,
            "mean_device_ns": 28_737_582.8,
            "mean_host_wall_ns": 54_418_676.7,
            "host_overhead_ratio": 1.1237,
            "round_trip_ns": 3_770_097.0,
            "busy_overhead_ratio": 1.0204,
        }
    )
    assert text == (
        "33 frames, 28.7 ms of device time each; overhead over device time: host 12.4% per "
        "frame (3.8 ms round trip), 2.0% over the busy span"
    )
    assert describe_summary({"frames": 0}) == "0 frames"


# -- start-up warnings ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama (2 layers, 2 KV heads, 256 positions): 8192 bytes per KV page."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    write_tiny("llama", path, seed=5)
    shutil.copy(default_model_dir() / "tokenizer.json", path / "tokenizer.json")
    return path


def start(monkeypatch, caplog, argv: list[str]) -> list[str]:
    """``flare ARGV`` up to the start (nothing is started): its warnings."""
    assert "--prompt" in argv  # serving would start processes
    monkeypatch.setattr(run_command, "generate_once", lambda *args: 0)
    with caplog.at_level(logging.WARNING):
        assert flare_main(argv) == 0
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_pool_smaller_than_one_full_request_warns_naming_the_flags(tiny, monkeypatch, caplog):
    argv = ["run", str(tiny), "--device", "cpu", "--prompt", "hi", "--kv-cache-memory", "64KiB"]
    (warning,) = start(monkeypatch, caplog, argv)
    # 64 KiB less one scratch token: 7 pages of 16 tokens.
    for words in ("--kv-cache-memory 65536 (64.0 KiB)", "7 pages of 16 tokens = 112 tokens",
                  "--max-model-len context (256 tokens", "needs 16 pages",
                  "limited to 112 tokens", "raise --kv-cache-memory",
                  "--max-model-len 112 or lower"):  # fmt: skip
        assert words in warning, (words, warning)
    caplog.clear()
    assert start(monkeypatch, caplog, [*argv[:-1], "1MiB"]) == []


def test_a_model_without_a_chat_template_gets_the_fallback_with_a_warning(tiny, caplog, tmp_path):
    tokenizer = ModelTokenizer.from_dir(tiny)
    with caplog.at_level(logging.WARNING, logger="runtime.frontend"):
        template = load_chat_template(tiny, tokenizer)
    assert template.source is None  # the fallback
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(tiny) in warning and "no chat template" in warning
    assert "<|{role}|>" in warning and "--chat-template FILE" in warning
    caplog.clear()
    with_template = tmp_path / "with-template"
    shutil.copytree(tiny, with_template)
    (with_template / "chat_template.jinja").write_text("{{ messages[0].content }}")
    with caplog.at_level(logging.WARNING, logger="runtime.frontend"):
        assert load_chat_template(with_template, tokenizer).source is not None
    assert caplog.records == []
