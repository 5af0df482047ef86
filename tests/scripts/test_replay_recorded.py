"""Reading a recorded deployment for a what-if replay: what it keeps, what it refuses."""

from __future__ import annotations

import json
import os

import pytest

from runtime.coordinator.config import PolicyConfig
from runtime.trace.files import TraceFileError
from scripts.scheduling_sim.__main__ import main as sim_main
from scripts.scheduling_sim.replay import RecordingError, read_recording, replay
from scripts.scheduling_sim.replay.costs import MeasuredCosts
from scripts.scheduling_sim.replay.host import HostModel
from scripts.scheduling_sim.replay.simulation import (
    ReplaySimulation,
    make_replay_scheduler,
    policy_for,
    prompt_tokens,
)
from scripts.scheduling_sim.replay.simulation import traffic as make_traffic
from tests.support.traces import PROGRAMS, TraceBuilder, simple_trace


def test_requests_their_outputs_publications_and_the_catalog(tmp_path):
    recording = read_recording(simple_trace(tmp_path / "t.jsonl"))
    assert recording.skipped == {}
    first, second = recording.requests
    assert (first.request, first.prompt_len, first.max_tokens, first.output_tokens) == (0, 70, 3, 3)
    assert first.finish_reason == "length" and not first.cancelled
    assert len(first.publications_ns) == 3 and first.terminal_ns is not None
    assert first.finished_ns == first.terminal_ns  # the snapshot completed its response
    # The cancel came before the second decode frame was applied: its token is discarded.
    assert second.cancelled and second.finish_reason == "cancelled" and second.output_tokens == 2
    assert len(second.publications_ns) == 2 and second.finished_ns == second.finish_ns
    assert [d.describe() for d in recording.catalog] == PROGRAMS
    assert recording.scheduler["config"]["max_slots"] == 4
    assert recording.t0_ns == first.submitted_ns


def test_a_format_1_trace_is_refused_naming_what_it_lacks(tmp_path):
    b = TraceBuilder(version=1)
    b.lines.append(
        {
            "event": "request",
            "fence": 1,
            "request": 0,
            "submitted_ns": 1,
            "admitted_ns": 2,
            "prompt_tokens": 8,
            "max_tokens": 4,
        }
    )
    b.frame("prefill B=1 C=64", [(0, "prefill", 1)], 1_000_000)
    path = b.write(tmp_path / "old.jsonl")
    with pytest.raises(RecordingError) as err:
        read_recording(path)
    text = str(err.value)
    assert "format 1" in text and path in text
    assert "message_endpoints" in text and "prompt_pages" in text and "finish lines" in text
    assert sim_main(["--from-trace", path]) == 2


def test_missing_files_and_frames_are_named(tmp_path):
    with pytest.raises(TraceFileError, match="no such trace file"):
        read_recording(str(tmp_path / "absent.jsonl"))
    b = TraceBuilder()
    b.request(0, 8, 1, 5)
    b.finish(0, 1)
    with pytest.raises(RecordingError, match="frame lines"):
        read_recording(b.write(tmp_path / "noframes.jsonl"))


def test_rotated_files_are_read_oldest_first_and_lost_requests_are_named(tmp_path):
    """FILE.1 holds request 0; FILE (after rotation) holds request 1 and frames of a
    request 2 whose line was in a file rotated away: 2 is named, not replayed."""
    b = TraceBuilder()
    b.scheduler()
    b.request(0, 20, 1, b.now_ns)
    b.frame("prefill B=1 C=64", [(0, "prefill", 1)], 5_000_000)
    b.finish(0, 1)
    path = tmp_path / "t.jsonl"
    b.write(tmp_path / "t.jsonl.1", end=False)
    later = TraceBuilder(now_ns=b.now_ns, fence=b.fence)
    later.lines[0]["scheduler"] = {"config": {"max_slots": 2}, "policy": None, "preset": None}
    later.request(1, 20, 2, later.now_ns)
    later.frame("prefill B=1 C=64", [(1, "prefill", 1)], 5_000_000)
    later.frame("decode B=2", [(1, "decode", 1), (2, "decode", 1)], 2_000_000)
    later.finish(1, 2)
    later.write(path)
    recording = read_recording(str(path))
    assert [r.request for r in recording.requests] == [0, 1]
    assert recording.skipped == {2: "no request line (its file rotated away?)"}
    assert recording.scheduler["config"]["max_slots"] == 4  # the oldest file's own line
    os.remove(tmp_path / "t.jsonl.1")
    alone = read_recording(str(path))
    assert alone.scheduler["config"]["max_slots"] == 2  # the start line's copy
    with pytest.raises(RecordingError, match="pass --policy"):
        policy_for(alone, None)
    assert policy_for(alone, "throughput")[1] == "throughput"


def test_requests_without_output_are_named_not_replayed_unless_cancelled(tmp_path):
    b = TraceBuilder()
    b.scheduler()
    b.request(0, 20, 4, b.now_ns)
    b.request(1, 20, 4, b.now_ns + 10)
    b.request(2, 20, 4, b.now_ns + 20)
    b.finish(1, 0, "cancelled", at_ns=b.now_ns + 3_000_000)
    b.frame("prefill B=1 C=64", [(0, "prefill", 1)], 5_000_000)
    b.finish(0, 1, "stop")
    b.finish(2, 0, "unfinished")
    recording = read_recording(b.write(tmp_path / "t.jsonl"))
    assert [r.request for r in recording.requests] == [0, 1]
    assert recording.skipped == {2: "produced no output (unfinished)"}
    traffic = make_traffic(recording, HostModel())
    # Request 1 keeps its max tokens and is cancelled 3 ms (less 10 ns) after it arrived.
    assert traffic.cancels == {1: (0, 3_000_000 - 10)}
    assert [a.spec.max_output_tokens for a in traffic.arrivals] == [1, 4]


def test_a_cancelled_request_is_cancelled_after_its_output_as_recorded(tmp_path):
    recording = read_recording(simple_trace(tmp_path / "t.jsonl"))
    traffic = make_traffic(recording, HostModel())
    assert traffic.cancels == {1: (2, 1000)}  # 1 us after its second token
    costs = MeasuredCosts(recording.frames)
    scheduler = make_replay_scheduler("flare", recording, PolicyConfig())
    sim = ReplaySimulation(scheduler, costs, traffic, HostModel(), recording.catalog).run()
    first, second = sorted(sim.requests.values(), key=lambda s: s.arrival_ns)
    assert first.output_tokens == 3 and second.output_tokens == 2
    assert second.finished_ns == second.publications_ns[-1] + 1000
    assert sim.done and not sim.inflight


def test_a_trace_cut_short_counts_output_from_its_frames(tmp_path):
    b = TraceBuilder()
    b.scheduler()
    b.request(0, 20, 9, b.now_ns)
    b.frame("prefill B=1 C=64", [(0, "prefill", 1)], 5_000_000)
    b.frame("decode B=1", [(0, "decode", 1)], 2_000_000)
    r = read_recording(b.write(tmp_path / "cut.jsonl", end=False)).requests[0]
    assert (r.output_tokens, r.finish_reason, r.finished_ns) == (2, "unfinished", None)


def test_rebuilt_prompts_share_exactly_the_pages_their_digests_share(tmp_path):
    b = TraceBuilder()
    b.scheduler()
    b.request(0, 40, 1, 1, prompt_pages=["aa", "bb"], prompt_tail="t0")
    b.request(1, 40, 1, 2, prompt_pages=["aa", "cc"], prompt_tail="t0")
    b.request(2, 40, 1, 3, prompt_pages=["aa", "bb"], prompt_tail="t0")
    b.frame("prefill B=1 C=64", [(0, "prefill", 1)], 1_000_000)
    for r in range(3):
        b.finish(r, 1)
    one, two, three = (
        prompt_tokens(r, 16) for r in read_recording(b.write(tmp_path / "t.jsonl")).requests
    )
    assert len(one) == 40 and one == three
    assert one[:16] == two[:16] and one[16:32] != two[16:32]


def test_the_report_is_one_json_object_with_both_sides(tmp_path, capsys):
    path = simple_trace(tmp_path / "t.jsonl")
    report = replay(path)
    for side in ("recorded", "replayed"):
        assert {
            "ttft_ms_p50",
            "ttft_ms_p99",
            "gap_ms_p50",
            "gap_ms_p99",
            "gap_ms_max",
            "output_tokens_per_s",
            "goodput_req_per_s",
            "fairness_jain",
        } <= set(report[side])
    assert report["recorded"]["finished"] == report["replayed"]["finished"] == 2
    assert report["policy"] == "balanced (recorded)" and report["host"]["host_model"] == "timeline"
    assert sim_main(["--from-trace", path, "--host-model", "none", "--policy", "throughput"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert last["policy"] == "throughput" and last["host"] == {"host_model": "none"}
    assert out[0].startswith("what-if replay of")
