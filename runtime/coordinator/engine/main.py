"""The body of the coordinator process of an HTTP deployment (``python -m
runtime.coordinator``, started by ``flare run``; its flags are
runtime/cli/coordinator_process.py's).

It starts the engine and the rank processes (:class:`LocalDeployment`), then
serves the frontend (:class:`FrontendBridge`) on the API endpoints the frontend
bound until SIGTERM or SIGINT, and stops the ranks on the way out.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

from runtime.coordinator.engine.bridge import FrontendBridge, ServingInfo
from runtime.coordinator.engine.debug import DebugService
from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from runtime.trace.writer import TraceOptions
from runtime.transport.links import ApiEndpoints

log = logging.getLogger("runtime.coordinator")


@dataclass(frozen=True)
class CoordinatorOptions:
    """What the coordinator process serves, besides its deployment."""

    endpoints: ApiEndpoints  # the frontend's request and output channels
    served_model_name: str | None = None  # None: the model directory's name
    debug_endpoint: str | None = None  # the frontend's /debug/* channel (None: no debug routes)
    tracing: TraceOptions | None = None
    heartbeat_interval_s: float = 1.0  # the frontend's heartbeat too


def run_coordinator(config: DeploymentConfig, options: CoordinatorOptions) -> int:
    """Serve until stopped: 0, or 1 when the start-up or the engine failed."""
    deployment = LocalDeployment(config)
    if options.tracing is not None:
        deployment.engine.enable_trace(options.tracing)
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
            model_name=options.served_model_name or facts.model_name,
            vocab_size=facts.vocab_size,
            max_context=facts.max_context,
            tensor_parallel_size=config.tensor_parallel_size,
            max_concurrency=config.max_concurrency,
            kv_tokens=facts.num_pages * facts.page_size,
        )
        if options.debug_endpoint is not None:
            profile_dir = config.profile_dir and os.path.abspath(config.profile_dir)
            debug = DebugService(deployment.engine, options.debug_endpoint, profile_dir).start()
        bridge = FrontendBridge(
            deployment.engine, options.endpoints, info,
            heartbeat_interval_s=options.heartbeat_interval_s, health=deployment.health,
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
