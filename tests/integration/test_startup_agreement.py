"""Start-up agreement with real rank processes (TP=2 over gloo): a rank that loaded
other weights, or runs another dtype, fails start-up with an EngineStartError
naming the field and the ranks (runtime/identity.py, engine/startup.py)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from runtime.coordinator.engine import Engine, EngineConfig, EngineStartError
from runtime.deploy.launch import ROOT, free_port, rank_command, stop_ranks
from runtime.identity import expected_identity
from runtime.ranks.model.default import default_model_dir
from runtime.transport.schema import PROTOCOL_VERSION

pytestmark = pytest.mark.process

START_S = 180.0  # generous: two CPU ranks load torch and the model on a shared machine
COMMON = [
    "--device", "cpu", "--max-concurrency", "2", "--max-prefill-tokens", "64",
    "--num-pages", "16", "--max-model-len", "128", "--log-level", "warning",
]  # fmt: skip


def spawn(engine: Engine, per_rank: list[list[str]], home: Path) -> list[subprocess.Popen]:
    """The ranks as torchrun starts them, each with its own flags."""
    endpoints = engine.bind()
    port = free_port()
    procs = []
    for rank, args in enumerate(per_rank):
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            FLARE_HOME=str(home),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(len(per_rank)),
            LOCAL_WORLD_SIZE=str(len(per_rank)),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs.append(subprocess.Popen(rank_command(endpoints, [*COMMON, *args]), env=env))
    return procs


def engine(world_size: int, allow_code_mismatch: bool = False) -> Engine:
    """An engine expecting the embedded model (the coordinator's own directory)."""
    expected = expected_identity(
        default_model_dir(), PROTOCOL_VERSION, allow_code_mismatch=allow_code_mismatch
    )
    return Engine(
        EngineConfig(
            world_size=world_size,
            handshake_timeout_s=START_S,
            catalog_timeout_s=START_S,
            completion_timeout_s=None,
            expected_identity=expected,
        )
    )


def start_error(per_rank: list[list[str]], home: Path) -> str:
    """Start an engine with these ranks; the EngineStartError's text."""
    engine_ = engine(len(per_rank))
    procs = spawn(engine_, per_rank, home)
    try:
        with pytest.raises(EngineStartError) as caught:
            engine_.start()
    finally:
        engine_.stop()
        codes = stop_ranks(procs, timeout_s=30.0)
    assert codes == [0] * len(per_rank), codes  # the ranks left on the shutdown
    return str(caught.value)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The embedded model, an identical copy under another name, a copy with one
    weight changed (same header), and a copy whose safetensors header differs
    (same tensors)."""
    root = tmp_path_factory.mktemp("models")
    source = Path(default_model_dir())
    out = {"original": shutil.copytree(source, root / "original")}
    out["renamed"] = shutil.copytree(source, root / "renamed-copy")
    changed = shutil.copytree(source, root / "one-weight-changed")
    path = changed / "model.safetensors"
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 + n + 2] ^= 0x40  # a bit of the first tensor's data
    path.write_bytes(bytes(data))
    out["weight"] = changed
    header = shutil.copytree(source, root / "other-header")
    path = header / "model.safetensors"
    data = bytearray(path.read_bytes())
    meta = json.loads(data[8 : 8 + n])
    meta.setdefault("__metadata__", {})["origin"] = "another export"
    text = json.dumps(meta).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data[8 + n :]))
    out["header"] = header
    return out


def test_a_changed_weight_is_caught_by_the_full_digest(models, tmp_path) -> None:
    verify = ["--verify-weights"]
    text = start_error(
        [
            ["--model", str(models["original"]), *verify],
            ["--model", str(models["weight"]), *verify],
        ],
        tmp_path,
    )
    assert "ranks disagree on weights_full_digest: rank 0 has " in text, text
    assert ", rank 1 has " in text, text
    # Identical headers and sizes: only the full hash tells them apart.
    assert "weights_digest:" not in text, text


def test_identical_copies_under_other_names_agree(models, tmp_path) -> None:
    verify = ["--verify-weights"]
    # The code version is compared in every other test; here a file another
    # developer saves during the run must not fail the positive control.
    engine_ = engine(2, allow_code_mismatch=True)
    procs = spawn(
        engine_,
        [
            ["--model", str(models["original"]), *verify],
            ["--model", str(models["renamed"]), *verify],
        ],
        tmp_path,
    )
    try:
        engine_.start()
        facts = engine_.facts
        assert facts is not None and facts.model_name == "original"  # rank 0's, for display
        assert facts.weights_digest == engine_.config.expected_identity.model.weights_digest
        assert (facts.dtype, facts.device_type) == ("float32", "cpu")
    finally:
        engine_.stop()
        codes = stop_ranks(procs, timeout_s=30.0)
    assert codes == [0, 0], codes


def test_another_safetensors_header_is_caught_without_the_full_hash(models, tmp_path) -> None:
    text = start_error(
        [["--model", str(models["original"])], ["--model", str(models["header"])]], tmp_path
    )
    # The coordinator (the embedded model's directory) sides with rank 0.
    assert (
        "the coordinator and the ranks disagree on weights_digest: the coordinator and "
        "rank 0 have " in text
    ), text
    assert ", rank 1 has " in text, text


def test_another_dtype_is_named(tmp_path, capfd) -> None:
    text = start_error([["--dtype", "float32"], ["--dtype", "bfloat16"]], tmp_path)
    # The ranks saw it among themselves first and ran no collective of model data.
    assert capfd.readouterr().err.count("the ranks loaded different models or dtypes") == 2
    assert "ranks disagree on dtype: rank 0 has float32, rank 1 has bfloat16" in text, text
    # Page geometry: a bfloat16 page holds half the bytes.
    assert "ranks disagree on kv_page_bytes: rank 0 has 16384, rank 1 has 8192" in text, text
    assert "weights_digest" not in text, text  # the same files
