"""The OpenAI-compatible API: ``POST /v1/completions``, ``POST /v1/chat/completions``
and ``GET /v1/models``, and vLLM's ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
import weakref
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from runtime.frontend.client import CoordinatorGone
from runtime.frontend.preprocess.preparer import Preparer
from runtime.frontend.server.admission import Ticket
from runtime.frontend.server.auth import TENANT_SALT_SCOPE_KEY, combined_salt
from runtime.frontend.server.body import prepared_body
from runtime.frontend.server.errors import error_response
from runtime.frontend.server.generation import EngineRefused, choices_of, sampling_params
from runtime.frontend.server.responses import (
    collect_response,
    json_reply,
    rendered,
    stream_response,
)
from runtime.frontend.server.state import Frontend
from runtime.transport.fields import ProtocolError

DISCONNECT_POLL_S = 0.1


def add_openai_routes(app: FastAPI, fe: Frontend, preparer: Preparer) -> None:
    """The generation routes, /v1/models, /tokenize and /detokenize on ``app``;
    ``preparer``: what prepares their bodies."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": fe.limits.model_name,
                    "object": "model",
                    "created": fe.created,
                    "owned_by": "flare",
                    "max_model_len": fe.limits.max_context,
                    "vocab_size": fe.limits.vocab_size,  # flare's: token-id prompts' range
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        result = await prepared_body(fe, preparer, request, "tokenize")
        return result if isinstance(result, Response) else json_reply(result)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        result = await prepared_body(fe, preparer, request, "detokenize")
        return result if isinstance(result, Response) else json_reply(result)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(fe, preparer, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(fe, preparer, request, chat=True)


async def generate(fe: Frontend, preparer: Preparer, request: Request, chat: bool) -> Response:
    """A completions or chat completions request: admitted, prepared, its choices
    submitted, and its response streamed or collected."""
    arrived = time.perf_counter()
    gate = fe.gate
    # Refused before any parsing when it is certain (stuck, draining, full).
    refused = None if gate is None else gate.refusal(1)
    if refused is not None:
        return refused
    # Size limits, parsing, tokenizing: off the event loop unless small.
    prepared = await prepared_body(fe, preparer, request, "chat" if chat else "completions")
    if isinstance(prepared, Response):
        return prepared
    reqs = prepared
    req = reqs[0]
    tenant = request.scope.get(TENANT_SALT_SCOPE_KEY, "")
    if tenant:  # several API keys: this key's pages are its own
        salt = combined_salt(tenant, req.cache_salt)
        reqs = [dataclasses.replace(r, cache_salt=salt) for r in reqs]
        req = reqs[0]
    try:
        sampling_params(req, 0, 0, fe.limits.vocab_size)
    except ProtocolError as exc:
        return error_response(400, str(exc), exc.field)
    # The exact check, with the choices counted (no await between it and admission).
    refused = None if gate is None else gate.refusal(len(choices_of(reqs)))
    if refused is not None:
        return refused
    ticket = Ticket(gate, len(choices_of(reqs)))
    fe.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in reqs))
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        if req.stream:
            chunks = stream_response(fe, reqs, chat, request_id, arrived, ticket)
            # A stream the server never starts (its client left first) is released
            # when collected.
            weakref.finalize(chunks, ticket.release)
            ticket = None  # the stream's now
            return StreamingResponse(chunks, media_type="text/event-stream")
        work = asyncio.create_task(collect_response(fe, reqs, chat, request_id, arrived))
        watch = asyncio.create_task(_until_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left: cancelling frees its requests
                return Response(status_code=499)
            return await rendered(work.result())
        finally:  # also when this handler itself is cancelled (shutdown)
            for task in (work, watch):
                task.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
    except EngineRefused as exc:
        return error_response(400, str(exc))
    except CoordinatorGone as exc:
        return error_response(503, str(exc), None, "service_unavailable")
    except RuntimeError as exc:
        return error_response(500, str(exc))
    finally:
        if ticket is not None:
            ticket.release()


async def _until_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
