"""``flare keys DIR``: write a deployment's CURVE keys (docs/security.md); the
flags that use them are flags/security.py's."""

from __future__ import annotations

import argparse

from runtime.transport.key_files import (
    CLIENT_SECRET,
    COORDINATOR_DIR,
    RANKS_DIR_PREFIX,
    SERVER_SECRET,
    generate_keys,
)
from runtime.transport.security import TransportKeyError


def add_keys_command(sub, parser_class, formatter_class) -> None:
    keys = sub.add_parser(
        "keys",
        help="write the CURVE keys that authenticate and encrypt coordinator-rank traffic",
        description="Write a deployment's ZeroMQ CURVE keys under DIR: DIR/coordinator for "
        "the coordinator host (`flare run --transport-keys DIR/coordinator`) and one "
        "DIR/ranks-K per rank host (`python -m runtime.ranks --transport-keys DIR/ranks-K`). "
        "Copy each directory only to its host; files are 0600 in 0700 directories "
        "(docs/security.md).",
        formatter_class=formatter_class,
    )
    keys.add_argument("directory", metavar="DIR")
    keys.add_argument(
        "--clients",
        metavar="N",
        type=int,
        default=1,
        help="rank hosts, one client key pair each (all ranks on a host share its pair)",
    )
    keys.add_argument(
        "--force", action="store_true", help="replace existing keys in DIR (every host then "
        "needs its new directory)",
    )  # fmt: skip


def cmd_keys(args: argparse.Namespace) -> int:
    """0: written; 2: refused (existing keys, a bad --clients, an unwritable DIR)."""
    try:
        root = generate_keys(args.directory, clients=args.clients, force=args.force)
    except (TransportKeyError, OSError) as exc:
        print(f"flare keys: {exc}")
        return 2
    print(f"wrote CURVE keys for 1 coordinator and {args.clients} rank host(s) under {root}:")
    print(f"  {root / COORDINATOR_DIR}  -> the coordinator host only (holds {SERVER_SECRET})")
    for k in range(args.clients):
        host = root / f"{RANKS_DIR_PREFIX}{k}"
        print(f"  {host}  -> rank host {k} only (holds its {CLIENT_SECRET})")
    print("flare run ... --transport-keys DIR/coordinator; on each rank host: "
          "python -m runtime.ranks ... --transport-keys DIR/ranks-K")  # fmt: skip
    return 0
