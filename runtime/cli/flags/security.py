"""The security flags (docs/security.md): ``flare run``'s ``--api-key``, HTTPS
(``--ssl-*``) and the rank transport's CURVE keys (``--transport-keys``,
``--insecure-transport``), and the transport flags of ``python -m runtime.ranks``.
``flare keys DIR`` writes the keys (commands/keys.py)."""

from __future__ import annotations

import argparse
import logging
import os
import ssl

from runtime.cli.flags.families import flag_group
from runtime.transport.key_files import load_client_keys, load_server_keys
from runtime.transport.security import ClientKeys, TransportKeyError

log = logging.getLogger("runtime.transport")

INSECURE_WARNING = (
    "INSECURE TRANSPORT (--insecure-transport): frames and completions travel over "
    "TCP unauthenticated and unencrypted; any process that reaches the ports can read "
    "every prompt and forge completions. Use `flare keys` and --transport-keys instead."
)


def add_api_key_flag(run: argparse.ArgumentParser) -> None:
    flag_group(run, "security").add_argument(
        "--api-key",
        metavar="KEY[,KEY...]",
        action="append",
        default=None,
        help="require one of these bearer keys on every route but /health and /version: "
        "a key, a comma-separated list, or the flag repeated; with several keys each key "
        "is a tenant with its own prefix-cache salt, so tenants never share cached pages "
        "(default: $FLARE_API_KEY, read the same way, else none)",
    )


def _split_keys(value: str) -> list[str]:
    return [key.strip() for key in value.split(",") if key.strip()]


def api_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """The API keys: ``--api-key`` (repeated, or comma-separated; a [run] ``api-key``
    string too), else ``$FLARE_API_KEY`` read the same way (empty: none)."""
    given = args.api_key
    if isinstance(given, tuple):  # already checked
        return given
    if given is None:
        return tuple(dict.fromkeys(_split_keys(os.environ.get("FLARE_API_KEY") or "")))
    values = [given] if isinstance(given, str) else list(given)
    if any(not _split_keys(value) for value in values):
        parser.error("--api-key: give a key or a comma-separated list of keys, not an empty value")
    return tuple(dict.fromkeys(key for value in values for key in _split_keys(value)))


def without_secrets(argv: list[str]) -> tuple[str, ...]:
    """``argv`` minus ``--api-key``: the coordinator does not need it, and a child's
    command line is visible to every local user."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--api-key":
            skip = True
        elif not arg.startswith("--api-key="):
            out.append(arg)
    return tuple(out)


# ------------------------------------------------------------------ HTTPS


def add_https_flags(run: argparse.ArgumentParser) -> None:
    security = flag_group(run, "security")
    security.add_argument(
        "--ssl-keyfile",
        metavar="FILE",
        default=None,
        help="serve HTTPS: the private key (PEM; default: plain HTTP)",
    )
    security.add_argument(
        "--ssl-certfile",
        metavar="FILE",
        default=None,
        help="serve HTTPS: the certificate chain (PEM), with --ssl-keyfile (default: plain HTTP)",
    )
    security.add_argument(
        "--ssl-ca-certs",
        metavar="FILE",
        default=None,
        help="HTTPS: require client certificates signed by these CAs (PEM; mutual TLS; "
        "default: no client certificates)",
    )


def _readable(flag: str, path: str, parser: argparse.ArgumentParser) -> None:
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        parser.error(f"{flag} {path}: cannot be read ({exc.strerror or exc})")


def https_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The ServeOptions fields of the ``--ssl-*`` flags, checked: a flag given
    without its partner or naming an unreadable file fails naming it."""
    keyfile, certfile, ca_certs = args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs
    if (keyfile is None) != (certfile is None):
        given, missing = (
            ("--ssl-keyfile", "--ssl-certfile") if certfile is None else
            ("--ssl-certfile", "--ssl-keyfile")
        )  # fmt: skip
        parser.error(f"{given} needs {missing} too (HTTPS takes a key and its certificate)")
    if ca_certs is not None and certfile is None:
        parser.error("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile (it is for HTTPS)")
    for flag, path in (
        ("--ssl-keyfile", keyfile),
        ("--ssl-certfile", certfile),
        ("--ssl-ca-certs", ca_certs),
    ):
        if path is not None:
            _readable(flag, path, parser)
    if certfile is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(certfile, keyfile)
        except (ssl.SSLError, ValueError) as exc:
            parser.error(
                f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a PEM certificate "
                f"and its private key ({exc})"
            )
        if ca_certs is not None:
            try:
                context.load_verify_locations(ca_certs)
            except ssl.SSLError as exc:
                parser.error(f"--ssl-ca-certs {ca_certs}: not PEM CA certificates ({exc})")
    return {"ssl_keyfile": keyfile, "ssl_certfile": certfile, "ssl_ca_certs": ca_certs}


# ------------------------------------------------------------------ the rank transport


def add_transport_flags(run: argparse.ArgumentParser) -> None:
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
