"""A recording directory takes one run: a second run into it is refused, never
appended (issue 23: the second run's frames, appended, made ``flare replay`` fail
with "fence 1 replayed: not greater than fence 4")."""

from __future__ import annotations

import pytest

from runtime.cli import main as flare_main
from runtime.transport.recording import LOG, FrameRecorder, RecordingError


def test_a_directory_with_a_recording_is_refused_and_kept(tmp_path):
    first = FrameRecorder(tmp_path / "rec")
    first.write("frame", b"one run's frame")
    first.close()
    before = (tmp_path / "rec" / LOG).read_bytes()
    with pytest.raises(RecordingError, match="already holds a recording"):
        FrameRecorder(tmp_path / "rec")
    assert (tmp_path / "rec" / LOG).read_bytes() == before  # nothing appended or lost


def test_an_empty_or_new_directory_takes_a_recording(tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new"):
        recorder = FrameRecorder(tmp_path / name)
        recorder.write("frame", b"x")
        recorder.close()
        assert (tmp_path / name / LOG).stat().st_size > 0


def test_flare_run_refuses_it_in_one_line_before_starting(tmp_path, capsys):
    """``flare run`` in this process (as ``python -m runtime.cli`` runs it, without the
    cost of a new interpreter): exit status 2 and one line, no traceback."""
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / LOG).write_bytes(b"\x92")
    with pytest.raises(SystemExit) as exited:
        flare_main(["run", "--prompt", "x", "--device", "cpu",
                    "--record-frames", str(tmp_path / "rec")])  # fmt: skip
    stderr = capsys.readouterr().err
    assert exited.value.code == 2
    lines = stderr.strip().splitlines()
    assert "--record-frames" in lines[-1] and "already holds a recording" in lines[-1]
    assert "Traceback" not in stderr
