"""Frame record and replay: a recorded run replays to identical tokens at TP=1
and TP=2 (rank processes, no coordinator); an edited frame is reported as the
first divergence."""

from __future__ import annotations

import dataclasses
import os
import stat
from array import array

import msgpack
import pytest

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from runtime.replay import replay
from runtime.transport.codec import decode, encode
from runtime.transport.frame import Frame
from runtime.transport.recording import LOG, read_recording
from tests.support.checkpoints import write_tiny

pytestmark = pytest.mark.process

PROMPTS = [[5, 17, 33, 3, 60], [9, 9, 41, 77, 12, 3, 50], [88, 7]]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    model = tmp_path_factory.mktemp("replay-model")
    write_tiny("llama", model, seed=29)
    directory = tmp_path_factory.mktemp("replay") / "recording"
    config = DeploymentConfig(
        model=str(model), max_concurrency=4, max_prefill_tokens=64, num_pages=64,
        device="cpu", startup_timeout_s=120, record_frames=str(directory),
    )  # fmt: skip
    with LocalDeployment(config) as d:
        streams = [d.engine.submit(p, 5, ignore_eos=True) for p in PROMPTS]
        tokens = [s.result(timeout=300).token_ids for s in streams]
    return directory, tokens


def test_the_recording_is_private_and_complete(recorded):
    directory, tokens = recorded
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory / LOG).st_mode) == 0o600
    recording = read_recording(directory)
    assert recording.report is not None and recording.meta["tensor_parallel_size"] == 1
    lanes = [f for f in recording.frames if f.num_lanes]
    assert lanes and all(f.fence in recording.completions for f in lanes)
    committed = sorted(t for c in recording.completions.values() for t in c.tokens)
    assert committed == sorted(t for run in tokens for t in run)


@pytest.mark.parametrize("world", [1, 2])
def test_a_recording_replays_to_the_same_tokens(recorded, world):
    directory, _ = recorded
    lines: list[str] = []
    report = replay(str(directory), tensor_parallel_size=world, out=lines.append)
    assert report.divergence is None, report.divergence
    assert report.frames == len(read_recording(directory).frames)
    assert all(len(ns) == world for ns in report.intervals_ns)
    assert lines[-1].startswith(f"replayed {report.frames} frames")


def test_an_edited_frame_is_the_first_divergence(recorded, tmp_path):
    directory, _ = recorded
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "meta.json").write_bytes((directory / "meta.json").read_bytes())
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed((directory / LOG).read_bytes())
    entries, target = [], None
    for kind, blob in unpacker:
        message = decode(blob)
        if kind == "frame" and target is None and len(message.prompt_tokens):
            target = message.fence  # the first prompt: one token changed
            tokens = array("q", message.prompt_tokens)
            tokens[-1] = (tokens[-1] + 1) % 100
            blob = encode(dataclasses.replace(message, prompt_tokens=tokens))
            assert isinstance(decode(blob), Frame)
        entries.append(msgpack.packb([kind, blob], use_bin_type=True))
    (edited / LOG).write_bytes(b"".join(entries))
    report = replay(str(edited), out=lambda line: None)
    assert report.divergence is not None and not report.ok
    assert report.divergence.startswith(f"fence {target}: lane 0")
