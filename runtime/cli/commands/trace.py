"""``flare trace``: read a trace written by ``flare run --trace FILE`` (the trace
flags are flags/debugging.py's).

``flare trace summary FILE [--json]`` and ``flare trace timeline FILE -o OUT
[--png PNG]`` read it back (:mod:`runtime.trace.summary`, :mod:`runtime.trace.timeline`).
"""

from __future__ import annotations

import argparse
import json
import sys


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
