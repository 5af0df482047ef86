"""The error responses of the HTTP API, in OpenAI's shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from runtime.frontend.protocol.errors import RequestError


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    kind: str | None = None,
    code: str | None = None,
    retry_after: int | None = None,
):
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    headers = None if retry_after is None else {"Retry-After": str(retry_after)}
    return JSONResponse(
        RequestError(status, message, param, kind, code=code).to_json(),
        status_code=status,
        headers=headers,
    )
