"""Transport security on the command line: ``flare keys DIR``, ``--transport-keys``
and ``--insecure-transport`` of ``flare run`` and ``python -m runtime.ranks``
(docs/security.md).  Kept beside runtime/cli.py, which only wires them."""

from __future__ import annotations

import argparse
import logging
import os

from runtime.transport.key_files import (
    CLIENT_SECRET,
    COORDINATOR_DIR,
    RANKS_DIR_PREFIX,
    SERVER_SECRET,
    generate_keys,
    load_client_keys,
    load_server_keys,
)
from runtime.transport.security import ClientKeys, TransportKeyError

log = logging.getLogger("runtime.transport")

INSECURE_WARNING = (
    "INSECURE TRANSPORT (--insecure-transport): frames and completions travel over "
    "TCP unauthenticated and unencrypted; any process that reaches the ports can read "
    "every prompt and forge completions. Use `flare keys` and --transport-keys instead."
)


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


# ------------------------------------------------------------------ flare run


def add_transport_flags(run: argparse.ArgumentParser) -> None:
    from runtime.cli_groups import flag_group

    run = flag_group(run, "security")  # every flag below
    run.add_argument(
        "--transport-keys",
        metavar="DIR",
        default=None,
        help="--ranks external: authenticate and encrypt the ranks' TCP traffic with the "
        "CURVE keys `flare keys` wrote (the coordinator's directory: the server secret and "
        "the rank hosts' public keys; docs/security.md; default: required with --ranks "
        "external unless --insecure-transport)",
    )
    run.add_argument(
        "--insecure-transport",
        action="store_true",
        help="--ranks external: run the rank traffic over TCP WITHOUT authentication or "
        "encryption (anyone reaching the ports reads prompts and forges tokens; default: off)",
    )


def transport_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The DeploymentConfig fields of the transport flags; ``parser.error`` naming
    the flag when they do not fit (local ranks need neither: ipc, or per-run keys)."""
    directory = getattr(args, "transport_keys", None)
    insecure = bool(getattr(args, "insecure_transport", False))
    external = getattr(args, "ranks", "local") == "external"
    if not external:
        if directory is not None:
            parser.error(
                "--transport-keys applies to --ranks external (local ranks talk over a "
                "private ipc directory)"
            )
        if insecure:
            parser.error("--insecure-transport applies to --ranks external only")
        return {}
    if directory is not None and insecure:
        parser.error("--transport-keys and --insecure-transport contradict each other: give one")
    if directory is None and not insecure:
        parser.error(
            "--ranks external needs --transport-keys DIR (write the keys with `flare keys DIR`; "
            "docs/security.md) or, to run unauthenticated, --insecure-transport"
        )
    if insecure:
        log.warning(INSECURE_WARNING)
        return {"insecure_transport": True}
    try:
        return {"transport_keys": load_server_keys(directory)}
    except TransportKeyError as exc:
        parser.error(f"--transport-keys: {exc}")
        raise  # unreachable


# ------------------------------------------------------------------ ranks


def add_rank_transport_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transport-keys",
        metavar="DIR",
        default=None,
        help="this rank host's CURVE keys from `flare keys` (DIR/ranks-K: the server public "
        "key and this host's pair); local ranks get theirs in FLARE_TRANSPORT_* variables",
    )
    parser.add_argument(
        "--insecure-transport",
        action="store_true",
        help="connect to tcp:// endpoints without CURVE keys (a coordinator started with "
        "--insecure-transport)",
    )


def rank_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ClientKeys | None:
    """This rank's CURVE keys: ``--transport-keys DIR``, else the environment (the
    variables are removed, so no child process inherits the secret), else None
    (allowed over ipc, or over tcp with ``--insecure-transport``)."""
    try:
        from_env = ClientKeys.from_environment(os.environ, remove=True)
    except TransportKeyError as exc:
        parser.error(str(exc))
        raise  # unreachable
    if args.transport_keys is not None and args.insecure_transport:
        parser.error("--transport-keys and --insecure-transport contradict each other: give one")
    keys = from_env
    if args.transport_keys is not None:
        try:
            keys = load_client_keys(args.transport_keys)
        except TransportKeyError as exc:
            parser.error(f"--transport-keys: {exc}")
            raise  # unreachable
    elif args.insecure_transport:
        keys = None
    tcp = any(
        (getattr(args, name, None) or "").startswith("tcp://")
        for name in ("frames_endpoint", "completions_endpoint", "heartbeat_endpoint")
    )
    if tcp and keys is None and not args.insecure_transport:
        parser.error(
            "tcp:// endpoints need --transport-keys DIR (this host's directory from "
            "`flare keys`; docs/security.md) or, for a coordinator started with "
            "--insecure-transport, --insecure-transport"
        )
    if tcp and keys is None:
        log.warning(INSECURE_WARNING)
    return keys
