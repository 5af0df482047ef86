"""An async streaming client for OpenAI-compatible ``/v1/completions`` and
``/v1/chat/completions`` that times every chunk of every request.

Each request streams (``stream: true`` with ``include_usage``) and the client
records when it was sent, when each chunk carrying output arrived and how many
tokens came back, so the report can derive TTFT, TPOT and ITL exactly as a user
would see them.  A failed request becomes a record with its error text rather
than an exception, so one bad request never stops a run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from runtime.loadgen.workload import WorkRequest

Endpoint = Literal["completions", "chat"]
PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send.  ``timeout`` is httpx's: seconds allowed to connect
    and between bytes of a response, so a hung server fails the request."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    ignore_eos: bool = False
    timeout: float = 300.0


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request; times are ``time.perf_counter`` seconds.

    ``chunk_times`` holds the arrival of each chunk that carried output (the
    first is the first token); role-only and usage-only chunks are not in it.
    ``output_tokens`` is the server's usage figure when it sent one, else the
    number of those chunks.  ``error`` is empty on success.
    """

    index: int
    send_time: float
    end_time: float
    chunk_times: tuple[float, ...]
    prompt_tokens: int
    output_tokens: int
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error

    @property
    def first_token_time(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None


def build_payload(config: ClientConfig, request: WorkRequest) -> dict[str, Any]:
    """The JSON body for ``request``; token-id prompts go to completions only."""
    payload: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("chat requests need text prompts, not token ids")
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        prompt = request.prompt
        payload["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
    if config.ignore_eos:
        payload["ignore_eos"] = True  # vLLM extension: generate exactly max_tokens
    return payload


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The output a streamed chunk carries, in either endpoint's format."""
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text += choice.get("text") or ""
        text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


def _error_text(status: int, body: bytes) -> str:
    """``HTTP status: message``, the message taken from an OpenAI error body."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = body.decode(errors="replace")[:500]
    return f"HTTP {status}: {message}"


async def send_request(
    client: httpx.AsyncClient, config: ClientConfig, request: WorkRequest
) -> RequestRecord:
    """Stream one request to the end and return its record; never raises."""
    send_time = time.perf_counter()
    chunk_times: list[float] = []
    usage: dict[str, Any] = {}
    error = ""
    try:
        payload = build_payload(config, request)
        async with client.stream("POST", PATHS[config.endpoint], json=payload) as response:
            if response.status_code != 200:
                error = _error_text(response.status_code, await response.aread())
            else:
                done = False
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        error = f"stream error: {chunk['error']}"
                        break
                    usage = chunk.get("usage") or usage
                    if _chunk_text(chunk):
                        chunk_times.append(time.perf_counter())
                if not done and not error:
                    error = "stream ended before data: [DONE]"
    except Exception as exc:  # any failure belongs to this request only
        error = f"{type(exc).__name__}: {exc}"
    return RequestRecord(
        index=request.index,
        send_time=send_time,
        end_time=time.perf_counter(),
        chunk_times=tuple(chunk_times),
        prompt_tokens=int(usage.get("prompt_tokens") or request.prompt_len),
        output_tokens=int(usage.get("completion_tokens") or len(chunk_times)),
        error=error,
    )


async def run_benchmark(
    config: ClientConfig,
    requests: Sequence[WorkRequest],
    offsets: Sequence[float],
    concurrency: int | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests[i]`` at ``offsets[i]`` seconds from the start, at most
    ``concurrency`` in flight (None: no cap), and return the records in request
    order with the wall time from the first send to the last completion."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(client: httpx.AsyncClient, request: WorkRequest) -> RequestRecord:
        if semaphore is None:
            record = await send_request(client, config, request)
        else:
            async with semaphore:
                record = await send_request(client, config, request)
        if on_done is not None:
            on_done(record)
        return record

    async with httpx.AsyncClient(
        base_url=config.base_url,
        headers=auth_headers(config.api_key),
        timeout=config.timeout,
        limits=limits,
    ) as client:
        start = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, request)))
        records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


def model_card(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> dict:
    """The first model card ``GET /v1/models`` lists (flare's carries ``vocab_size``)."""
    response = httpx.get(f"{base_url}/v1/models", headers=auth_headers(api_key), timeout=timeout)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ValueError(f"{base_url}/v1/models lists no models")
    return models[0]


def first_model(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    """The id of the first model ``GET /v1/models`` lists."""
    return str(model_card(base_url, api_key, timeout)["id"])
