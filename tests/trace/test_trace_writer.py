"""The trace writer, the clock estimate and the readers on synthetic frames (no processes)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from runtime.cli.converters import trace_bytes as parse_bytes
from runtime.cli.flags.debugging import check_trace_path
from runtime.coordinator.config import ConfigError
from runtime.trace.clocks import ROUND_TRIPS, SAME_HOST, RankClocks
from runtime.trace.files import read_trace, trace_files
from runtime.trace.lines import lane_list
from runtime.trace.summary import percentile, render, summarize
from runtime.trace.timeline import timeline
from runtime.trace.writer import TraceOptions, TraceWriter


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def read_lines(path) -> list[dict]:
    return [json.loads(text) for text in Path(path).read_text().splitlines()]


def frame(fence: int, rank_ns: tuple[int, ...], waits: tuple[int, ...] | None = None) -> dict:
    """A frame line as the engine writes it, with what the readers use."""
    base = 1_000_000 * fence
    ranks = []
    for r, ns in enumerate(rank_ns):
        ranks.append(
            {"rank": r, "device_ns": ns, "readiness_delay_ns": 0,
             "launch_wait_ns": None if waits is None else waits[r],
             "host_times": [base + 10, base + 20, base + 20 + ns, base + 30 + ns],
             "stage_ns": [], "arrived_ns": base + 40 + ns, "clock_offset_ns": 0,
             "clock_error_ns": 0, "clock_samples": 1, "clock_source": ROUND_TRIPS}
        )  # fmt: skip
    lanes = {"request": [fence], "slot": [0], "generation": [1], "phase": ["decode"],
             "prompt_start": [0], "prompt_tokens": [0], "output_start": [fence], "max_tokens": [1],
             "token_count": [1], "finished": [0], "tokens": [fence + 100]}  # fmt: skip
    return {
        "event": "frame", "fence": fence, "graph": "decode B=1", "kind": "decode",
        "batch_capacity": 1, "prompt_capacity": 0, "reason": "ordinary",
        "selected_cost_ns": 900, "estimated_ns": 900, "queued": False,
        "plan_ns": base, "sent_ns": base + 5, "applied_ns": base + 50 + max(rank_ns),
        "lanes": lanes, "ranks": ranks, "device_ns": max(rank_ns),
        "skew_ns": max(rank_ns) - min(rank_ns), "dropped": 0,
    }  # fmt: skip


def write(tmp_path, frames: list[dict], **options) -> str:
    path = str(tmp_path / "trace.jsonl")
    writer = TraceWriter(TraceOptions(path, **options), lambda item: item, {"world_size": 2})
    for f in frames:
        assert writer.offer(f)
    writer.close()
    return path


# ------------------------------------------------------------------ writer


def test_files_are_0600_in_a_0700_directory_the_writer_creates(tmp_path):
    path = tmp_path / "a" / "b" / "trace.jsonl"
    writer = TraceWriter(TraceOptions(str(path)), lambda item: item)
    writer.offer({"fence": 1})
    writer.close()
    assert mode(path) == 0o600
    assert mode(tmp_path / "a") == 0o700 and mode(tmp_path / "a" / "b") == 0o700


def test_an_existing_file_is_narrowed_to_0600(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    TraceWriter(TraceOptions(str(path)), lambda item: item).close()
    assert mode(path) == 0o600
    assert "old" not in path.read_text()


def test_rotation_keeps_k_files_in_order_each_starting_with_a_start_line(tmp_path):
    frames = [frame(f, (1000, 1200)) for f in range(1, 201)]
    path = write(tmp_path, frames, max_bytes=8192, keep=2)
    files = trace_files(path)
    assert files == [f"{path}.2", f"{path}.1", path]
    fences = []
    for name in files:
        assert mode(name) == 0o600
        assert os.path.getsize(name) <= 8192
        lines = read_lines(name)
        assert lines[0]["event"] == "start" and lines[0]["world_size"] == 2
        fences += [line["fence"] for line in lines if line["event"] == "frame"]
    assert fences == sorted(fences) and fences[-1] == 200
    assert fences[0] > 1  # the oldest files were dropped
    end = read_lines(path)[-1]
    assert end["event"] == "end" and end["frames"] == 200 and end["rotations"] >= 3


def test_keep_zero_restarts_the_file(tmp_path):
    path = write(tmp_path, [frame(f, (1, 1)) for f in range(1, 100)], max_bytes=4096, keep=0)
    assert trace_files(path) == [path] and os.path.getsize(path) <= 4096


def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path):
    release = threading.Event()

    def slow(item):
        release.wait(10)
        return item

    path = str(tmp_path / "trace.jsonl")
    writer = TraceWriter(TraceOptions(path, queue_limit=4), slow, poll_s=0.001)
    started = time.perf_counter()
    accepted = [writer.offer({"fence": f}) for f in range(1, 101)]
    assert time.perf_counter() - started < 0.5  # never blocked
    assert writer.dropped == accepted.count(False) >= 90
    release.set()
    writer.close()
    lines = read_lines(path)
    frames = [line for line in lines if "fence" in line]
    assert len(frames) == writer.written == accepted.count(True)
    assert frames[-1]["dropped"] == writer.dropped  # in the lines ...
    assert lines[-1]["event"] == "end" and lines[-1]["dropped"] == writer.dropped  # ... and last
    assert writer.counters()["trace_dropped"] == writer.dropped


def test_the_ring_answers_since_a_fence_and_a_render_failure_is_counted(tmp_path):
    def render(item):
        if item["fence"] == 3:
            raise ValueError("bad")
        return None if item["fence"] == 4 else item

    writer = TraceWriter(TraceOptions(None, ring_lines=5), render, poll_s=0.001)
    for f in range(1, 11):
        writer.offer({"fence": f})
    assert writer.flush()
    assert [json.loads(t)["fence"] for t in writer.lines_since(0)] == [6, 7, 8, 9, 10]
    assert [json.loads(t)["fence"] for t in writer.lines_since(8)] == [9, 10]
    assert [json.loads(t)["fence"] for t in writer.lines_since(0, limit=1)] == [10]
    assert writer.render_errors == 1 and writer.written == 8
    writer.close()
    assert not writer.offer({"fence": 11}) and writer.dropped == 1


def test_options_and_flags_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="max_bytes"):
        TraceOptions("x", max_bytes=10)
    with pytest.raises(ConfigError, match="keep"):
        TraceOptions("x", keep=-1)
    assert parse_bytes("256M") == 256 << 20 == parse_bytes("256MiB") == parse_bytes("268435456")
    assert parse_bytes("1g") == 1 << 30 and parse_bytes("8k") == 8192
    with pytest.raises(Exception, match="at least 4096"):
        parse_bytes("100")
    with pytest.raises(ValueError, match="is a directory"):
        check_trace_path(str(tmp_path))
    assert check_trace_path(str(tmp_path / "new" / "t.jsonl")) == str(tmp_path / "new/t.jsonl")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        check_trace_path(str(tmp_path / "file" / "t.jsonl"))


# ------------------------------------------------------------------ clocks


def test_the_clock_offset_is_the_least_delay_round_trip():
    clocks = RankClocks(2)
    assert clocks.estimate(0).source == SAME_HOST and clocks.estimate(0).offset_ns == 0
    offset = 5_000_000  # rank 1's clock runs 5 ms ahead
    # A frame that waited 3 ms in the rank's socket, then one that did not.
    clocks.observe(1, 0, 100 + 3_000_000 + offset, 200 + 3_000_000 + offset, 3_000_300)
    clocks.observe(1, 10_000, 10_100 + offset, 10_200 + offset, 10_300)
    estimate = clocks.estimate(1)
    assert estimate.source == ROUND_TRIPS and estimate.samples == 2
    assert estimate.offset_ns == offset and estimate.error_ns == 100
    assert clocks.estimate(0).source == SAME_HOST
    # The window slides: once the good sample leaves it, the best remaining one counts.
    small = RankClocks(1, window=2)
    small.observe(0, 0, 10, 20, 30)  # delay 20
    small.observe(0, 100, 150, 160, 200)  # delay 90
    small.observe(0, 300, 340, 350, 400)  # delay 90, the first sample leaves
    assert small.estimate(0).error_ns == 45 and small.estimate(0).samples == 2


# ------------------------------------------------------------------ readers


def test_summary_and_timeline_of_synthetic_frames(tmp_path):
    # Rank 1 is slow in its own work; rank 0's longer intervals are launch waits.
    frames = [frame(f, (3_000_000, 2_900_000), waits=(2_000_000, 0)) for f in range(1, 41)]
    path = write(tmp_path, frames)
    trace = read_trace(path)
    assert len(trace.frames) == 40 and trace.world_size == 2 and trace.dropped == 0
    summary = summarize(trace, path)
    graph = summary["graphs"]["decode B=1"]
    assert graph["count"] == 40 and graph["estimate_ns"]["p50"] == 900
    assert graph["observed_ns"]["p50"] == 2_900_000
    assert graph["ranks"][0]["device_ns"]["p99"] == 3_000_000
    assert graph["skew_ns"]["p50"] == 100_000
    assert summary["slowest_rank"] == 1 and summary["all frames"]["stands_out"]
    text = render(summary)
    assert "slowest rank: 1" in text and "decode B=1" in text
    data = timeline(trace)
    json.dumps(data)
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "coordinator", 1: "rank 0", 2: "rank 1"}
    slices = [e for e in data["traceEvents"] if e["ph"] == "X" and e["tid"] > 0]
    assert len(slices) == 80
    first = next(e for e in slices if e["args"]["fence"] == 1 and e["tid"] == 2)
    assert first["dur"] == 2900.0 and first["args"]["reason"] == "ordinary"
    assert first["args"]["lanes"][0]["tokens"] == [101]


def test_lane_columns_split_back_into_lanes():
    columns = {"request": [4, 5], "token_count": [2, 0], "tokens": [7, 8], "phase": ["d", "p"]}
    assert lane_list(columns) == [
        {"request": 4, "token_count": 2, "phase": "d", "tokens": [7, 8]},
        {"request": 5, "token_count": 0, "phase": "p", "tokens": []},
    ]


def test_percentiles_are_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99
    assert percentile([7], 0.99) == 7 and percentile([], 0.5) == 0
