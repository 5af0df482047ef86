"""Benchmark: the runtime end to end on the embedded default model.

Usage: ``python scripts/bench_runtime.py [--tp 1,2] [--concurrency 1,8,32]
[--prompt-tokens 32] [--output-tokens 32] [--device auto]``

For each tensor-parallel size it starts the coordinator and the rank processes
(``LocalDeployment``), then for each concurrency submits that many requests at
once and reports:

* output tokens/s from the first submission to the last token;
* the host overhead ratio: wall time per frame at the coordinator over the
  ranks' program time, i.e. the span from the first dispatch to the last
  completion over the summed maximum rank device intervals (1.0 is the limit:
  the ranks never wait for the host);
* the isolated overhead ratio: the same for frames dispatched into an empty
  window only (prefills, the first decode), which cannot hide host time behind
  a queued frame;
* the frame round trip with an empty program: the median of
  ``Engine.measure_round_trip`` (an empty frame through the coordinator, the
  transport, every rank's loop and back), measured with no load;
* the loaded round trip: median host wall minus device interval of the
  isolated frames (what the host adds to a real frame).

With ``--trace-cost`` it then measures what the live plan trace
(``flare run --trace FILE``) costs, on the same deployment with a trace file:

* the added host microseconds per frame: on the engine thread (the trace's
  hooks: noting arrivals, handing the applied frame to the writer's queue),
  and on the writer thread (rendering, JSON, the file), which runs beside the
  engine loop rather than in it; both timed around the calls (wall and thread
  CPU time), less the timer's own cost measured around an empty function;
* output tokens/s with the trace attached and detached, ``--trace-runs``
  interleaved runs each (on, off, on, off, ...) at ``--trace-concurrency``,
  and the median of each: single runs move 10-20% on a shared machine.

With ``--transport-cost`` it measures what CURVE (authenticated, encrypted
frames, runtime/transport/security.py) costs per frame: two deployments over
TCP loopback at TP ``--transport-tp``, one with keys made for the run and one
with ``insecure_transport``, alive at once; ``--transport-rounds`` interleaved
rounds of ``--probes`` empty-frame round trips each (CURVE, plain, CURVE, ...),
and the median over all of each: ``round_trip_us_curve``,
``round_trip_us_plain`` and their difference ``curve_overhead_us`` (an empty
frame's messages are small; encryption adds about a nanosecond per byte on
top for large ones).

Then it runs transformers' ``generate`` on the same checkpoint, one request at a
time and batched at each concurrency above 1, for comparison.  The last line
is one JSON object with every figure printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from runtime.ranks.model import default_model_dir
from runtime.trace.writer import TraceOptions


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j + 1) % (vocab - 3) for j in range(length)] for i in range(n)]


def frame_figures(frames) -> dict:
    out = {"frames": len(frames)}
    if not frames:
        return out
    span = max(f.completed_ns for f in frames) - min(f.sent_ns for f in frames)
    out["host_overhead_ratio"] = span / max(1, sum(f.device_ns for f in frames))
    alone = [f for f in frames if not f.queued]
    if alone:
        out["isolated_overhead_ratio"] = statistics.fmean(f.host_wall_ns for f in alone) / max(
            1.0, statistics.fmean(f.device_ns for f in alone)
        )
        out["loaded_round_trip_us"] = statistics.median(
            (f.host_wall_ns - f.device_ns) / 1e3 for f in alone
        )
    return out


def deployment_config(tp: int, args: argparse.Namespace) -> DeploymentConfig:
    return DeploymentConfig(
        tensor_parallel_size=tp,
        max_concurrency=max(args.concurrency),
        max_prefill_tokens=args.max_prefill_tokens or max(64, -(-args.prompt_tokens // 64) * 64),
        packed_prefill=not args.no_packed_prefill,
        num_pages=max(256, max(args.concurrency) * 16),
        device=args.device,
        poll_spin_us=args.poll_spin_us,
    )


def run_engine(tp: int, args: argparse.Namespace, vocab: int) -> dict:
    config = deployment_config(tp, args)
    results = {}
    with LocalDeployment(config) as deployment:
        engine = deployment.engine
        # Warm-up: every program measured once before timing.
        for s in [
            engine.submit(p, 4, ignore_eos=True) for p in prompts(8, args.prompt_tokens, vocab)
        ]:
            s.result(timeout=600)
        engine.measure_round_trip(50)  # warm-up
        trips = engine.measure_round_trip(args.probes)
        results["empty"] = {
            "round_trip_us": statistics.median(trips) / 1e3,
            "round_trip_p90_us": sorted(trips)[int(0.9 * (len(trips) - 1))] / 1e3,
        }
        print(
            f"TP={tp} empty-frame round trip: median {results['empty']['round_trip_us']:.0f} us, "
            f"p90 {results['empty']['round_trip_p90_us']:.0f} us over {len(trips)} frames "
            f"(spin {config.spin_us} us)"
        )
        for c in args.concurrency:
            before = len(engine.stats.frames())
            start = time.perf_counter()
            streams = [
                engine.submit(p, args.output_tokens, ignore_eos=True)
                for p in prompts(c, args.prompt_tokens, vocab)
            ]
            generated = sum(len(s.result(timeout=600).token_ids) for s in streams)
            seconds = time.perf_counter() - start
            figures = frame_figures(engine.stats.frames()[before:])
            figures["tokens_per_s"] = generated / seconds
            results[c] = figures
            print(
                f"TP={tp} concurrency {c:>3}: {figures['tokens_per_s']:8.1f} tok/s, "
                f"overhead ratio {figures.get('host_overhead_ratio', float('nan')):.3f} "
                f"(isolated frames {figures.get('isolated_overhead_ratio', float('nan')):.3f}), "
                f"loaded round trip {figures.get('loaded_round_trip_us', float('nan')):.0f} us, "
                f"{figures['frames']} frames"
            )
    return results


def socket_round_trips(curve: bool, count: int, size: int = 256) -> list[int]:
    """Ping-pong of ``size``-byte messages between two sockets of this process over
    TCP loopback, with CURVE (keys and ZAP gate as the runtime sets them) or not:
    the transport's own cost, without the ranks' and the engine's noise."""
    import zmq

    from runtime.transport.gatekeeper import Gatekeeper
    from runtime.transport.security import per_run_keys, secure_client, secure_server

    context = zmq.Context()
    keys = per_run_keys()
    gate = Gatekeeper(context, keys.server) if curve else None
    server, client = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        if curve:
            secure_server(server, keys.server)
            secure_client(client, keys.clients[0])
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
        payload = b"x" * size
        trips = []
        for i in range(count + 50):  # the first 50: the handshake and warm-up
            start = time.perf_counter_ns()
            client.send(payload)
            server.send(server.recv())
            client.recv()
            if i >= 50:
                trips.append(time.perf_counter_ns() - start)
        return trips
    finally:
        server.close(linger=0)
        client.close(linger=0)
        if gate is not None:
            gate.close()
        context.term()


def transport_cost(args: argparse.Namespace, vocab: int) -> dict:
    """Empty-frame round trips over TCP loopback with CURVE and without, interleaved."""
    import dataclasses

    base = dataclasses.replace(deployment_config(args.transport_tp, args), transport="tcp")
    curve = LocalDeployment(base)
    plain = LocalDeployment(dataclasses.replace(base, insecure_transport=True))
    trips: dict[str, list[int]] = {"curve": [], "plain": []}
    with curve, plain:
        assert curve.engine.rank_keys() is not None and plain.engine.rank_keys() is None
        for deployment in (curve, plain):  # warm-up: programs measured, sockets busy
            engine = deployment.engine
            engine.submit(prompts(1, args.prompt_tokens, vocab)[0], 4, ignore_eos=True).result(
                timeout=600
            )
            engine.measure_round_trip(50)
        for _ in range(args.transport_rounds):
            trips["curve"] += curve.engine.measure_round_trip(args.probes)
            trips["plain"] += plain.engine.measure_round_trip(args.probes)
    out = {f"round_trip_us_{k}": statistics.median(v) / 1e3 for k, v in trips.items()}
    for k, v in trips.items():
        out[f"round_trip_p90_us_{k}"] = sorted(v)[int(0.9 * (len(v) - 1))] / 1e3
    out["curve_overhead_us"] = out["round_trip_us_curve"] - out["round_trip_us_plain"]
    sockets: dict[str, list[int]] = {"curve": [], "plain": []}
    for _ in range(args.transport_rounds):
        for name in ("curve", "plain"):
            sockets[name] += socket_round_trips(name == "curve", 2000)
    for k, v in sockets.items():
        out[f"socket_round_trip_us_{k}"] = statistics.median(v) / 1e3
    out["curve_socket_overhead_us"] = (
        out["socket_round_trip_us_curve"] - out["socket_round_trip_us_plain"]
    )
    print(
        f"TP={args.transport_tp} empty-frame round trip over TCP loopback "
        f"({len(trips['curve'])} frames each, {args.transport_rounds} interleaved rounds):"
    )
    print(f"  {'transport':<10} {'median us':>10} {'p90 us':>10}")
    for name, key in (("CURVE", "curve"), ("plain", "plain")):
        median, p90 = out[f"round_trip_us_{key}"], out[f"round_trip_p90_us_{key}"]
        print(f"  {name:<10} {median:>10.1f} {p90:>10.1f}")
    print(f"  CURVE adds {out['curve_overhead_us']:.1f} us per frame round trip")
    print(
        f"  sockets alone (256-byte ping-pong in one process): CURVE "
        f"{out['socket_round_trip_us_curve']:.1f} us, plain "
        f"{out['socket_round_trip_us_plain']:.1f} us, "
        f"+{out['curve_socket_overhead_us']:.1f} us per round trip (two messages)"
    )
    return out


class Timed:
    """Wraps a callable, summing the wall and the calling thread's CPU nanoseconds in it."""

    def __init__(self, fn) -> None:
        self.fn, self.ns, self.cpu_ns, self.calls = fn, 0, 0, 0

    def __call__(self, *args):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return self.fn(*args)
        finally:
            self.cpu_ns += time.thread_time_ns() - c0
            self.ns += time.perf_counter_ns() - t0
            self.calls += 1

    @staticmethod
    def overhead(calls: int = 20000) -> tuple[float, float]:
        """The wrapper's own wall and CPU ns per call (timed around an empty function)."""
        empty = Timed(lambda *args: None)
        for _ in range(calls):
            empty(0)
        return empty.ns / calls, empty.cpu_ns / calls

    def net(self, overhead: tuple[float, float]) -> tuple[float, float]:
        """Wall and CPU ns spent in the function, less the wrapper's overhead."""
        return (max(0.0, self.ns - overhead[0] * self.calls),
                max(0.0, self.cpu_ns - overhead[1] * self.calls))  # fmt: skip


def trace_cost(tp: int, args: argparse.Namespace, vocab: int) -> dict:
    """Tracing's host cost per frame, and tokens/s with the trace attached and detached."""
    tmp = tempfile.mkdtemp(prefix="flare-bench-trace-")
    deployment = LocalDeployment(deployment_config(tp, args))
    deployment.engine.enable_trace(TraceOptions(str(Path(tmp) / "trace.jsonl")))
    c = args.trace_concurrency
    try:
        deployment.start()
        engine = deployment.engine
        trace = engine.trace
        assert trace is not None
        # Timers around the engine thread's hooks and the writer thread's batches.
        arrived, applied = Timed(trace.arrived), Timed(trace.applied)
        trace.arrived, trace.applied = arrived, applied
        writer = trace.writer
        drain = Timed(writer._drain)
        writer._drain = drain
        for s in [
            engine.submit(p, 4, ignore_eos=True) for p in prompts(8, args.prompt_tokens, vocab)
        ]:
            s.result(timeout=600)  # warm-up: every program measured once

        def one_run() -> tuple[float, int]:
            before = engine.stats.frames_completed
            start = time.perf_counter()
            streams = [engine.submit(p, args.output_tokens, ignore_eos=True)
                       for p in prompts(c, args.prompt_tokens, vocab)]  # fmt: skip
            generated = sum(len(s.result(timeout=600).token_ids) for s in streams)
            return generated / (time.perf_counter() - start), engine.stats.frames_completed - before

        rates: dict[str, list[float]] = {"on": [], "off": []}
        traced_frames = 0
        for _ in range(args.trace_runs):
            for mode in ("on", "off"):
                engine.trace = trace if mode == "on" else None  # idle engine: a plain swap
                rate, frames = one_run()
                rates[mode].append(rate)
                if mode == "on":
                    traced_frames += frames
        engine.trace = trace
        writer.flush()
        on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
        per_frame, per_line = max(1, applied.calls), max(1, writer.written)
        overhead = Timed.overhead()
        (arrived_ns, arrived_cpu), (applied_ns, applied_cpu) = (
            arrived.net(overhead),
            applied.net(overhead),
        )
        drain_ns, drain_cpu = drain.net(overhead)
        out = {
            "trace_engine_us_per_frame": (arrived_ns + applied_ns) / 1e3 / per_frame,
            "trace_engine_cpu_us_per_frame": (arrived_cpu + applied_cpu) / 1e3 / per_frame,
            "trace_writer_cpu_us_per_frame": drain_cpu / 1e3 / per_line,
            "trace_writer_us_per_frame": drain_ns / 1e3 / per_line,
            "trace_timer_overhead_us_per_call": overhead[0] / 1e3,
            "trace_on_tokens_per_s": on,
            "trace_off_tokens_per_s": off,
            "trace_slowdown_pct": 100 * (off - on) / off,
            "trace_on_runs": len(rates["on"]),
            "trace_frames": traced_frames,
            "trace_dropped": writer.dropped,
        }
        spread = {m: f"{min(r):.0f}..{max(r):.0f}" for m, r in rates.items()}
        rows = [
            ("engine thread (hooks), wall us/frame", f"{out['trace_engine_us_per_frame']:.1f}"),
            ("engine thread (hooks), CPU us/frame", f"{out['trace_engine_cpu_us_per_frame']:.1f}"),
            ("writer thread, CPU us/frame", f"{out['trace_writer_cpu_us_per_frame']:.1f}"),
            ("writer thread, wall us/frame", f"{out['trace_writer_us_per_frame']:.1f}"),
            ("(timer overhead subtracted, wall us/call)", f"{overhead[0] / 1e3:.2f}"),
            (f"tok/s traced, median of {len(rates['on'])} ({spread['on']})", f"{on:.1f}"),
            (f"tok/s untraced, median of {len(rates['off'])} ({spread['off']})", f"{off:.1f}"),
            ("slowdown, % of untraced", f"{out['trace_slowdown_pct']:+.2f}"),
            ("frames traced in the timed runs, dropped", f"{traced_frames}, {writer.dropped}"),
        ]
        width = max(len(name) for name, _ in rows)
        print(f"TP={tp} trace cost (concurrency {c}, interleaved on/off runs):")
        for name, value in rows:
            print(f"  {name:<{width}}  {value:>10}")
        return out
    finally:
        deployment.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def run_transformers(args: argparse.Namespace, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    out = {}
    one = prompts(1, args.prompt_tokens, vocab)[0]
    ids = torch.tensor([one])
    kwargs = dict(do_sample=False, max_new_tokens=args.output_tokens,
                  min_new_tokens=args.output_tokens, pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)  # warm-up
        start = time.perf_counter()
        runs = 4
        for _ in range(runs):
            model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        out["one_at_a_time_tokens_per_s"] = (
            runs * args.output_tokens / (time.perf_counter() - start)
        )
        for c in (c for c in args.concurrency if c > 1):
            batch = torch.tensor(prompts(c, args.prompt_tokens, vocab))
            mask = torch.ones_like(batch)
            model.generate(batch, attention_mask=mask, **kwargs)  # warm-up at this size
            start = time.perf_counter()
            model.generate(batch, attention_mask=mask, **kwargs)
            seconds = time.perf_counter() - start
            out[f"batched_{c}_tokens_per_s"] = c * args.output_tokens / seconds
    batched = ", ".join(
        f"{out[k]:.1f} tok/s batched ({k.split('_')[1]})" for k in out if k.startswith("batched")
    )
    print(
        f"transformers generate: {out['one_at_a_time_tokens_per_s']:.1f} tok/s one at a time, "
        f"{batched} (torch threads: {torch.get_num_threads()})"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=_ints, default=(1, 2))
    p.add_argument("--concurrency", type=_ints, default=(1, 8, 32))
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--max-prefill-tokens", type=int, default=0,
        help="the largest prompt capacity (0: the prompt length rounded up to 64); packed "
        "prefill programs of B rows need C >= 64 B",
    )  # fmt: skip
    p.add_argument("--no-packed-prefill", action="store_true", help="no packed prefill programs")
    p.add_argument("--probes", type=int, default=500, help="empty frames to time")
    p.add_argument(
        "--poll-spin-us", type=int, default=None, help="busy-poll budget (default: automatic)"
    )
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--trace-cost", action="store_true", help="also measure the live plan trace's cost"
    )
    p.add_argument("--trace-runs", type=int, default=5, help="runs each, traced and untraced")
    p.add_argument("--trace-concurrency", type=int, default=8, help="requests per trace run")
    p.add_argument(
        "--skip-frames", action="store_true", help="skip the round-trip and concurrency figures"
    )
    p.add_argument(
        "--transport-cost",
        action="store_true",
        help="also measure the per-frame cost of CURVE over TCP loopback",
    )
    p.add_argument("--transport-tp", type=int, default=1, help="TP of the transport runs")
    p.add_argument("--transport-rounds", type=int, default=5, help="interleaved rounds each")
    args = p.parse_args(argv)
    from runtime.ranks.model.config import ModelConfig

    vocab = ModelConfig.from_dir(default_model_dir()).vocab_size
    result: dict = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    for tp in args.tp:
        if not args.skip_frames:
            for c, figures in run_engine(tp, args, vocab).items():
                label = "empty" if c == "empty" else f"c{c}"
                for key, value in figures.items():
                    result[f"tp{tp}_{label}_{key}"] = round(value, 3)
        if args.trace_cost:
            for key, value in trace_cost(tp, args, vocab).items():
                result[f"tp{tp}_{key}"] = round(value, 3)
    if args.transport_cost:
        for key, value in transport_cost(args, vocab).items():
            result[key] = round(value, 3)
    if not args.skip_transformers:
        for key, value in run_transformers(args, vocab).items():
            result[f"transformers_{key}"] = round(value, 1)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
