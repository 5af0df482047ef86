"""The argv of the coordinator process: ``python -m runtime.coordinator``.

``flare run`` (serving) starts it with its own command-line flags (less
``--api-key``) plus ``--api-requests`` / ``--api-outputs`` (and ``--api-debug``),
the endpoints the frontend bound.  :func:`main` parses them as ``flare run``
does and hands the deployment to the process body,
:func:`runtime.coordinator.engine.main.run_coordinator`.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from runtime.cli.app import build_parser
from runtime.cli.commands.run import deployment_config
from runtime.cli.flags.debugging import trace_options
from runtime.logs import basic_config
from runtime.transport.links import ApiEndpoints


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    if not args.api_requests or not args.api_outputs:
        parser.error("the coordinator process is started by `flare run` with --api-* endpoints")
    # A flood of one message is a burst and a count (the handler is rate-limited).
    basic_config(args.log_level.upper(), "[coordinator] %(levelname)s %(message)s")
    config = replace(deployment_config(args, parser, argv), external_publication=True)
    from runtime.coordinator.engine.main import CoordinatorOptions, run_coordinator

    options = CoordinatorOptions(
        endpoints=ApiEndpoints(args.api_requests, args.api_outputs),
        served_model_name=args.served_model_name,
        debug_endpoint=args.api_debug,
        tracing=trace_options(args, debug=args.api_debug is not None),
        heartbeat_interval_s=args.heartbeat_interval,
    )
    return run_coordinator(config, options)
