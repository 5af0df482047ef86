"""Replay a frame recording on rank processes, without a coordinator or scheduler.

``flare replay DIR [--tensor-parallel-size N] [--rank R]`` starts the recorded
deployment's ranks (the recorded rank arguments, at the recorded or another
tensor-parallel size), publishes the recorded frames one at a time, waits for
every rank's completion, prints each frame's intervals and tokens, and compares
rank 0's results with the recorded ones.  The first difference is reported
with its fence and lane.  At another tensor-parallel size the reductions run in
another order, so a difference is reported as a numeric divergence, not an
error.  ``--rank R`` prints rank R's interval (every rank of the group still
runs: a tensor-parallel shard cannot run alone).  When the recording ran with
``--check-ranks``, every rank reports a CRC of its sampled tokens, and the
first frame where a rank's differs from rank 0's is reported too (the ranks
disagree: a failure at any tensor-parallel size).  The ranks inherit the
environment, so a fault tied to one (a rank's ``FLARE_DEBUG_*`` drill, a
device's ``CUDA_VISIBLE_DEVICES``) is replayed with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.deploy.launch import spawn_ranks, stop_ranks
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.completion import Completion
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.recording import model_digest, read_recording


class ReplayError(RuntimeError):
    """The replay could not run (ranks, model or catalog differ, a rank failed)."""


@dataclass
class ReplayReport:
    frames: int = 0
    recorded_world: int = 1
    world: int = 1
    divergence: str | None = None  # the first difference, described
    disagreement: str | None = None  # the first frame where the ranks' token CRCs differ
    intervals_ns: list[tuple[int, ...]] = field(default_factory=list)  # per frame, per rank

    @property
    def numeric(self) -> bool:
        """A difference at another tensor-parallel size: numerics, not a failure."""
        return self.divergence is not None and self.world != self.recorded_world

    @property
    def ok(self) -> bool:
        return (self.divergence is None or self.numeric) and self.disagreement is None


def _results(c: Completion) -> tuple:
    return tuple(c.slot), tuple(c.token_count), tuple(c.tokens), tuple(c.finished)


def _difference(fence: int, recorded: Completion, got: Completion) -> str | None:
    if _results(recorded) == _results(got):
        return None
    want, have = recorded.lane_results(), got.lane_results()
    for i, (a, b) in enumerate(zip(want, have)):
        if a != b:
            return (
                f"fence {fence}: lane {i} (slot {a.slot}): recorded tokens {list(a.tokens)} "
                f"({a.finish_reason}), replayed {list(b.tokens)} ({b.finish_reason})"
            )
    return f"fence {fence}: {len(want)} lanes recorded, {len(have)} replayed"


def replay(
    directory: str,
    *,
    tensor_parallel_size: int | None = None,
    rank: int | None = None,
    timeout_s: float = 120.0,
    out: Callable[[str], None] = print,
) -> ReplayReport:
    recording = read_recording(directory)
    meta = recording.meta
    recorded_world = int(meta["tensor_parallel_size"])
    world = tensor_parallel_size or recorded_world
    if rank is not None and not 0 <= rank < world:
        raise ReplayError(f"--rank {rank}: the replay has ranks 0..{world - 1}")
    if model_digest(meta["model"]) != meta["model_digest"]:
        raise ReplayError(f"model {meta['model']}: its files changed since the recording")
    report = ReplayReport(recorded_world=recorded_world, world=world)
    shown = 0 if rank is None else rank
    channel = CoordinatorChannel(world)
    procs = spawn_ranks(channel.endpoints, world, list(meta["rank_args"]))
    try:
        channel.handshake(timeout_s=timeout_s)
        reports = _collect(channel, CatalogReport, world, timeout_s, None)
        if recording.report is not None and set(reports[0].descriptors) != set(
            recording.report.descriptors
        ):
            raise ReplayError("the ranks prepared another catalog than the recorded one")
        out(f"{'fence':>7} {'program':<28} {'lanes':>5} {f'rank {shown} us':>12}  tokens")
        for frame in recording.frames:
            channel.publish(frame)
            answers = _collect(channel, Completion, world, timeout_s, frame.fence)
            failed = [a for a in answers if a.error]
            if failed:
                raise ReplayError(f"fence {frame.fence}: rank {failed[0].rank}: {failed[0].error}")
            report.frames += 1
            report.intervals_ns.append(tuple(a.device_ns for a in answers))
            got = answers[0]
            out(f"{frame.fence:>7} {frame.program.describe():<28} {frame.num_lanes:>5} "
                f"{answers[shown].device_ns / 1e3:>12.1f}  {list(got.tokens)}")  # fmt: skip
            recorded = recording.completions.get(frame.fence)
            if recorded is not None and report.divergence is None:
                report.divergence = _difference(frame.fence, recorded, got)
            if report.disagreement is None:
                report.disagreement = _disagreement(frame.fence, answers)
        channel.shutdown_ranks()
        stop_ranks(procs, timeout_s=30)
    finally:
        stop_ranks(procs, timeout_s=0)
        channel.close()
    if report.disagreement is not None:
        out(f"ranks disagree: {report.disagreement}")
    if report.divergence is None:
        out(f"replayed {report.frames} frames: rank 0's results equal the recording")
    elif report.numeric:
        out(f"numeric divergence at TP={world} (recorded at TP={recorded_world}), first at "
            f"{report.divergence}")  # fmt: skip
    else:
        out(f"first divergence: {report.divergence}")
    return report


def _disagreement(fence: int, answers: list[Completion]) -> str | None:
    """The first rank whose token CRC differs from rank 0's (ranks run with --check-ranks)."""
    reference = answers[0].token_crc
    if reference < 0:
        return None
    for answer in answers[1:]:
        if answer.token_crc != reference:
            return (
                f"fence {fence}: rank {answer.rank} sampled different tokens than rank 0 "
                f"(token CRC {answer.token_crc:#010x} against {reference:#010x})"
            )
    return None


def _collect(channel, kind, world: int, timeout_s: float, fence: int | None) -> list:
    got: dict[int, object] = {}
    while len(got) < world:
        message = channel.recv(timeout_ms=int(timeout_s * 1000))
        if message is None:
            raise ReplayError(
                f"no {kind.__name__} from ranks {sorted(set(range(world)) - set(got))}"
            )
        if isinstance(message, kind) and (fence is None or message.fence == fence):
            got[message.rank] = message
    return [got[r] for r in range(world)]
