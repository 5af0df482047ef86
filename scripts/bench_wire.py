"""Wire cost of a frame and its completion (protocol version 2, columnar).

Times, per call, on this host's CPU: the best and median wall time of
``--repeat`` batches of ``--number`` calls (garbage collection off, as in
``timeit``), and the best thread CPU time of a batch, which other processes
sharing the cores inflate much less:

- the coordinator building a ``--lanes``-lane decode frame from a plan
  (``build_frame``: columns filled lane by lane, then validated), encoding it
  (``codec.encode``), and the receiving side decoding and validating it
  (``codec.decode``; also split into the msgpack unpack and ``Frame.from_wire``);
- the per-lane views (``Frame.lanes``), which the hot path never builds;
- a mixed frame (one 256-token prefill lane appending 16 pages, the rest decode)
  decoded and validated;
- rank 0's completion of the decode frame (one token per lane): built from
  columns, encoded, decoded and validated, and turned into scheduler records.

Prints a table, then, as its last line, one JSON object with every figure.

    python scripts/bench_wire.py [--lanes 64] [--repeat 25] [--number 400]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.engine.answers import completion_records
from runtime.coordinator.engine.frames import Live, build_frame, mark_pages_sent
from runtime.coordinator.engine.stream import RequestStream
from runtime.coordinator.plan import (
    LanePhase,
    LaneWork,
    ScheduledPlan,
    SelectionReason,
)
from runtime.coordinator.requests import RequestHandle
from runtime.transport.codec import decode, encode, unpack
from runtime.transport.completion import Completion
from runtime.transport.frame import Frame
from runtime.transport.sampling import SamplingParams

PROMPT_LEN = 300
PAGES_PER_REQUEST = 24
CHUNK = 256


def timed(fn: Callable[[], object], repeat: int, number: int) -> tuple[float, float, float]:
    """(best wall, median wall, best thread CPU) microseconds per call over the batches."""
    fn()  # warm caches
    walls, cpus = [], []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            cpu = time.thread_time_ns()
            start = time.perf_counter_ns()
            for _ in range(number):
                fn()
            walls.append((time.perf_counter_ns() - start) / number / 1000)
            cpus.append((time.thread_time_ns() - cpu) / number / 1000)
    finally:
        if enabled:
            gc.enable()
    return min(walls), statistics.median(walls), min(cpus)


def request(slot: int, sent: bool = True) -> Live:
    stream = RequestStream(
        None,  # type: ignore[arg-type]  # build_frame never reaches the engine
        slot,
        tuple(range(1000, 1000 + PROMPT_LEN)),
        64,
        SamplingParams(temperature=0.8, seed=slot),
        False,
    )
    live = Live(stream, RequestHandle(slot))
    first = slot * PAGES_PER_REQUEST
    live.reside(slot, 3, tuple(range(first, first + PAGES_PER_REQUEST)))
    if sent:
        mark_pages_sent([live])
    return live


def lane(slot: int, phase: LanePhase) -> LaneWork:
    if phase is LanePhase.PREFILL:
        return LaneWork(RequestHandle(slot), slot, 3, phase, 0, CHUNK, 0, 0, 1.0, 1.0, 1.0)
    return LaneWork(RequestHandle(slot), slot, 3, phase, 0, 0, 5, 1, 1.0, 1.0, 1.0)


def plan(graph: GraphDescriptor, lanes: tuple[LaneWork, ...]) -> ScheduledPlan:
    reason = SelectionReason.DISCOVERY
    return ScheduledPlan(1, graph, lanes, 2_000_000, reason, False, 0, 0, 1.0, 0.0, 1.0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=int, default=64, help="decode lanes (1..64)")
    parser.add_argument("--repeat", type=int, default=25)
    parser.add_argument("--number", type=int, default=400)
    args = parser.parse_args()
    n, repeat, number = args.lanes, args.repeat, args.number
    if not 1 <= n <= 64:
        parser.error("--lanes must lie in 1..64")

    decode_program = GraphDescriptor(GraphKind.DECODE, 64)
    lives = [request(slot) for slot in range(n)]
    decode_plan = plan(decode_program, tuple(lane(s, LanePhase.DECODE) for s in range(n)))
    frame = build_frame(decode_plan, 7, lives, set())
    data = encode(frame)
    body = unpack(data)["b"]
    assert decode(data) == frame and frame.num_lanes == n and not frame.pages

    mixed_program = GraphDescriptor(GraphKind.MIXED, 64, prompt_capacity=CHUNK)
    mixed_lives = [request(0, sent=False), *lives[1:]]
    mixed_lanes = (lane(0, LanePhase.PREFILL), *decode_plan.lanes[1:])
    mixed = build_frame(plan(mixed_program, mixed_lanes), 8, mixed_lives, set())
    mixed_data = encode(mixed)
    assert decode(mixed_data) == mixed and len(mixed.pages) == PAGES_PER_REQUEST

    tokens = list(range(2000, 2000 + n))

    def build_completion() -> Completion:
        return Completion(
            7,
            0,
            1,
            1_000_000,
            slot=array("q", range(n)),
            generation=array("q", [3] * n),
            token_count=array("q", [1] * n),
            tokens=array("q", tokens),
            finished=array("q", [0] * n),
        )

    completion = build_completion()
    completion_data = encode(completion)
    ignore_eos = (False,) * n
    assert decode(completion_data) == completion

    rows = [
        (
            "frame_build_us",
            "decode frame: build_frame from a plan",
            lambda: build_frame(decode_plan, 7, lives, set()),
        ),
        ("frame_encode_us", "decode frame: encode", lambda: encode(frame)),
        ("frame_decode_us", "decode frame: decode + validate", lambda: decode(data)),
        ("frame_unpack_us", "  of which msgpack unpack", lambda: unpack(data)),
        ("frame_from_wire_us", "  of which Frame.from_wire", lambda: Frame.from_wire(body)),
        ("frame_lanes_view_us", "decode frame: Frame.lanes views", lambda: frame.lanes),
        ("mixed_decode_us", "mixed frame: decode + validate", lambda: decode(mixed_data)),
        ("completion_build_us", "completion: build from columns", build_completion),
        ("completion_encode_us", "completion: encode", lambda: encode(completion)),
        ("completion_decode_us", "completion: decode + validate", lambda: decode(completion_data)),
        (
            "completion_records_us",
            "completion: scheduler records",
            lambda: completion_records(completion, ignore_eos),
        ),
    ]
    figures: dict[str, float | int] = {
        "lanes": n,
        "frame_bytes": len(data),
        "mixed_bytes": len(mixed_data),
        "completion_bytes": len(completion_data),
    }
    print(f"{n}-lane frames and completions, protocol version 2, us per call")
    print(f"{'':40} {'best':>9} {'median':>9} {'cpu':>9}")
    for key, label, fn in rows:
        best, median, cpu = timed(fn, repeat, number)
        figures[key] = round(best, 2)
        figures[key.replace("_us", "_median_us")] = round(median, 2)
        figures[key.replace("_us", "_cpu_us")] = round(cpu, 2)
        print(f"{label:40} {best:9.2f} {median:9.2f} {cpu:9.2f}")
    print(
        f"bytes: decode frame {len(data)}, mixed frame {len(mixed_data)}, "
        f"completion {len(completion_data)}"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
