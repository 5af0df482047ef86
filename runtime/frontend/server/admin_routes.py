"""The operational routes: ``GET /health`` (503 unless the engine serves, saying
why), ``GET /metrics`` (Prometheus text) and ``GET /version``."""

from __future__ import annotations

import importlib.metadata

from fastapi import FastAPI
from fastapi.responses import Response

from runtime.frontend.client import CoordinatorGone
from runtime.frontend.server.errors import error_response
from runtime.frontend.server.state import Frontend


def package_version() -> str:
    """The installed flare-runtime version (``0+unknown`` when run from a bare checkout)."""
    try:
        return importlib.metadata.version("flare-runtime")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def add_admin_routes(app: FastAPI, fe: Frontend) -> None:
    """/health, /metrics and /version on ``app``."""

    @app.get("/health")
    async def health() -> Response:
        gate = fe.gate
        if gate is not None:
            down = gate.unavailable()
            if down is not None:
                reason, retry = down
                return error_response(503, reason, None, "service_unavailable", retry_after=retry)
            # The coordinator's latest word (its heartbeat or status), no round trip:
            # answers at once under load.  A failure, an exit, a silence or a heartbeat
            # saying the engine does not serve made unavailable() answer above.
            if fe.client.serving:
                return Response(status_code=200)
        try:
            status = await fe.client.query_status()
        except CoordinatorGone as exc:
            return error_response(503, str(exc), None, "service_unavailable")
        if not status.serving:
            return error_response(503, status.error or "the engine is not serving", None,
                                  "service_unavailable")  # fmt: skip
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            status = await fe.client.query_status()
        except CoordinatorGone:
            status = None
        return Response(
            fe.metrics.render(status), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}
