"""The real `flare` command: every flag and model problem is one stderr line naming
the flag or file, no traceback, a non-zero exit, and nothing started (no run
directory in TMPDIR, back within seconds); the new flags and aliases work end to
end (`flare run DIR --prompt`, `flare serve DIR` over HTTP, `--help`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from runtime.deploy.launch import free_port
from runtime.ranks.model import default_model_dir
from tests.support.checkpoints import write_tiny

pytestmark = pytest.mark.process  # every test here starts flare or rank processes

ROOT = Path(__file__).resolve().parents[2]
# No process starts on these paths: importing torch (for the config parser) is
# the slow part: about 3 s, more on a loaded two-core machine.
FAIL_FAST_S = 60.0


def flare(args: list[str], tmpdir: Path, timeout: float = 120.0) -> tuple[int, str, str, float]:
    """``python -m runtime.cli ARGS`` with TMPDIR=tmpdir: (exit code, stdout, stderr, s)."""
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmpdir))
    env.pop("FLARE_API_KEY", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


# -- model directories -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (4 heads, 2 KV heads, 256 positions) with the default model's
    tokenizer, and broken variants of it."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = default_model_dir() / "tokenizer.json"
    tiny = root / "tiny"
    write_tiny("llama", tiny, seed=5)
    shutil.copy(tokenizer, tiny / "tokenizer.json")
    no_tokenizer = root / "no-tokenizer"
    write_tiny("llama", no_tokenizer, seed=5)
    no_config = root / "no-config"
    shutil.copytree(tiny, no_config)
    (no_config / "config.json").unlink()
    no_weights = root / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny / name, no_weights / name)
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "activation_function": "gelu_new",
                "n_embd": 64,
                "n_head": 4,
                "n_layer": 2,
                "n_positions": 256,
                "vocab_size": 512,
            }
        )
    )
    shutil.copy(tokenizer, gpt2 / "tokenizer.json")
    shutil.copy(tiny / "model.safetensors", gpt2 / "model.safetensors")
    bad_tokenizer = root / "bad-tokenizer"
    shutil.copytree(tiny, bad_tokenizer)
    (bad_tokenizer / "tokenizer.json").write_text("{not json")
    template_dir = root / "template-dir"
    template_dir.mkdir()
    return {
        "tiny": tiny,
        "no-tokenizer": no_tokenizer,
        "no-config": no_config,
        "no-weights": no_weights,
        "gpt2": gpt2,
        "bad-tokenizer": bad_tokenizer,
        "missing": root / "missing",
        "template-dir": template_dir,
    }


# -- failures --------------------------------------------------------------------------------

PROMPT = ["--prompt", "hi"]
# (id, command line with {name} placeholders for the model directories, words the
# one line must hold).  Model and page problems run in serve mode and --prompt mode.
FAILURES = [
    ("missing-dir", ["run", "{missing}"], ["MODEL_DIR", "{missing}"]),
    ("missing-dir-flag", ["run", "--model", "{missing}"], ["--model", "{missing}"]),
    ("no-config", ["run", "{no-config}"], ["config.json", "{no-config}"]),
    ("no-tokenizer", ["run", "{no-tokenizer}"], ["tokenizer.json", "{no-tokenizer}"]),
    ("bad-tokenizer", ["run", "{bad-tokenizer}"], ["tokenizer.json", "{bad-tokenizer}"]),
    ("no-weights", ["run", "{no-weights}"], ["safetensors", "{no-weights}"]),
    ("gpt2", ["run", "{gpt2}"],
     ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]),
    ("tp-3", ["run", "{tiny}", "--tensor-parallel-size", "3"],
     ["--tensor-parallel-size", "num_attention_heads", "allowed: 1, 2, 4"]),
    ("tp-3-short", ["serve", "{tiny}", "-tp", "3"], ["--tensor-parallel-size", "1, 2, 4"]),
    ("tp-8-kv", ["run", "{tiny}", "-tp", "8"], ["--tensor-parallel-size", "1, 2, 4"]),
    ("one-page", ["run", "{tiny}", "--num-pages", "1"], ["--num-pages", "16 tokens", "pages"]),
    ("pages-for-max-model-len", ["run", "{tiny}", "--num-pages", "10", "--max-model-len", "256"],
     ["--num-pages", "--max-model-len 256", "16 pages"]),
    # 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 x 4 bytes = 8192 bytes per page.
    ("kv-memory-for-max-model-len", ["run", "{tiny}", "--device", "cpu", "--kv-cache-memory",
                                     "64KiB", "--max-model-len", "256"],
     ["--kv-cache-memory 65536", "--max-model-len 256", "needs 16 pages", "7 pages",
      "8192 bytes per page", "(64.0 KiB)"]),
    ("max-model-len-over-model", ["run", "{tiny}", "--max-model-len", "512"],
     ["--max-model-len", "256"]),
    ("both-models", ["run", "{tiny}", "--model", "{gpt2}"], ["MODEL_DIR", "--model"]),
]  # fmt: skip
# The same checks run in both modes; these show it on the real command (each run
# costs seconds of interpreter and torch start-up).
BOTH_MODES = {"missing-dir", "no-tokenizer", "gpt2", "tp-3", "one-page", "pages-for-max-model-len"}
PROMPT_ONLY = [
    ("prompt-over-context", ["run", "{tiny}", "--prompt", "hi", "--max-tokens", "300"],
     ["--max-tokens", "256"]),
    ("prompt-over-pages", ["run", "{tiny}", "--num-pages", "4", "--max-tokens", "70",
                           "--prompt", "hi"], ["--num-pages", "KV pages"]),
    ("top-p", ["run", "{tiny}", "--prompt", "hi", "--top-p", "2"], ["--top-p"]),
    ("top-k", ["run", "{tiny}", "--prompt", "hi", "--top-k", "0"], ["--top-k"]),
]  # fmt: skip
FLAGS = [
    ("max-num-seqs-100", ["run", "--max-num-seqs", "100"],
     ["--max-num-seqs", "at most 64", "64 request slots", "got 100"]),
    ("max-concurrency-100", ["run", "--max-concurrency", "100"], ["--max-concurrency", "64"]),
    ("max-num-seqs-0", ["run", "--max-num-seqs", "0"], ["--max-num-seqs", ">= 1"]),
    ("tp-0", ["run", "-tp", "0"], ["--tensor-parallel-size"]),
    ("num-pages-0", ["run", "--num-pages", "0"], ["--num-pages"]),
    ("page-size-negative", ["run", "--page-size", "-16"], ["--page-size"]),
    ("max-tokens-0", ["run", "--max-tokens", "0", "--prompt", "hi"], ["--max-tokens"]),
    ("max-model-len-small", ["run", "--max-model-len", "8"], ["--max-model-len", ">= 64"]),
    ("batched-tokens-odd", ["run", "--max-num-batched-tokens", "100"],
     ["--max-num-batched-tokens", "multiple of 64"]),
    ("choices-0", ["run", "--max-choices-per-request", "0"], ["--max-choices-per-request"]),
    ("dtype", ["run", "--dtype", "float8"], ["--dtype", "float32", "bfloat16", "float16"]),
    ("template-missing", ["run", "--chat-template", "{missing}"], ["--chat-template"]),
    ("template-dir", ["serve", "--chat-template", "{template-dir}"], ["--chat-template"]),
    ("port", ["serve", "--port", "70000"], ["--port", "65535"]),
    ("startup-timeout", ["run", "--startup-timeout", "-1"], ["--startup-timeout"]),
    ("gpu-memory-utilization", ["run", "--gpu-memory-utilization", "1.5"],
     ["--gpu-memory-utilization", "(0, 1]"]),
    ("kv-cache-memory-unit", ["run", "--kv-cache-memory", "4XB"], ["--kv-cache-memory", "4GiB"]),
    ("frame-timeout-margin", ["run", "--frame-timeout-margin", "0"],
     ["--frame-timeout-margin", "> 0"]),
    ("frames-port-local", ["run", "--frames-port", "5000"], ["--frames-port", "--ranks external"]),
    ("external-no-keys", ["run", "--ranks", "external"],
     ["--transport-keys", "flare keys", "--insecure-transport"]),
    ("external-remote", ["run", "--ranks", "external", "--insecure-transport", "--bind-host",
                         "0.0.0.0"], ["--bind-host 0.0.0.0", "--allow-remote"]),
    ("external-name", ["run", "--ranks", "external", "--insecure-transport", "--bind-host",
                       "example.com"], ["--bind-host", "IP address"]),
    ("external-world", ["run", "--ranks", "external", "--insecure-transport", "--world-size",
                        "2", "-tp", "1"], ["--world-size 2", "--tensor-parallel-size 1"]),
]  # fmt: skip
CASES = [
    *FAILURES,
    *[(f"{n}-prompt", [*argv, *PROMPT], words) for n, argv, words in FAILURES if n in BOTH_MODES],
    *PROMPT_ONLY,
    *FLAGS,
]


def fill(items: list[str], models: dict[str, Path]) -> list[str]:
    out = []
    for item in items:
        for name, path in models.items():
            item = item.replace("{" + name + "}", str(path))
        out.append(item)
    return out


@pytest.fixture(scope="module")
def outcomes(models, tmp_path_factory) -> dict[str, tuple]:
    """Every failing command line, each in a process of its own, forked from one
    driver that imported the CLI and torch once (tests/support/flare_forks.py):
    a refusal's cost is mostly that start-up, paid here once instead of 47 times.
    The real command line's own start-up is the other tests' (below)."""
    root = tmp_path_factory.mktemp("runs")
    cases = []
    for name, argv, _ in CASES:
        # A free port, so a check that fails to fail cannot meet another server.
        filled = fill(argv, models)
        if "--port" not in argv:
            filled += ["--port", str(free_port())]
        cases.append({"name": name, "argv": filled, "tmpdir": str(root / name)})
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FLARE_API_KEY", None)
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.flare_forks"],
        input=json.dumps(cases),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    ran = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["name"] for r in ran] == [c["name"] for c in cases], done.stderr
    return {
        r["name"]: (r["code"], r["stdout"], r["stderr"], r["seconds"], root / r["name"])
        for r in ran
    }


@pytest.mark.parametrize(("name", "argv", "words"), CASES, ids=[c[0] for c in CASES])
def test_each_problem_is_one_line_naming_the_flag_or_file(outcomes, models, name, argv, words):
    code, stdout, stderr, seconds, tmpdir = outcomes[name]
    assert code in (1, 2), (code, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    for word in fill(words, models):
        assert word in lines[0], (word, lines[0])
    # Nothing was started: no run directory of a coordinator or frontend, and back
    # well before a rank could have loaded.
    assert not [p.name for p in tmpdir.iterdir() if p.name.startswith("flare-")]
    assert seconds < FAIL_FAST_S


def test_serve_and_prompt_mode_refuse_the_same_pool_the_same_way(outcomes):
    serve, prompt = outcomes["one-page"][2], outcomes["one-page-prompt"][2]
    assert serve == prompt


# -- what works ------------------------------------------------------------------------------


def test_help_shows_every_default(tmp_path):
    for command in ("run", "serve"):
        code, stdout, stderr, _ = flare([command, "--help"], tmp_path)
        assert code == 0, stderr
        text = " ".join(stdout.split())  # unwrap the help columns
        for default in ("1024", "16", "32", "512", "auto", "1", "8000", "127.0.0.1", "600.0",
                        "False", "0.9", "20.0", "60.0", "512.0 MiB on CPU"):  # fmt: skip
            assert f"(default: {default})" in text, default
        for flag in ("MODEL_DIR", "-tp", "--max-num-seqs", "--max-concurrency", "--dtype",
                     "--max-num-batched-tokens", "--enforce-eager", "--no-cuda-graphs",
                     "--chat-template", "--max-choices-per-request", "--kv-cache-memory",
                     "--gpu-memory-utilization", "--frame-timeout-multiple"):  # fmt: skip
            assert flag in text, flag
        assert "no per-step token budget" in text


def test_flare_run_with_a_positional_model_and_the_new_flags_generates(models, short_tmp):
    argv = ["run", str(models["tiny"]), "--prompt", "hi", "--max-tokens", "3", "--dtype",
            "float32", "-tp", "1", "--max-num-seqs", "2", "--enforce-eager",
            "--max-num-batched-tokens", "64", "--device", "cpu"]  # fmt: skip
    code, stdout, stderr, _ = flare(argv, short_tmp)
    assert code == 0, stderr
    assert "serving tiny with TP=1" in stderr and "3 generated tokens" in stderr
    assert "==> prompt (" in stderr and "\nhi\n==> completion (" in stderr
    assert stdout.endswith("\n") and "==>" not in stdout  # the completion only


def test_kv_cache_memory_sizes_the_pool_the_ranks_report(models):
    """--kv-cache-memory reaches the ranks, which size their pool from it and from
    their share of the KV heads, and report it to the coordinator."""
    from runtime.cli.app import build_parser
    from runtime.cli.commands.run import checked_run
    from runtime.cli.flags.memory import kv_pool
    from runtime.deploy.local import LocalDeployment

    argv = ["run", str(models["tiny"]), "--device", "cpu", "--kv-cache-memory", "200KiB",
            "-tp", "2", "--max-num-seqs", "2", "--max-num-batched-tokens", "64"]  # fmt: skip
    parser = build_parser()
    config, model = checked_run(parser.parse_args(argv), parser, argv[1:])
    pool = kv_pool(config, model)
    # 2 layers x (K, V) x 16 tokens x 1 KV head per rank (of 2, TP=2) x 16 x 4 bytes,
    # in 200 KiB less one scratch token.
    assert pool is not None and pool.page_bytes == 4096
    assert pool.num_pages == (200 * 1024 - 256) // 4096 == 49
    with LocalDeployment(config) as deployment:
        assert deployment.engine.facts.num_pages == 49
    default = kv_pool(replace(config, kv_cache_memory_bytes=None), model)
    assert default is not None and default.num_pages == (512 << 20) // 4096 - 1


def test_flare_serve_model_dir_serves_over_http(tmp_path, short_tmp):
    """`flare serve DIR` (as vLLM users type it) with the new flags: the coordinator
    process parses them too."""
    port = free_port()
    model = tmp_path / "served-model"
    shutil.copytree(default_model_dir(), model)  # its vocabulary matches the tokenizer
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(short_tmp))
    env.pop("FLARE_API_KEY", None)
    argv = ["serve", str(model), "--port", str(port), "--device", "cpu", "--dtype", "float32",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "128", "--enforce-eager",
            "--chat-template", str(template), "--max-choices-per-request", "8",
            "--log-level", "info"]  # fmt: skip
    with open(tmp_path / "log", "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", *argv], env=env, stdout=log, stderr=log
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, Path(log.name).read_text()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, Path(log.name).read_text()
                time.sleep(0.3)
            models_list = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
            assert models_list["data"][0]["id"] == "served-model"
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                timeout=60,
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        finally:
            proc.send_signal(2)  # SIGINT, as Ctrl-C
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        output = Path(log.name).read_text()
    assert proc.returncode == 0, output
    assert "Traceback" not in output
    # The coordinator took --max-num-seqs (and --log-level: its engine's INFO line).
    assert "[coordinator] INFO engine started: " in output and "2 slots" in output
