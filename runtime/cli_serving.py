"""The HTTP frontend's reliability flags of ``flare run``: drain on SIGTERM, the
queue limit, HTTPS (kept beside runtime/cli.py, which only wires them;
docs/serving.md, "Reliability").

The heartbeat flags (``--heartbeat-interval``, ``--heartbeat-timeout``) belong
to the liveness flags (runtime/cli_liveness.py); the frontend reads them too,
for the coordinator's heartbeat on the API channel.
"""

from __future__ import annotations

import argparse
import math
import ssl

from runtime.cli_groups import flag_group


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_serving_flags(run: argparse.ArgumentParser) -> None:
    security = flag_group(run, "security")
    run = flag_group(run, "serving")  # every flag below that names no other family
    run.add_argument(
        "--drain-timeout",
        metavar="SECONDS",
        type=_seconds,
        default=0.0,
        help="on SIGTERM/SIGINT, refuse new requests (503 with Retry-After) and let open ones "
        "finish for up to SECONDS; those still open then end with finish_reason 'abort' "
        "(default 0: every open request ends with 'abort' at once); a second signal aborts now",
    )
    run.add_argument(
        "--max-waiting-requests",
        metavar="N",
        type=_count,
        default=None,
        help="answer 429 with Retry-After to a request whose choices would make the open ones "
        "exceed --max-concurrency + N (default: no limit)",
    )
    add_hostile_client_flags(run)
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


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _positive_count(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_hostile_client_flags(run) -> None:
    """The frontend's limits against hostile clients (docs/serving.md, "Hostile
    clients and limits")."""
    run.add_argument(
        "--max-connections",
        metavar="N",
        type=_positive_count,
        default=None,
        help="hold at most N client connections: one more closes the connection that has "
        "waited longest for a request head (503), or gets the 503 itself when every "
        "connection has a request in progress (default: the open-file limit, raised to its "
        "hard value at start, less room for accepting and the process's own files; at most "
        "10000)",
    )
    run.add_argument(
        "--header-timeout",
        metavar="SECONDS",
        type=_positive_seconds,
        default=10.0,
        help="close a connection whose request head is not complete SECONDS after it opened "
        "or its previous response ended (408; default 10)",
    )
    run.add_argument(
        "--preprocess-workers",
        metavar="N",
        type=_count,
        default=2,
        help="processes that parse, validate and tokenize large request bodies (over 16 KiB, "
        "or chats costly to tokenize), so the event loop never stalls on them; 0: all in "
        "the frontend process (default 2)",
    )


def _readable(flag: str, path: str, parser: argparse.ArgumentParser) -> None:
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        parser.error(f"{flag} {path}: cannot be read ({exc.strerror or exc})")


def serving_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The ServeOptions fields of these flags and of the heartbeat flags, checked: a
    flag given without its partner or naming an unreadable file fails naming it."""
    interval, timeout = args.heartbeat_interval, args.heartbeat_timeout  # cli_liveness checks
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
    return {
        "heartbeat_interval_s": float(interval),
        "heartbeat_timeout_s": float(timeout),
        "drain_timeout_s": float(args.drain_timeout),
        "max_waiting_requests": args.max_waiting_requests,
        "ssl_keyfile": keyfile,
        "ssl_certfile": certfile,
        "ssl_ca_certs": ca_certs,
        "max_connections": args.max_connections,
        "header_timeout_s": float(args.header_timeout),
        "preprocess_workers": args.preprocess_workers,
    }
