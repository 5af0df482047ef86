"""The debugging flags of ``flare run`` (docs/debugging.md): the trace
(``--trace FILE [--trace-max-bytes N] [--trace-keep K]``, the live plan trace of
:mod:`runtime.trace.writer`, read back by ``flare trace``), ``--debug-endpoints``
(the ``/debug/*`` routes; a ring of recent trace lines is kept even without a
file), frame recordings for ``flare replay``, rank consistency checks, logs."""

from __future__ import annotations

import argparse
import os

from runtime.cli.converters import LOG_LEVELS, new_recording_dir, trace_bytes, trace_keep
from runtime.cli.flags.families import flag_group
from runtime.private_files import make_private_dirs
from runtime.trace.writer import DEFAULT_KEEP, DEFAULT_MAX_BYTES, TraceOptions

DEFAULT_PROFILE_DIR = "flare-profiles"  # with --debug-endpoints and no --profile-dir


def add_trace_flags(run: argparse.ArgumentParser) -> None:
    """``flare run``'s trace flags and ``--debug-endpoints``."""
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
        type=trace_bytes,
        default=DEFAULT_MAX_BYTES,
        help="rotate the trace file past this size (256M, 1G: binary units)",
    )
    run.add_argument(
        "--trace-keep",
        metavar="N",
        type=trace_keep,
        default=DEFAULT_KEEP,
        help="rotated trace files kept (FILE.1 .. FILE.N, oldest dropped)",
    )
    run.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="serve GET /debug/trace (behind --api-key when one is set); the "
        "coordinator keeps its recent trace lines in memory for it",
    )


def add_debug_flags(run: argparse.ArgumentParser) -> None:
    run = flag_group(run, "debugging")  # every flag below
    run.add_argument(
        "--check-ranks",
        action="store_true",
        help="every rank reports a CRC of its sampled tokens per frame; a rank that "
        "disagrees fails the server, naming the rank and the fence",
    )
    run.add_argument(
        "--record-frames",
        metavar="DIR",
        default=None,
        type=new_recording_dir,
        help="record every frame from start-up, with rank 0's answers, for `flare replay DIR` "
        "(DIR is created 0700, its files 0600: they hold prompts; default: off)",
    )
    run.add_argument(
        "--direct",
        action="store_true",
        help="schedule with the diagnostic direct-mode scheduler (runtime/direct): FCFS "
        "prefills, value-per-time decode rounds, no shared selection code; a fault that "
        "persists under it lies in the ranks (docs/debugging.md)",
    )
    run.add_argument(
        "--profile-dir",
        metavar="DIR",
        default=None,
        help="where POST /debug/profile?frames=N writes one torch.profiler trace per rank, "
        "DIR/profile-<n>/rank<r>.json (default with --debug-endpoints: ./flare-profiles)",
    )
    run.add_argument(
        "--debug-page-accounting",
        action="store_true",
        help="check the coordinator's KV page accounting (pages held, cached, free) after "
        "every completion and fail the server on a mismatch; slow, for debugging "
        "(default: off)",
    )
    run.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="the log level of every process: this one, the coordinator and the ranks "
        "(info adds start-up details: the KV pool, the catalog, the engine)",
    )
    run.add_argument(
        "--log-dir",
        metavar="DIR",
        default=None,
        help="also one log file per rank in DIR (0600; default: stderr only)",
    )


def debug_config(args: argparse.Namespace) -> dict[str, object]:
    """The DeploymentConfig fields of the debugging flags."""
    return {
        "check_ranks": bool(args.check_ranks),
        "direct": bool(args.direct),
        "profile_dir": args.profile_dir
        or (DEFAULT_PROFILE_DIR if getattr(args, "debug_endpoints", False) else None),
        "record_frames": args.record_frames,
        "log_level": args.log_level,
        "log_dir": args.log_dir,
        "debug_page_accounting": bool(getattr(args, "debug_page_accounting", False)),
    }


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
