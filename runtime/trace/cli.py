"""Tracing on the command line: ``flare run``'s trace flags and ``flare trace``.

``flare run --trace FILE [--trace-max-bytes N] [--trace-keep K]`` writes the
live plan trace (:mod:`runtime.trace.writer`); ``--debug-endpoints`` adds the
``/debug/*`` routes (and keeps a ring of recent trace lines even without a file).

``flare trace summary FILE [--json]`` and ``flare trace timeline FILE -o OUT
[--png PNG]`` read it back (:mod:`runtime.trace.summary`, :mod:`runtime.trace.timeline`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from runtime.private_files import make_private_dirs
from runtime.trace.writer import DEFAULT_KEEP, DEFAULT_MAX_BYTES, TraceOptions

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
MIN_TRACE_BYTES = 4096


def parse_bytes(text: str) -> int:
    """``268435456``, ``256M``, ``256MiB``, ``1G``: bytes (binary units), >= 4096."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = raw[-1:] if raw[-1:] in UNITS and raw[-1:] else ""
    number = raw[: len(raw) - len(unit)]
    try:
        value = int(float(number) * UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a size in bytes such as 268435456 or 256M, got {text!r}"
        ) from None
    if value < MIN_TRACE_BYTES:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_TRACE_BYTES} bytes, got {text!r}")
    return value


def _keep(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must lie in 0..100, got {value}")
    return value


def add_run_flags(run: argparse.ArgumentParser) -> None:
    """``flare run``'s tracing and debugging flags."""
    from runtime.cli_groups import flag_group

    run = flag_group(run, "debugging")  # every flag below
    run.add_argument(
        "--trace",
        metavar="FILE",
        help="write one JSON line per committed frame to FILE (mode 0600; missing "
        "directories are made 0700); read it with `flare trace` (default: no trace)",
    )
    run.add_argument(
        "--trace-max-bytes",
        metavar="BYTES",
        type=parse_bytes,
        default=DEFAULT_MAX_BYTES,
        help="rotate the trace file past this size (256M, 1G: binary units)",
    )
    run.add_argument(
        "--trace-keep",
        metavar="N",
        type=_keep,
        default=DEFAULT_KEEP,
        help="rotated trace files kept (FILE.1 .. FILE.N, oldest dropped)",
    )
    run.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="serve GET /debug/trace (behind --api-key when one is set); the "
        "coordinator keeps its recent trace lines in memory for it",
    )


def check_trace_path(path: str | None) -> str | None:
    """The trace file's absolute path, or ValueError naming the problem (before any start).

    Missing directories are created here, mode 0700, so a path that cannot
    be made fails now, naming the flag."""
    if path is None:
        return None
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise ValueError(f"--trace {path}: is a directory; give a file path")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"--trace {path}: not writable")
    parent = os.path.dirname(path)
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--trace {path}: {existing} is not a directory")
    try:
        make_private_dirs(parent)  # 0700, as the writer would at start-up
    except OSError as exc:
        raise ValueError(f"--trace {path}: cannot create {parent} ({exc.strerror})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--trace {path}: cannot create files in {parent}")
    return path


def trace_options(args: argparse.Namespace, debug: bool = False) -> TraceOptions | None:
    """What ``flare run``'s flags ask to trace (None: nothing).  ``debug``: the
    debug routes are served, so the ring is kept even without a file."""
    if args.trace is None and not debug:
        return None
    return TraceOptions(args.trace, max_bytes=args.trace_max_bytes, keep=args.trace_keep)


# ------------------------------------------------------------------ flare trace


def add_trace_command(sub, parser_class, formatter_class) -> None:
    """``flare trace summary`` and ``flare trace timeline`` under ``sub``."""
    trace = sub.add_parser(
        "trace",
        help="read a trace written by `flare run --trace FILE`",
        description="Read a trace written by `flare run --trace FILE` (rotated files "
        "FILE.1 .. FILE.K are read too, oldest first).",
    )
    commands = trace.add_subparsers(dest="trace_command", required=True, parser_class=parser_class)
    summary = commands.add_parser(
        "summary",
        help="per graph: count, estimate against observed p50/p99, per-rank figures, "
        "skew, the slowest rank",
        description="Per graph: frames, the scheduler's estimate against the observed cost "
        "p50/p99, each rank's interval p50/p99, the skew between ranks, the slowest rank.",
        formatter_class=formatter_class,
    )
    summary.add_argument("file", metavar="FILE")
    summary.add_argument("--json", action="store_true", help="print one JSON object instead")
    timeline = commands.add_parser(
        "timeline",
        help="Chrome trace / Perfetto JSON: one track per rank plus the coordinator",
        description="Write the trace as Chrome trace / Perfetto JSON (open it in "
        "ui.perfetto.dev): one track per rank plus the coordinator, one slice per frame.",
        formatter_class=formatter_class,
    )
    timeline.add_argument("file", metavar="FILE")
    timeline.add_argument("-o", "--output", metavar="OUT", required=True, help="JSON to write")
    timeline.add_argument(
        "--png", metavar="PNG", help="also draw it to PNG with matplotlib (default: no PNG)"
    )


def cmd_trace(args: argparse.Namespace) -> int:
    from runtime.trace.files import TraceFileError, read_trace

    try:
        trace = read_trace(args.file)
    except TraceFileError as exc:
        print(f"flare trace: {exc}", file=sys.stderr)
        return 1
    if args.trace_command == "summary":
        from runtime.trace.summary import render, summarize

        summary = summarize(trace, args.file)
        print(json.dumps(summary) if args.json else render(summary))
        return 0
    from runtime.trace.timeline import TimelineError, timeline, write_json, write_png

    data = timeline(trace)
    try:
        write_json(data, args.output)
        if args.png:
            write_png(data, args.png)
    except (OSError, TimelineError) as exc:
        print(f"flare trace timeline: {exc}", file=sys.stderr)
        return 1
    slices = sum(1 for e in data["traceEvents"] if e["ph"] == "X")
    wrote = f"{args.output}" + (f" and {args.png}" if args.png else "")
    print(
        f"wrote {wrote}: {len(trace.frames)} frames, {slices} slices on "
        f"{trace.world_size + 1} tracks (coordinator, {trace.world_size} ranks)"
    )
    return 0
