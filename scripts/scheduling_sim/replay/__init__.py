"""What-if replay: a recorded deployment's traffic, on its own measured costs, under any scheduler.

``python -m scripts.scheduling_sim --from-trace FILE [--scheduler X] [--policy P]
[--host-model timeline|mean|none]`` reads a ``flare run --trace`` file (format 2;
rotated files too), rebuilds its requests (:mod:`.recorded`), prices every
graph at the median of its recorded device intervals and the graphs it never
ran from their measured neighbours (:mod:`.costs`), charges the host the
deployment ran on (:mod:`.host`), runs the traffic under the scheduler
(:mod:`.simulation`) and reports the suite's figures for the replay beside
the recorded run's own (:mod:`.report`).  docs/replay.md says what it
reproduces and why.

Not the frame replay of ``flare replay`` (runtime/replay.py), which reruns
recorded frames on real ranks.
"""

from __future__ import annotations

from scripts.scheduling_sim.metrics import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
from scripts.scheduling_sim.replay.costs import CostError, MeasuredCosts, frame_descriptor
from scripts.scheduling_sim.replay.host import HOST_MODELS, Measured, host_model
from scripts.scheduling_sim.replay.recorded import Recording, RecordingError, read_recording
from scripts.scheduling_sim.replay.report import (
    figures,
    ratios,
    recorded_run,
    render,
    solo_function,
)
from scripts.scheduling_sim.replay.simulation import (
    ReplaySimulation,
    make_replay_scheduler,
    policy_for,
    traffic,
)

MAX_REPLAY_S = 3600.0  # simulated time limit of one replay


def replay(
    recording: Recording | str,
    scheduler: str = "flare",
    policy: str | None = None,
    host: str = "timeline",
    *,
    seed: int = 0,
    ttft_slo_ms: float = DEFAULT_TTFT_SLO_MS,
    tpot_slo_ms: float = DEFAULT_TPOT_SLO_MS,
) -> dict:
    """Replay ``recording`` (or the trace file it names); the report as one JSON object.

    ``policy``: a preset name, or None for the recorded policy.  Raises
    RecordingError (or runtime.trace.files.TraceFileError) when the trace
    cannot be replayed, CostError when it has no measured frame.
    """
    if isinstance(recording, str):
        recording = read_recording(recording)
    costs = MeasuredCosts(recording.frames)
    cancels = [line["at_ns"] for line in recording.trace.finishes if line.get("cancelled")]
    measured = Measured(recording.frames, recording.trace.requests, recording.t0_ns,
                        costs.median_ns, cancels)  # fmt: skip
    model = host_model(host, measured)
    if scheduler == "flare":
        policy_config, policy_label = policy_for(recording, policy)
    else:  # a baseline has no policy
        policy_config, policy_label = None, "n/a (baseline)"
    chosen = make_replay_scheduler(scheduler, recording, policy_config)
    requests = traffic(recording, model, cancellable=hasattr(chosen, "cancel"))
    sim = ReplaySimulation(chosen, costs, requests, model, recording.catalog, seed=seed)
    sim.run(until_ns=int(MAX_REPLAY_S * 1e9))
    ran = set(sim.graphs_run)
    solo = solo_function(recording.catalog, costs, model.solo_overhead_ns())
    recorded = figures(recorded_run(recording), solo, ttft_slo_ms, tpot_slo_ms)
    replayed = figures(sim, solo, ttft_slo_ms, tpot_slo_ms)
    priced = [dict(p.to_json(), ran=d in ran) for d, p in costs.priced.items()]
    measured_costs = sorted(costs.measured.items(), key=_order)
    return {
        "trace": recording.path,
        "scheduler": scheduler,
        "policy": policy_label,
        "host": model.figures(),
        "requests": len(recording.requests),
        "not_replayed": {str(k): why for k, why in sorted(recording.skipped.items())},
        "recorded": recorded,
        "replayed": replayed,
        "ratio": ratios(recorded, replayed),
        "first_divergent_frame": first_divergence(recording, sim.sequence),
        "measured_costs_ms": {d.describe(): round(ns / 1e6, 4) for d, ns in measured_costs},
        "measured_samples": {d.describe(): costs.samples[d] for d, _ in measured_costs},
        "priced_by_neighbour": priced,
    }


def first_divergence(recording: Recording, sequence: list[str]) -> int | None:
    """The index of the first frame whose graph differs between the recorded run and
    the replay (None: the same graphs in the same order)."""
    recorded = [frame_descriptor(f).describe() for f in recording.frames]
    for i, (a, b) in enumerate(zip(recorded, sequence)):
        if a != b:
            return i
    return None if len(recorded) == len(sequence) else min(len(recorded), len(sequence))


def _order(item) -> tuple:
    d = item[0]
    return (d.kind.value, d.batch_capacity, d.prompt_capacity, d.token_capacity, d.describe())


__all__ = [
    "HOST_MODELS",
    "CostError",
    "MeasuredCosts",
    "Recording",
    "RecordingError",
    "read_recording",
    "render",
    "replay",
]
