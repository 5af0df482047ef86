"""Request bodies: their content type and size checked, read in the chunks they
arrive in, and prepared for a route (:mod:`runtime.frontend.preprocess`: parsed,
validated and tokenized, inline or in a worker)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from runtime.frontend.preprocess.memory import TRIM_BODY_BYTES, TRIMMER
from runtime.frontend.preprocess.preparer import Preparer, parse_json, prepare_body
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import GenerationRequest
from runtime.frontend.server.errors import error_response
from runtime.frontend.server.state import Frontend

log = logging.getLogger("runtime.frontend")

MAX_BODY_BYTES = 32 << 20


class BodyTooLarge(Exception):
    pass


async def _read_body(request: Request) -> list[bytes]:
    """The body in the chunks it arrived in (a large one is never joined here)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge
        chunks.append(chunk)
    return chunks


async def _body_bytes(request: Request) -> list[bytes] | Response:
    """The request's JSON body, unparsed, in its chunks, or the 4xx response refusing
    it (content type, size).  A client that leaves during the upload costs one log
    line."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        return error_response(415, f"Content-Type must be application/json, got {content_type!r}")
    try:
        return await _read_body(request)
    except BodyTooLarge:
        TRIMMER.soon()  # what was read of it goes back to the system
        return error_response(
            413,
            f"the request body is larger than this server's limit of {MAX_BODY_BYTES} bytes",
            code="request_too_large",
        )
    except ClientDisconnect:
        TRIMMER.soon()
        log.warning(
            "%s %s: the client disconnected during the upload of its body",
            request.method,
            request.url.path,
        )
        return Response(status_code=499)


async def _json_body(request: Request) -> object:
    """The request's JSON body, or the 4xx response refusing it (content type, size,
    syntax).  Parsed on the event loop: for small bodies (see prepared_body)."""
    body = await _body_bytes(request)
    if isinstance(body, Response):
        return body
    try:
        return parse_json(b"".join(body))
    except RequestError as exc:
        return JSONResponse(exc.to_json(), status_code=exc.status)


async def prepared_body(
    fe: Frontend, preparer: Preparer, request: Request, route: str
) -> list[GenerationRequest] | dict[str, Any] | bytes | Response:
    """A body prepared for ``route`` (runtime.frontend.preprocess: on the event loop
    when small and cheap, else in a preprocessing worker), or the response refusing
    it."""
    body = await _body_bytes(request)
    if isinstance(body, Response):
        return body
    try:
        return await prepare_body(preparer, fe.preprocess, route, body)
    except RequestError as exc:
        return JSONResponse(exc.to_json(), status_code=exc.status)
    finally:
        if sum(len(chunk) for chunk in body) >= TRIM_BODY_BYTES:
            TRIMMER.soon()  # the body's pages go back to the system
