"""A generation request's response: streamed as server-sent events in OpenAI's chunk
format (``data: [DONE]`` last), each chunk with text reported to the coordinator as
published, or collected into one JSON body, rendered a choice at a time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from runtime.frontend.client import CoordinatorGone
from runtime.frontend.preprocess.preparer import render_json
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import GenerationRequest
from runtime.frontend.server.admission import Ticket
from runtime.frontend.server.generation import EngineRefused, Piece, choices_of, merged_pieces
from runtime.frontend.server.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    merge_completion_logprobs,
    vllm_prompt_logprobs,
)
from runtime.frontend.server.state import Frontend
from runtime.frontend.server.usage import Timing, Usage


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), allow_nan=False)}\n\n"


def _seed(req: GenerationRequest) -> int:
    return req.seed if req.seed is not None else secrets.randbits(63)


def _usage(reqs: list[GenerationRequest]) -> Usage:
    return Usage(sum(len(req.prompt_token_ids) for req in reqs), reqs[0].n)  # each prompt once


class _Echo:
    """A choice's first piece: the echoed prompt (completions' ``echo``: its text,
    with ``logprobs`` its tokens' map) and vLLM's ``prompt_logprobs``, each
    once per choice (docs/scored-prefill.md)."""

    def __init__(self, fe: Frontend, req: GenerationRequest, chat: bool) -> None:
        self.fe, self.req, self.chat = fe, req, chat
        self.seen: set[int] = set()
        text = ""
        if req.echo and not chat:
            text = req.prompt
            if text is None:  # token ids: their text
                ids = list(req.prompt_token_ids)
                text = fe.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
        self.text = text

    def first(self, piece: Piece) -> tuple[str, dict | None, list | None] | None:
        """(prompt text, its logprobs map or None, vLLM's prompt_logprobs or None)
        for the first piece of its choice; None for later ones."""
        if piece.index in self.seen:
            return None
        self.seen.add(piece.index)
        req = self.req
        echoed = None
        if req.echo and req.logprobs is not None and not self.chat:
            echoed = echo_logprobs(self.fe, req, piece, req.return_tokens_as_token_ids)
        scores = None
        if req.prompt_logprobs is not None:
            scores = vllm_prompt_logprobs(self.fe, req, piece)
        return self.text, echoed, scores


async def stream_response(
    fe: Frontend,
    reqs: list[GenerationRequest],
    chat: bool,
    request_id: str,
    arrived: float,
    ticket: Ticket | None = None,
) -> AsyncIterator[str]:
    """SSE chunks; publication is reported after each chunk with text reaches the client.

    ``reqs``: one request per prompt (several for a batched completions prompt);
    they share every setting but the prompt.  ``ticket``: released at the end.
    """
    chunks = _stream_chunks(fe, reqs, chat, request_id, arrived)
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        if ticket is not None:
            ticket.release()
        await chunks.aclose()  # now (its requests are cancelled), not when collected


async def _stream_chunks(
    fe: Frontend, reqs: list[GenerationRequest], chat: bool, request_id: str, arrived: float
) -> AsyncIterator[str]:
    req, total = reqs[0], len(choices_of(reqs))
    seed = _seed(req)
    usage = _usage(reqs)
    timing = Timing(fe, arrived)
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": request_id, "object": kind, "created": int(time.time()), "model": req.model}
    offsets = [0] * total
    echo = _Echo(fe, req, chat)
    if chat:
        for i in range(total):
            yield _sse(
                {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
            )  # fmt: skip
    try:
        async for piece in merged_pieces(fe, reqs, seed):
            usage.add(piece)
            timing.tokens(piece)
            first = echo.first(piece)
            prefix, echoed, scores = first if first is not None else ("", None, None)
            extra = bool(prefix) or echoed is not None or scores is not None
            if (
                not piece.text
                and piece.finish_reason is None
                and req.logprobs is None
                and not extra
            ):
                continue  # held back (stop-string prefix, partial character)
            logprobs = echoed
            offsets[piece.index] += len(prefix)
            if req.logprobs is not None and piece.token_ids:
                as_ids = req.return_tokens_as_token_ids
                if chat:
                    logprobs = {"content": chat_logprobs(fe, piece, as_ids)}
                else:
                    more = completion_logprobs(fe, piece, offsets[piece.index], as_ids)
                    logprobs = merge_completion_logprobs(echoed, more)
            offsets[piece.index] += len(piece.text)
            text = prefix + piece.text
            if chat:
                delta = {"content": text} if text else {}
                choice = {"index": piece.index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": piece.finish_reason}  # fmt: skip
            else:
                choice = {"index": piece.index, "text": text, "logprobs": logprobs,
                          "finish_reason": piece.finish_reason}  # fmt: skip
            if scores is not None:
                choice["prompt_logprobs"] = scores
            yield _sse({**head, "choices": [choice]})
            if piece.text and piece.finish_reason is None:
                with contextlib.suppress(CoordinatorGone):
                    fe.client.publish(piece.request_id, piece.fence, time.monotonic_ns())
            if piece.finish_reason is not None:
                timing.finished(piece)
    except CoordinatorGone as exc:  # exited, or stopped answering
        yield _sse(RequestError(503, str(exc), None, "service_unavailable").to_json())
    except (EngineRefused, RuntimeError) as exc:
        error = RequestError(500, str(exc), None, "server_error").to_json()
        yield _sse(error)
    if req.include_usage:
        yield _sse({**head, "choices": [], "usage": usage.json()})
    yield "data: [DONE]\n\n"


async def collect_response(
    fe: Frontend, reqs: list[GenerationRequest], chat: bool, request_id: str, arrived: float
) -> dict[str, Any]:
    req, total = reqs[0], len(choices_of(reqs))
    seed = _seed(req)
    usage = _usage(reqs)
    timing = Timing(fe, arrived)
    texts = [""] * total
    finish: list[str | None] = [None] * total
    completion_lp: list[dict | None] = [None] * total
    chat_lp: list[list] = [[] for _ in range(total)]
    prompt_lp: list[list | None] = [None] * total
    echo = _Echo(fe, req, chat)
    async for piece in merged_pieces(fe, reqs, seed):
        usage.add(piece)
        timing.tokens(piece)
        first = echo.first(piece)
        if first is not None:
            prefix, echoed, prompt_lp[piece.index] = first
            texts[piece.index] += prefix
            completion_lp[piece.index] = echoed
        if req.logprobs is not None and piece.token_ids:
            as_ids = req.return_tokens_as_token_ids
            if chat:
                chat_lp[piece.index] += chat_logprobs(fe, piece, as_ids)
            else:
                more = completion_logprobs(fe, piece, len(texts[piece.index]), as_ids)
                completion_lp[piece.index] = merge_completion_logprobs(
                    completion_lp[piece.index], more
                )
        texts[piece.index] += piece.text
        if piece.finish_reason is not None:
            finish[piece.index] = piece.finish_reason
            timing.finished(piece)
    created = int(time.time())
    if chat:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": texts[i]},
                "logprobs": {"content": chat_lp[i]} if req.logprobs is not None else None,
                "finish_reason": finish[i],
            }
            for i in range(total)
        ]
        kind = "chat.completion"
    else:
        choices = [
            {"index": i, "text": texts[i], "logprobs": completion_lp[i], "finish_reason": finish[i]}
            for i in range(total)
        ]
        kind = "text_completion"
    if req.prompt_logprobs is not None:  # vLLM's field, per choice
        for i, choice in enumerate(choices):
            choice["prompt_logprobs"] = prompt_lp[i]
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage.json(),
    }


async def rendered(content: dict[str, Any]) -> Response:
    """A non-streamed response's JSON, rendered a choice at a time with the event
    loop free in between (a thousand long choices render for seconds)."""
    choices = content.get("choices")
    if not isinstance(choices, list) or len(choices) < 2:
        return JSONResponse(content)
    head = render_json({**content, "choices": []})
    parts = []
    for i, choice in enumerate(choices):
        parts.append(render_json(choice))
        if i % 8 == 7:
            await asyncio.sleep(0)
    # The key's quotes are unescaped only where it is the key (a string value escapes them).
    before, _, after = head.partition(b'"choices":[]')
    return Response(
        before + b'"choices":[' + b",".join(parts) + b"]" + after, media_type="application/json"
    )


def json_reply(result: dict[str, Any] | bytes) -> Response:
    """A prepared /tokenize or /detokenize answer: rendered here, or by a worker."""
    if isinstance(result, bytes):
        return Response(result, media_type="application/json")
    return JSONResponse(result)
