"""``flare ranks status``: what a running server's ranks hold, from ``GET
/debug/ranks`` (a server started with ``flare run --debug-endpoints``)."""

from __future__ import annotations

import argparse
import json
import os


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
