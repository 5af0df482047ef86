"""The rank-level debugging flags of ``flare run`` and the ``flare replay`` and
``flare ranks status`` commands (kept beside runtime/cli.py, which only wires them)."""

from __future__ import annotations

import argparse
import json
import os

from runtime.cli_groups import flag_group
from runtime.replay import ReplayError, replay
from runtime.transport.recording import recording_exists

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_PROFILE_DIR = "flare-profiles"  # with --debug-endpoints and no --profile-dir


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
        type=_new_recording_dir,
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


def _new_recording_dir(text: str) -> str:
    """``--record-frames``: a directory that holds no recording yet."""
    problem = recording_exists(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


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


def add_replay_command(sub, parser_class, formatter_class) -> None:
    replay_parser = sub.add_parser(
        "replay",
        help="replay a frame recording on rank processes, without a coordinator",
        description="Replay the frames `flare run --record-frames DIR` recorded, on the "
        "recorded ranks (or another tensor-parallel size), printing each frame's interval "
        "and tokens and the first divergence from the recording.",
        formatter_class=formatter_class,
    )
    replay_parser.add_argument("directory", metavar="DIR")
    replay_parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=None,
        help="replay at this TP size (a difference is then a numeric divergence)",
    )  # fmt: skip
    replay_parser.add_argument(
        "--rank", type=int, default=None, help="print this rank's intervals (default 0)"
    )


def cmd_replay(args: argparse.Namespace) -> int:
    """0: equal (or only numeric divergence at another TP size); 1: diverged; 2: failed."""
    try:
        report = replay(args.directory, tensor_parallel_size=args.tensor_parallel_size,
                        rank=args.rank)  # fmt: skip
    except (ReplayError, ValueError, OSError) as exc:
        print(f"flare replay: {exc}")
        return 2
    return 0 if report.ok else 1


def add_ranks_command(sub, parser_class, formatter_class) -> None:
    ranks_parser = sub.add_parser(
        "ranks",
        help="ask a running server's ranks what they hold (needs --debug-endpoints)",
        description="Print every rank's state from GET /debug/ranks of a server started "
        "with `flare run --debug-endpoints`: slots in use, programs, frames, memory.",
        formatter_class=formatter_class,
    )
    ranks_sub = ranks_parser.add_subparsers(dest="ranks_command", required=True)
    status = ranks_sub.add_parser(
        "status", help="one table per rank", formatter_class=formatter_class
    )
    status.add_argument("--url", default="http://127.0.0.1:8000", help="the server's address")
    status.add_argument(
        "--api-key", default=os.environ.get("FLARE_API_KEY"),
        help="the server's API key (default: $FLARE_API_KEY)",
    )  # fmt: skip
    status.add_argument("--json", action="store_true", help="print the answer as it came")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def format_ranks(ranks: list[dict]) -> str:
    """``GET /debug/ranks``'s answer as one table per rank."""
    lines = []
    for r in ranks:
        memory = f"RSS {_mib(r['rss_bytes'])}, KV cache {_mib(r['kv_cache_bytes'])}"
        if r["device"] != "cpu":
            memory += (
                f", device {_mib(r['device_allocated_bytes'])} allocated / "
                f"{_mib(r['device_reserved_bytes'])} reserved"
            )
        programs = r["programs"]
        captured = sum(p["captured"] for p in programs)
        lines.append(
            f"rank {r['rank']}/{r['world_size']} on {r['device']}: {r['frames']} frames, "
            f"last fence {r['last_fence']}; {memory}; "
            f"{len(programs)} programs ({captured} captured as CUDA graphs)"
        )
        slots = r["slots"]
        if not slots:
            lines.append("  no slots in use")
            continue
        header = ("slot", "generation", "next_position", "page_count", "pending", "step")
        lines.append("  " + "  ".join(f"{name:>13}" for name in header))
        for row in slots:
            lines.append("  " + "  ".join(f"{row[name]:>13}" for name in header))
    return "\n".join(lines)


def cmd_ranks(args: argparse.Namespace) -> int:
    """0: printed; 1: the server refused or could not answer."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/") + "/debug/ranks"
    try:
        response = httpx.get(url, headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        print(f"flare ranks status: {url}: {exc}")
        return 1
    if response.status_code == 404:
        print(f"flare ranks status: {url}: not found (start the server with --debug-endpoints)")
        return 1
    if response.status_code != 200:
        print(f"flare ranks status: {url}: HTTP {response.status_code}: {response.text[:500]}")
        return 1
    body = response.json()
    print(json.dumps(body, indent=1) if args.json else format_ranks(body["ranks"]))
    return 0
