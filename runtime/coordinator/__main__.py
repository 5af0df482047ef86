"""Coordinator process of an HTTP deployment: ``python -m runtime.coordinator``.

``flare run`` (serving) starts it with its own command-line flags plus
``--api-requests`` / ``--api-outputs``, the endpoints the frontend bound.  It
starts the engine and the rank processes (:class:`LocalDeployment`), then
serves the frontend (:class:`FrontendBridge`) until SIGTERM or SIGINT, and
stops the ranks on the way out.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import replace

from runtime.coordinator.engine.bridge import FrontendBridge, ServingInfo
from runtime.coordinator.engine.debug import DebugService
from runtime.local import LocalDeployment
from runtime.logs import basic_config
from runtime.trace.cli import trace_options
from runtime.transport.links import ApiEndpoints

log = logging.getLogger("runtime.coordinator")


def main(argv: list[str] | None = None) -> int:
    from runtime.cli import build_parser, deployment_config

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    if not args.api_requests or not args.api_outputs:
        parser.error("the coordinator process is started by `flare run` with --api-* endpoints")
    # A flood of one message is a burst and a count (the handler is rate-limited).
    basic_config(args.log_level.upper(), "[coordinator] %(levelname)s %(message)s")
    config = replace(deployment_config(args, parser, argv), external_publication=True)
    endpoints = ApiEndpoints(args.api_requests, args.api_outputs)
    deployment = LocalDeployment(config)
    tracing = trace_options(args, debug=args.api_debug is not None)
    if tracing is not None:
        deployment.engine.enable_trace(tracing)
    bridge: FrontendBridge | None = None
    debug: DebugService | None = None
    code = 0

    def stop(signum: int, frame: object) -> None:
        if bridge is not None:
            bridge.stop()
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        try:
            deployment.start()
        except Exception as exc:  # a rank died, a timeout: one line, the ranks said why
            log.error("start-up failed: %s", exc)
            return 1
        facts = deployment.engine.facts
        assert facts is not None
        info = ServingInfo(
            model_name=args.served_model_name or facts.model_name,
            vocab_size=facts.vocab_size,
            max_context=facts.max_context,
            tensor_parallel_size=config.tensor_parallel_size,
            max_concurrency=config.max_concurrency,
            kv_tokens=facts.num_pages * facts.page_size,
        )
        if args.api_debug is not None:
            profile_dir = config.profile_dir and os.path.abspath(config.profile_dir)
            debug = DebugService(deployment.engine, args.api_debug, profile_dir).start()
        beat_s = args.heartbeat_interval  # the frontend's heartbeat too
        bridge = FrontendBridge(
            deployment.engine, endpoints, info, heartbeat_interval_s=beat_s,
            health=deployment.health,
        )  # fmt: skip
        bridge.serve()
        if deployment.engine.error is not None:
            code = 1
    except KeyboardInterrupt:
        log.info("stopped during start-up")
    finally:
        if bridge is not None:
            bridge.close()
        if debug is not None:
            debug.close()
        deployment.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
