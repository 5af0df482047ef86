"""The FastAPI app: API keys, error handlers, and the routes (OpenAI's, the
operational ones, and with ``--debug-endpoints`` the debug ones)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from runtime.frontend.debug import add_debug_routes
from runtime.frontend.preprocess.preparer import Preparer
from runtime.frontend.server.admin_routes import add_admin_routes
from runtime.frontend.server.auth import ApiKeyMiddleware, api_keys, tenant_salts
from runtime.frontend.server.errors import error_response
from runtime.frontend.server.openai_routes import add_openai_routes
from runtime.frontend.server.state import Frontend


def create_app(fe: Frontend) -> FastAPI:
    app = FastAPI(title="flare", docs_url=None, redoc_url=None, openapi_url=None)
    keys = api_keys(fe.api_key)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys, salts=tenant_salts(keys))
    # Size limits, then parsing and tokenizing (runtime.frontend.preprocess).
    preparer = Preparer(fe.limits, fe.tokenizer, fe.template, fe.defaults, fe.image_processor)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception):
        return error_response(404, f"no route {request.method} {request.url.path}")

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception):
        return error_response(405, f"{request.method} is not allowed on {request.url.path}")

    if fe.debug is not None:
        add_debug_routes(app, fe.debug)
    add_admin_routes(app, fe)
    add_openai_routes(app, fe, preparer)
    return app
