"""runtime/identity.py: the digests the start-up agreement compares, the report's
identity fields, and agree() naming the field and the parties that differ."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.engine.config import EngineStartError
from runtime.coordinator.engine.startup import agree, disagreements
from runtime.identity import (
    ExpectedIdentity,
    IdentityError,
    ModelIdentity,
    code_digest,
    code_version,
    collective_fingerprint,
    expected_identity,
    model_identity,
    package_version,
)
from runtime.ranks.model.default import default_model_dir
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.codec import decode, encode
from runtime.transport.fields import ProtocolError
from runtime.transport.schema import PROTOCOL_VERSION


@pytest.fixture(scope="module")
def source() -> Path:
    return Path(default_model_dir())


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def weights(model_dir: Path) -> Path:
    return model_dir / "model.safetensors"


def header_length(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


# ------------------------------------------------------------------ the digests


def test_same_files_in_another_directory_agree(source: Path, tmp_path: Path) -> None:
    a = copy_model(source, tmp_path / "one-name")
    b = copy_model(source, tmp_path / "another-name")
    assert model_identity(a) == model_identity(b) == model_identity(source)
    full = model_identity(a, full_weights=True)
    assert full == model_identity(b, full_weights=True)
    assert full.weights_full_digest and full.weights_digest == model_identity(a).weights_digest
    assert model_identity(a).weights_full_digest == ""  # only when asked


def test_a_changed_weight_changes_only_the_full_digest(source: Path, tmp_path: Path) -> None:
    model = copy_model(source, tmp_path / "m")
    before = model_identity(model, full_weights=True)
    path = weights(model)
    data = bytearray(path.read_bytes())
    data[8 + header_length(path) + 100] ^= 0x01  # one bit of tensor data
    path.write_bytes(bytes(data))
    after = model_identity(model, full_weights=True)
    assert after.weights_digest == before.weights_digest  # headers and sizes unchanged
    assert after.weights_full_digest != before.weights_full_digest
    assert (after.config_digest, after.tokenizer_digest) == (
        before.config_digest,
        before.tokenizer_digest,
    )


def test_a_changed_header_or_size_changes_the_weights_digest(source: Path, tmp_path: Path) -> None:
    model = copy_model(source, tmp_path / "m")
    before = model_identity(model).weights_digest
    path = weights(model)
    data = path.read_bytes()
    n = header_length(path)
    header = json.loads(data[8 : 8 + n])
    header.setdefault("__metadata__", {})["note"] = "x"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    changed_header = model_identity(model).weights_digest
    assert changed_header != before
    path.write_bytes(path.read_bytes() + b"\0" * 8)  # same header, 8 bytes longer
    assert model_identity(model).weights_digest not in (before, changed_header)


def test_config_digest_is_canonical_json(source: Path, tmp_path: Path) -> None:
    model = copy_model(source, tmp_path / "m")
    before = model_identity(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config, indent=7, sort_keys=False))
    assert model_identity(model) == before  # reformatted: the same config
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 2
    (model / "config.json").write_text(json.dumps(config))
    assert model_identity(model).config_digest != before.config_digest
    assert model_identity(model).weights_digest == before.weights_digest


def test_tokenizer_files_change_the_tokenizer_digest(source: Path, tmp_path: Path) -> None:
    model = copy_model(source, tmp_path / "m")
    before = model_identity(model).tokenizer_digest
    (model / "tokenizer_config.json").write_text('{"add_bos_token": true}')
    with_config = model_identity(model).tokenizer_digest
    assert with_config != before
    text = (model / "tokenizer.json").read_text()
    (model / "tokenizer.json").write_text(text.replace('"<|eos|>"', '"<|end|>"', 1))
    assert model_identity(model).tokenizer_digest not in (before, with_config)


def test_a_coordinator_copy_without_weights(source: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, model / name)
    with pytest.raises(IdentityError, match=r"no \*\.safetensors files in .*m"):
        model_identity(model)
    partial = model_identity(model, require_weights=False)
    assert partial.weights_digest == ""
    assert set(partial.fields()) == {"config_digest", "tokenizer_digest"}
    full = model_identity(source)
    assert (partial.config_digest, partial.tokenizer_digest) == (
        full.config_digest,
        full.tokenizer_digest,
    )


def test_broken_files_are_named(source: Path, tmp_path: Path) -> None:
    model = copy_model(source, tmp_path / "m")
    weights(model).write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(IdentityError, match=r"model\.safetensors: not a safetensors file"):
        model_identity(model)
    (model / "config.json").write_text("{not json")
    with pytest.raises(IdentityError, match=r"config\.json: not JSON"):
        model_identity(model)
    (model / "config.json").unlink()
    with pytest.raises(IdentityError, match=r"has no config\.json"):
        model_identity(model)


def test_the_index_names_the_weight_files(source: Path, tmp_path: Path) -> None:
    model = copy_model(source, tmp_path / "m")
    plain = model_identity(model)
    index = {"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(weights(model), model / "stray.safetensors")  # not in the index: ignored
    assert model_identity(model).weights_digest == plain.weights_digest
    index["weight_map"]["lm_head.weight"] = "missing.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(IdentityError, match=r"names missing\.safetensors, which does not exist"):
        model_identity(model)


def test_code_digest_covers_the_runtime_and_kernel_sources(tmp_path: Path) -> None:
    assert code_digest() == code_digest()
    version = code_version()
    assert version == code_version()
    assert version.startswith(package_version() + "+src.") and len(version.split(".")[-1]) == 16
    for name, text in (("runtime/a.py", "x = 1\n"), ("kernels/k/b.py", "y = 2\n")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    base = code_digest(tmp_path)
    (tmp_path / "runtime/__pycache__").mkdir()
    (tmp_path / "runtime/__pycache__/a.cpython-311.py").write_text("junk")
    (tmp_path / "runtime/notes.txt").write_text("not source")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/t.py").write_text("not the runtime")
    assert code_digest(tmp_path) == base
    (tmp_path / "kernels/k/b.py").write_text("y = 3\n")
    changed = code_digest(tmp_path)
    assert changed != base
    (tmp_path / "kernels/k/b.py").rename(tmp_path / "kernels/k/c.py")
    assert code_digest(tmp_path) not in (base, changed)


# ------------------------------------------------------------------ the report


def report(rank: int = 0, world_size: int = 2, **fields: object) -> CatalogReport:
    identity = model_identity(default_model_dir())
    values: dict = {
        "rank": rank,
        "world_size": world_size,
        "descriptors": (
            GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
            GraphDescriptor(GraphKind.DECODE, 1),
        ),
        "vocab_size": 512,
        "max_context": 256,
        "page_size": 16,
        "num_pages": 64,
        "model_name": "m",
        "kv_page_bytes": 8192,
        "dtype": "float32",
        "device_type": "cpu",
        "protocol_version": PROTOCOL_VERSION,
        "code_version": code_version(),
        "config_digest": identity.config_digest,
        "tokenizer_digest": identity.tokenizer_digest,
        "weights_digest": identity.weights_digest,
        "weights_full_digest": "",
        "draft_digest": "",
    }
    values.update(fields)
    return CatalogReport(**values)


def test_the_report_carries_the_identity_over_the_wire() -> None:
    sent = report(weights_full_digest="a" * 64, draft_digest="b" * 64)
    assert decode(encode(sent)) == sent


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("config_digest", ""),
        ("weights_digest", "XYZ"),
        ("tokenizer_digest", "A" * 64),  # upper case is not our hex
        ("draft_digest", "a" * 63),
        ("dtype", "int8"),
        ("device_type", "tpu"),
        ("code_version", ""),
        ("protocol_version", 0),
        ("kv_page_bytes", -1),
    ],
)
def test_the_report_refuses_a_bad_identity_field(field: str, value: object) -> None:
    with pytest.raises(ProtocolError, match=field):
        report(**{field: value})


# ------------------------------------------------------------------ agree()


def test_agree_names_the_field_and_groups_the_ranks_by_value() -> None:
    other = "9c01" + "0" * 60
    reports = {r: report(r, 4) for r in range(4)}
    reports[2] = report(2, 4, weights_digest=other, dtype="bfloat16")
    with pytest.raises(EngineStartError) as caught:
        agree(reports)
    text = str(caught.value)
    ours = model_identity(default_model_dir()).weights_digest[:12]
    assert f"ranks disagree on weights_digest: ranks 0-1, 3 have {ours}..., rank 2 has 9c01" in (
        text
    )
    assert "ranks disagree on dtype: ranks 0-1, 3 have float32, rank 2 has bfloat16" in text
    assert agree({r: report(r, 4) for r in range(4)}).dtype == "float32"


def test_agree_skips_digests_a_rank_did_not_compute() -> None:
    reports = {0: report(0, weights_full_digest="a" * 64), 1: report(1)}
    assert [name for name, _, _ in disagreements(reports)] == []
    reports[1] = report(1, weights_full_digest="b" * 64)
    assert [name for name, _, _ in disagreements(reports)] == ["weights_full_digest"]


def test_agree_names_the_coordinator(tmp_path: Path) -> None:
    model = copy_model(Path(default_model_dir()), tmp_path / "m")
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text() + " ")
    expected = expected_identity(model, PROTOCOL_VERSION)
    reports = {0: report(0), 1: report(1)}
    with pytest.raises(
        EngineStartError,
        match=r"the coordinator and the ranks disagree on tokenizer_digest: the coordinator "
        r"has [0-9a-f]{12}\.\.\., ranks 0-1 have",
    ):
        agree(reports, expected)
    assert agree(reports, expected_identity(default_model_dir(), PROTOCOL_VERSION))


def test_a_code_version_mismatch_fails_unless_allowed() -> None:
    identity = model_identity(default_model_dir())
    reports = {0: report(0), 1: report(1)}
    strict = ExpectedIdentity(identity, "0.0.9+src.0000000000000000", PROTOCOL_VERSION)
    with pytest.raises(
        EngineStartError, match=r"disagree on code_version: the coordinator has 0\.0\.9"
    ):
        agree(reports, strict)
    relaxed = ExpectedIdentity(identity, strict.code_version, PROTOCOL_VERSION, True)
    assert agree(reports, relaxed).code_version == code_version()
    reports[1] = report(1, code_version="other")
    with pytest.raises(EngineStartError, match="ranks disagree on code_version"):
        agree(reports)  # among the ranks: always an error without the coordinator's allowance


def test_model_identity_validates_its_digests() -> None:
    with pytest.raises(IdentityError, match="config_digest"):
        ModelIdentity("nope", "", "")
    with pytest.raises(IdentityError, match="weights_digest"):
        ModelIdentity("a" * 64, "", "b" * 10)


def test_the_collective_fingerprint_covers_shapes_and_dtype() -> None:
    identity = model_identity(default_model_dir())
    base = collective_fingerprint(identity, None, "float32")
    assert len(base) == 32 and base == collective_fingerprint(identity, None, "float32")
    assert collective_fingerprint(identity, None, "bfloat16") != base
    other = ModelIdentity(identity.config_digest, identity.tokenizer_digest, "f" * 64)
    assert collective_fingerprint(other, None, "float32") != base
    assert collective_fingerprint(identity, identity, "float32") != base  # a draft
    # Tensor bytes and the tokenizer do not change what the collectives exchange.
    verified = ModelIdentity(identity.config_digest, "", identity.weights_digest, "e" * 64)
    assert collective_fingerprint(verified, None, "float32") == base


def test_an_unreadable_coordinator_directory(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(IdentityError, match="missing is not a directory"):
        expected_identity(missing, PROTOCOL_VERSION)
    lenient = expected_identity(missing, PROTOCOL_VERSION, unreadable_ok=True)
    assert lenient.model is None  # the ranks name the problem; the versions still count
    assert lenient.fields() == {
        "protocol_version": PROTOCOL_VERSION,
        "code_version": code_version(),
    }
