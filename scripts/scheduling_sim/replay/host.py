"""The recorded host: what turned device intervals into frames, as the replay charges it.

The simulator charges each frame its device interval and nothing else.  A real
deployment adds host time around it, and on a shared CPU host the device
interval itself stretches while other work holds the core.  Per recorded
frame, on the coordinator's clock (rank timestamps less their estimated clock
offset) and relative to the first request's submission:

* ``start``: the device started it, the earliest rank's ``launched`` time
  (``host_times[1]``; a rank that reports none: its completion's arrival less
  its interval); ``end`` = ``start`` + the frame's ``device_ns``;
* ``plan`` (after a completion) and ``command`` (after an admission or a
  cancel), per planning round: from the event that prompted it, the last
  frame applied or the last command taken before it, to its first frame's
  ``plan_ns``: the engine thread's own delay (applying a completion takes
  longer than taking a command).  The scheduler decides at that moment, and
  its prices depend on it;
* ``build``: from a frame's ``plan_ns`` to its ``sent_ns`` (building and
  sending it), after which the engine plans again in the same round;
* ``launch``, for a frame planned after the previous frame ended: ``start``
  less its ``plan_ns``: planning, building, sending, the rank's receive,
  checks and launch;
* ``turnaround``, for a frame planned while the previous one ran:
  ``start`` less the previous ``end`` (the rank publishing one frame, taking
  the next and launching it);
* ``completion``: ``applied_ns`` less ``end`` (the rank publishing, the
  coordinator waking and applying);
* ``admission``, per request: ``admitted_ns`` less ``submitted_ns``;
* ``speed``: the graph's median interval over this frame's (below 1 where the
  host slowed the device, above 1 where it ran faster than its median).

Host models (``--host-model``):

* ``timeline`` (the default): each quantity at replay time t is the recorded
  one nearest in time (plan and command keyed by their event, build and
  launch by the planning, turnaround by the previous end, completion by the
  end, admission by the submission; past the recorded span, the median).
  The device runs at the recorded speed of the frame that covered that time:
  each recorded frame owns its interval and the idle time next to it up to
  the midpoints to its neighbours; after the last frame, 1.  So the replay
  meets the host the deployment met, at the same moments.
* ``mean``: the mean of each quantity, and every interval stretched by the
  recorded total interval over the total of the frames' medians.
* ``none``: the simulator's own host: intervals at their medians, no plan,
  launch or turnaround time, 50 us from an interval's end to its completion.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Sequence

from runtime.catalog import GraphDescriptor
from scripts.scheduling_sim.replay.costs import frame_descriptor

HOST_MODELS = ("timeline", "mean", "none")
SIMULATOR_COMPLETION_NS = 50_000  # Simulation's default host_delay_ns
SPEED_RANGE = (0.02, 50.0)  # a recorded frame's speed is clamped to this
QUANTITIES = ("admission", "plan", "command", "build", "launch", "turnaround", "completion")


class HostModel:
    """The simulator's own host (``none``); subclasses measure the recorded one."""

    name = "none"

    def admission_ns(self, t: int) -> int:
        """From a request's submission at ``t`` to its admission."""
        return 0

    def plan_ns(self, t: int, command: bool = False) -> int:
        """From an event at ``t`` to planning: a completion applied, or (``command``)
        an admission or a cancel taken."""
        return 0

    def build_ns(self, t: int) -> int:
        """From planning a frame at ``t`` to having sent it (and planning again)."""
        return 0

    def launch_ns(self, t: int) -> int:
        """From planning at ``t`` a frame for an idle device to the device's start."""
        return 0

    def turnaround_ns(self, t: int) -> int:
        """From the device's end of one frame at ``t`` to its start of the next, queued."""
        return 0

    def completion_ns(self, t: int) -> int:
        """From the device's end of a frame at ``t`` to its completion applied."""
        return SIMULATOR_COMPLETION_NS

    def execute(self, start: int, nominal_ns: int) -> int:
        """When a frame of nominal cost ``nominal_ns`` started at ``start`` ends."""
        return start + nominal_ns

    def solo_overhead_ns(self) -> int:
        """Host time per frame of a request served alone (fairness's denominator)."""
        return SIMULATOR_COMPLETION_NS

    def figures(self) -> dict:
        return {"host_model": self.name}


class Measured:
    """What the recorded frames say of their host (see the module docstring)."""

    def __init__(
        self,
        frames: Sequence[dict],
        requests: Sequence[dict],
        t0: int,
        median_ns: Callable[[GraphDescriptor], int | None],
        cancels: Sequence[int] = (),
    ) -> None:
        """``cancels``: when the engine took cancellations (they make it plan too)."""
        self.plan: list[tuple[int, int]] = []  # (completion, plan delay ns)
        self.command: list[tuple[int, int]] = []  # (admission or cancel, plan delay ns)
        self.build: list[tuple[int, int]] = []  # (plan, ns to sent)
        self.launch: list[tuple[int, int]] = []  # (plan, launch ns)
        self.turnaround: list[tuple[int, int]] = []  # (previous end, ns)
        self.completion: list[tuple[int, int]] = []  # (end, ns)
        self.admission = sorted((r["submitted_ns"] - t0, r["admitted_ns"] - r["submitted_ns"])
                                for r in requests)  # fmt: skip
        self.spans: list[tuple[int, int, float]] = []  # (start, end, speed)
        self.device_ns = self.median_total_ns = 0
        applied = sorted(f["applied_ns"] for f in frames)
        admitted = sorted([r["admitted_ns"] for r in requests] + list(cancels))  # commands
        previous_end: int | None = None
        triggers: set[int] = set()
        for frame in sorted(frames, key=lambda f: f["fence"]):
            device = frame["device_ns"]
            start = frame_start(frame)
            end = start + device
            plan = frame["plan_ns"]
            completion, command = _last_before(applied, plan), _last_before(admitted, plan)
            trigger = max(completion, command) or plan
            if trigger not in triggers:  # the round's first plan
                triggers.add(trigger)
                series = self.plan if completion >= command else self.command
                series.append((trigger - t0, plan - trigger))
            self.build.append((plan - t0, frame["sent_ns"] - plan))
            if previous_end is not None and plan < previous_end:  # as the replay tells
                self.turnaround.append((previous_end - t0, start - previous_end))
            else:
                self.launch.append((plan - t0, start - plan))
            self.completion.append((end - t0, frame["applied_ns"] - end))
            median = median_ns(frame_descriptor(frame)) or device
            speed = median / device if device > 0 else 1.0
            speed = min(max(speed, SPEED_RANGE[0]), SPEED_RANGE[1])
            self.spans.append((start - t0, end - t0, speed))
            self.device_ns += device
            self.median_total_ns += median
            previous_end = end


def frame_start(frame: dict) -> int:
    """When the device started ``frame``, on the coordinator's clock."""
    starts = [
        rank["host_times"][1] - (rank.get("clock_offset_ns") or 0)
        for rank in frame["ranks"]
        if len(rank.get("host_times") or ()) == 4
    ]
    if starts:
        return min(starts)
    arrived = [rank.get("arrived_ns") or 0 for rank in frame["ranks"]]
    return max(frame["sent_ns"], max(arrived, default=0) - frame["device_ns"])


def _last_before(times: list[int], t: int) -> int:
    i = bisect.bisect_right(times, t)
    return times[i - 1] if i else 0


class _Series:
    """Values keyed by time: the nearest one, or the median past the recorded span."""

    def __init__(self, points: Sequence[tuple[int, int]]) -> None:
        ordered = sorted(points)
        self.times = [t for t, _ in ordered]
        self.values = [v for _, v in ordered]
        self.median = int(statistics.median(self.values)) if self.values else 0
        self.mean = int(statistics.fmean(self.values)) if self.values else 0

    def at(self, t: int) -> int:
        times = self.times
        if not times or t < times[0] or t > times[-1]:
            return self.median
        i = bisect.bisect_left(times, t)
        if i == len(times) or (i > 0 and t - times[i - 1] <= times[i] - t):
            i -= 1
        return self.values[i]


class MeanHost(HostModel):
    """``mean``: every quantity at its recorded mean; intervals stretched alike."""

    name = "mean"

    def __init__(self, measured: Measured) -> None:
        self.series = {name: _Series(getattr(measured, name)) for name in QUANTITIES}
        self.stretch = measured.device_ns / max(1, measured.median_total_ns)

    def admission_ns(self, t: int) -> int:
        return self.series["admission"].mean

    def plan_ns(self, t: int, command: bool = False) -> int:
        return self.series["command" if command else "plan"].mean

    def build_ns(self, t: int) -> int:
        return self.series["build"].mean

    def launch_ns(self, t: int) -> int:
        return self.series["launch"].mean

    def turnaround_ns(self, t: int) -> int:
        return self.series["turnaround"].mean

    def completion_ns(self, t: int) -> int:
        return self.series["completion"].mean

    def execute(self, start: int, nominal_ns: int) -> int:
        return start + round(nominal_ns * self.stretch)

    def solo_overhead_ns(self) -> int:
        return sum(self.series[name].mean for name in ("plan", "launch", "completion"))

    def figures(self) -> dict:
        out: dict = {"host_model": self.name, "stretch": round(self.stretch, 4)}
        for name, series in self.series.items():
            out[f"{name}_ms_mean"] = round(series.mean / 1e6, 3)
        return out


class TimelineHost(MeanHost):
    """``timeline``: the recorded quantities and device speed at the same moments."""

    name = "timeline"

    def __init__(self, measured: Measured) -> None:
        super().__init__(measured)
        spans = measured.spans
        # Piece k runs from edges[k] to edges[k + 1] at speeds[k]; the last piece,
        # after the last recorded frame, at speed 1.
        self.edges: list[float] = []
        self.speeds: list[float] = []
        for k, (start, _end, speed) in enumerate(spans):
            previous_end = spans[k - 1][1] if k else start
            self.edges.append(start if k == 0 else (previous_end + max(start, previous_end)) / 2)
            self.speeds.append(speed)
        if spans:
            self.edges.append(max(spans[-1][1], self.edges[-1]))
            self.speeds.append(1.0)

    def admission_ns(self, t: int) -> int:
        return self.series["admission"].at(t)

    def plan_ns(self, t: int, command: bool = False) -> int:
        return self.series["command" if command else "plan"].at(t)

    def build_ns(self, t: int) -> int:
        return self.series["build"].at(t)

    def launch_ns(self, t: int) -> int:
        return self.series["launch"].at(t)

    def turnaround_ns(self, t: int) -> int:
        return self.series["turnaround"].at(t)

    def completion_ns(self, t: int) -> int:
        return self.series["completion"].at(t)

    def execute(self, start: int, nominal_ns: int) -> int:
        """Integrate the recorded speed from ``start`` until ``nominal_ns`` of work is done."""
        edges, speeds = self.edges, self.speeds
        t, left = float(start), float(nominal_ns)
        i = bisect.bisect_right(edges, t) - 1
        while True:
            speed = speeds[i] if i >= 0 else 1.0
            limit = edges[i + 1] if i + 1 < len(edges) else float("inf")
            if (limit - t) * speed >= left:
                return max(start + 1, round(t + left / speed))
            left -= (limit - t) * speed
            t = limit
            i += 1

    def figures(self) -> dict:
        out = super().figures()
        out["host_model"] = self.name
        return out


def host_model(name: str, measured: Measured | None) -> HostModel:
    """The host model ``name`` (one of :data:`HOST_MODELS`) over ``measured``."""
    if name not in HOST_MODELS:
        raise ValueError(f"host model must be one of {list(HOST_MODELS)}, got {name!r}")
    if name == "none" or measured is None:
        return HostModel()
    return TimelineHost(measured) if name == "timeline" else MeanHost(measured)
