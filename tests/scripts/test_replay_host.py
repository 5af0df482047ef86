"""The replay's host models: what they measure from a trace and how they charge frames."""

from __future__ import annotations

import pytest

from runtime.coordinator.config import PolicyConfig, SchedulerConfig
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from scripts.scheduling_sim.engine import Simulation
from scripts.scheduling_sim.metrics import summarize
from scripts.scheduling_sim.replay.costs import MeasuredCosts
from scripts.scheduling_sim.replay.host import (
    SIMULATOR_COMPLETION_NS,
    HostModel,
    MeanHost,
    Measured,
    TimelineHost,
    host_model,
)
from scripts.scheduling_sim.replay.simulation import ReplaySimulation, Traffic
from scripts.scheduling_sim.workload import Arrival
from tests.support.traces import COMPLETION_NS, LAUNCH_NS, TraceBuilder, graph

MS = 1_000_000


def measured(b: TraceBuilder) -> Measured:
    frames = [line for line in b.lines if line["event"] == "frame"]
    requests = [line for line in b.lines if line["event"] == "request"]
    costs = MeasuredCosts(frames)
    return Measured(frames, requests, requests[0]["submitted_ns"], costs.median_ns)


def two_decodes() -> TraceBuilder:
    """Decode B=1 at 2 ms then 4 ms (median 3: speeds 1.5 and 0.75), 10 ms apart,
    each planned when a request was admitted (50 us after its submission)."""
    b = TraceBuilder()
    b.request(0, 8, 2, b.now_ns)
    b.frame("decode B=1", [(0, "decode", 1)], 2 * MS)
    later = b.now_ns + 10 * MS
    b.request(1, 8, 2, later - 50_000)
    b.frame("decode B=1", [(0, "decode", 1)], 4 * MS, at_ns=later)
    return b


def test_the_host_quantities_are_measured_per_frame():
    m = measured(two_decodes())
    assert [v for _, v in m.launch] == [LAUNCH_NS, LAUNCH_NS]
    assert m.turnaround == []  # each frame was sent after the one before had ended
    assert [v for _, v in m.completion] == [COMPLETION_NS] * 2
    assert m.admission == [(0, 50_000), (m.launch[1][0] - 50_000, 50_000)]
    assert [speed for *_, speed in m.spans] == [1.5, 0.75]
    assert (m.device_ns, m.median_total_ns) == (6 * MS, 6 * MS)


def test_a_frame_sent_before_the_previous_ended_measures_its_turnaround():
    b = TraceBuilder()
    b.request(0, 8, 2, b.now_ns)
    first = b.frame("decode B=1", [(0, "decode", 1)], 5 * MS)
    b.frame("decode B=1", [(0, "decode", 1)], 5 * MS, at_ns=first["sent_ns"] + 1 * MS)
    m = measured(b)
    # The second one "starts" LAUNCH_NS after its send, 1 ms into the first's interval:
    # it overlaps by 4 ms less the launch (the builder does not serialize the device).
    assert [v for _, v in m.turnaround] == [LAUNCH_NS + 1 * MS - (LAUNCH_NS + 5 * MS)]


def test_the_timeline_runs_frames_at_the_recorded_speed_of_their_moment():
    m = measured(two_decodes())
    host = TimelineHost(m)
    (start1, end1, _), (start2, end2, _) = m.spans
    assert host.execute(start1, 3 * MS) == end1  # 3 ms of work at 1.5
    assert host.execute(start2, 3 * MS) == end2  # at 0.75: 4 ms
    # The idle time between them is split at its midpoint: 1.5 before, 0.75 after.
    middle = (end1 + start2) // 2
    assert host.execute(middle - 3 * MS, 3 * MS) == middle - 1 * MS
    assert host.execute(middle, 3 * MS) == middle + 4 * MS
    # Before the first frame and after the last, the graph's own median.
    assert host.execute(start1 - 10 * MS, 3 * MS) == start1 - 7 * MS
    assert host.execute(end2 + 1, 3 * MS) == end2 + 1 + 3 * MS
    # Straddling the end: 1 ms at 0.75 (0.75 ms of work), the other 2.25 ms at 1.
    assert host.execute(end2 - 1 * MS, 3 * MS) == end2 + 2_250_000


def test_overheads_are_the_nearest_recorded_and_the_median_past_the_span():
    host = TimelineHost(measured(two_decodes()))
    assert host.launch_ns(0) == LAUNCH_NS and host.completion_ns(3 * MS) == COMPLETION_NS
    assert host.turnaround_ns(0) == 0  # none recorded
    assert host.admission_ns(10**12) == 50_000


def test_the_mean_host_stretches_every_interval_alike():
    b = two_decodes()
    b.frame("decode B=2", [(0, "decode", 1)], 9 * MS)
    host = MeanHost(measured(b))
    assert host.stretch == 1.0  # each graph's frames are at their median in total
    assert host.execute(0, 2 * MS) == 2 * MS
    assert host.solo_overhead_ns() == LAUNCH_NS + COMPLETION_NS
    assert host.figures()["host_model"] == "mean"


def test_host_model_names():
    assert type(host_model("none", None)) is HostModel
    assert host_model("none", None).completion_ns(0) == SIMULATOR_COMPLETION_NS
    with pytest.raises(ValueError, match="host model"):
        host_model("busy", None)


def test_without_a_host_model_the_replay_is_the_plain_simulator():
    """ReplaySimulation with the simulator's own host gives exactly what Simulation does."""
    b = two_decodes()
    b.frame("prefill B=1 C=64", [(0, "prefill", 1)], 8 * MS)
    costs = MeasuredCosts([line for line in b.lines if line["event"] == "frame"])
    catalog = [graph(name) for name in ("prefill B=1 C=64", "decode B=1", "decode B=2")]
    arrivals = [Arrival(i * 3 * MS, RequestSpec(40 + 9 * i, 5 + i)) for i in range(6)]

    def scheduler() -> Scheduler:
        return Scheduler(catalog, SchedulerConfig(max_slots=2), PolicyConfig())

    plain = Simulation(scheduler(), costs.duration_ns, arrivals, catalog=catalog).run()
    submitted = [a.at_ns for a in arrivals]
    traffic = Traffic(arrivals, submitted, {})
    replayed = ReplaySimulation(scheduler(), costs, traffic, HostModel(), catalog).run()
    assert summarize(replayed, solo_ns=plain.solo_ns) == summarize(plain)
    assert replayed.graphs_run == {
        graph("prefill B=1 C=64"),
        graph("decode B=1"),
        graph("decode B=2"),
    }
