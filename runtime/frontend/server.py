"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), one process apart from the coordinator.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
server-sent events in OpenAI's chunk format, ``data: [DONE]`` last),
``GET /v1/models``, ``GET /health`` (503 unless the engine serves),
``GET /metrics`` (Prometheus text), and vLLM's ``POST /tokenize``,
``POST /detokenize`` and ``GET /version``; with ``--debug-endpoints`` also
``GET /debug/trace`` (:mod:`runtime.frontend.debug`).

A request is validated (:mod:`runtime.frontend.protocol`), tokenized, and
each of its ``n`` choices is submitted to the coordinator as its own request
(seeds ``seed``, ``seed + 1``, ...).  Outputs are detokenized incrementally;
stop strings hold text back until they are ruled out, and stop token ids end
a choice.  Each time text reaches the client (an SSE chunk written), the
frontend reports the publication (request, fence, host time) to the
coordinator, which applies it before that request's next completion: output
age is measured to what the client saw.  A non-streaming response becomes
visible only at its end, so it reports nothing.  A choice that ends on the
frontend (stop string, stop token) or whose client disconnects is cancelled at
the coordinator, which stops selecting it at once.

Reliability (:class:`Gate`, set up by :mod:`runtime.frontend.serve`; see
``docs/serving.md``): a coordinator silent for ``--heartbeat-timeout``
seconds makes new requests 503 at once, ends open ones with an error event
and /health 503 saying why (until it is heard again); a draining or stopping
server answers new requests 503 with ``Retry-After``; beyond the coordinator's
resident requests plus ``--max-waiting-requests`` open choices, 429 with
``Retry-After``.

Every invalid input gets a 4xx JSON error in OpenAI's shape naming the field.
With an API key, every route but /health and /version requires
``Authorization: Bearer KEY`` (the scheme in any case, as HTTP says).

Prefix caching: each choice's ``Submit`` carries its chat messages' token
endpoints and a cache salt (requests share cached KV pages only with equal
salts).  The salt is the request's ``cache_salt``; with several API keys each
key also has its own salt (:func:`tenant_salts`: a keyed hash, never the key),
combined with the request's (:func:`combined_salt`), so tenants never share
cached pages.  ``usage.prompt_tokens_details.cached_tokens`` reports the prompt
tokens found in the cache (:class:`Usage`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import importlib.metadata
import json
import logging
import math
import secrets
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from runtime.frontend.chat import ChatTemplate
from runtime.frontend.client import CoordinatorClient, CoordinatorGone, CoordinatorLost, LocalEnd
from runtime.frontend.debug import DebugLink, add_debug_routes
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.detokenizer import IncrementalDetokenizer
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.preprocess import (
    TRIM_BODY_BYTES,
    TRIMMER,
    Preparer,
    PreprocessPool,
    parse_json,
    prepare_body,
    render_json,
)
from runtime.frontend.protocol import (
    GenerationRequest,
    RequestError,
    ServingLimits,
)
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.transport.api import Output, TokenLogprobs
from runtime.transport.fields import ProtocolError
from runtime.transport.sampling import SamplingParams

log = logging.getLogger("runtime.frontend")

SEED_MODULUS = 1 << 63
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)
DISCONNECT_POLL_S = 0.1
CONFIRM_S = 0.05  # Gate.watch: a second look before calling the coordinator stuck
MAX_BODY_BYTES = 32 << 20
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "aborted": "abort"}
# Routes open without the API key: liveness, and the version (vLLM leaves it open too).
OPEN_ROUTES = frozenset({"/health", "/version"})
MAX_MESSAGE_ENDPOINTS = 4096  # Submit's bound on message_endpoints
# Where ApiKeyMiddleware leaves the matched key's cache salt in the ASGI scope.
TENANT_SALT_SCOPE_KEY = "flare.tenant_salt"
# Keys the per-key salts' HMAC: a salt reveals nothing of its key, even a weak one.
# Per process: cached pages live no longer than the coordinator this frontend starts.
_TENANT_SALT_SECRET = secrets.token_bytes(32)


def api_keys(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """The API keys ``--api-key`` gives: a key, a comma-separated list of keys, or
    several such values (the flag repeated); blanks dropped, duplicates once."""
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else list(value)
    keys = (key.strip() for v in values for key in v.split(","))
    return tuple(dict.fromkeys(key for key in keys if key))


def tenant_salts(keys: Sequence[str]) -> dict[str, str]:
    """Each API key's own prefix-cache salt when there are several keys (tenants);
    none with one key or none.  A salt is an HMAC of its key under a per-process
    secret (``k`` + 32 hex digits): distinct per key, never the key itself."""
    if len(keys) < 2:
        return {}
    return {
        key: "k" + hmac.new(_TENANT_SALT_SECRET, key.encode(), hashlib.sha256).hexdigest()[:32]
        for key in keys
    }


def combined_salt(tenant: str, request_salt: str) -> str:
    """The cache salt a request's ``Submit`` carries: the request's ``cache_salt``
    alone without a tenant salt; else the tenant's salt, followed by a hash of the
    request's when it gave one (the tenant part keeps tenants apart whatever salts
    their requests choose; the hash keeps the result within Submit's bound)."""
    if not tenant:
        return request_salt
    if not request_salt:
        return tenant
    return f"{tenant}/{hashlib.sha256(request_salt.encode()).hexdigest()[:32]}"


def submit_endpoints(ends: Sequence[int], prompt_len: int) -> tuple[int, ...]:
    """Chat message endpoints as ``Submit`` takes them: strictly increasing, each in
    [1, prompt_len] (a message that adds no token of its own gives no anchor), at
    most MAX_MESSAGE_ENDPOINTS (the last ones: the longest prefixes)."""
    out = sorted({end for end in ends if 1 <= end <= prompt_len})
    return tuple(out[-MAX_MESSAGE_ENDPOINTS:])


def package_version() -> str:
    """The installed flare-runtime version (``0+unknown`` when run from a bare checkout)."""
    try:
        return importlib.metadata.version("flare-runtime")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class Ticket:
    """``choices`` admitted by a :class:`Gate`; :meth:`release` (idempotent) when the
    response has ended."""

    def __init__(self, gate: Gate | None, choices: int) -> None:
        self.gate, self.choices = gate, choices
        if gate is not None:
            gate.open += choices

    def release(self) -> None:
        if self.gate is not None:
            self.gate.open -= self.choices
            self.gate = None


@dataclass
class Gate:
    """What lets a new generation request in, and what /health says.

    ``client.last_heard`` is when the coordinator last said anything (a
    heartbeat every ``--heartbeat-interval`` at least); silent for more than
    ``heartbeat_timeout_s`` (as :meth:`watch` checks, a few times a second), it
    is stuck: new requests get 503 at once, open
    ones are ended with an error by :meth:`watch`, /health is 503 naming the
    silence.  Heard again, new requests are served again (the ended ones stay
    ended).  Open choices (admitted, response not ended) beyond ``resident``
    (the coordinator's max concurrency) plus ``max_waiting``
    (``--max-waiting-requests``; None: no limit) get 429; a request is
    admitted whatever its choices when nothing is open.
    ``drain_until``: the monotonic deadline of a drain in progress
    (``--drain-timeout``); ``stopping``: the server is stopping.

    A coordinator that cannot serve any more (``client.failure``: its engine
    failed or is failing, or its process exited) makes new requests and /health
    503 with that reason at once, ahead of any silence that follows; so does a
    heartbeat saying the engine does not serve.  Heard again after a silence,
    the coordinator counts as serving only once a heartbeat (or status) sent
    since says so: an output it had queued says nothing of its ranks.
    """

    client: CoordinatorClient
    heartbeat_timeout_s: float = 10.0
    resident: int = 1
    max_waiting: int | None = None
    open: int = 0
    drain_until: float | None = None
    stopping: bool = False
    stuck_since: float | None = None  # when watch() found the coordinator silent

    def silence_s(self) -> float:
        return time.monotonic() - self.client.last_heard

    def stuck(self) -> str | None:
        """Why the coordinator counts as stuck (None: it answers)."""
        silent = self.silence_s()
        if silent <= self.heartbeat_timeout_s:
            return None
        return (
            f"the coordinator stopped answering: nothing heard from it for {silent:.1f} s "
            f"(--heartbeat-timeout {self.heartbeat_timeout_s:g} s)"
        )

    def unavailable(self) -> tuple[str, int] | None:
        """Why new requests get 503 now, and the Retry-After seconds (None: they don't)."""
        if self.stopping:
            return "the server is shutting down", 1
        if self.drain_until is not None:
            left = max(0.0, self.drain_until - time.monotonic())
            return (
                f"the server is draining before it shuts down ({left:.1f} s left): "
                "it takes no new requests",
                max(1, math.ceil(left)),
            )
        failure = getattr(self.client, "failure", None)
        if failure is not None:
            return failure, 1
        reason = self.stuck() if self.stuck_since is not None else None  # as watch() found
        if reason is None and self.stuck_since is not None and not self._fresh():
            reason = "the coordinator answers again after a silence: waiting for its heartbeat"
        if reason is None and not getattr(self.client, "serving", True):
            reason = "the engine is not serving"
        return None if reason is None else (reason, 1)

    def _fresh(self) -> bool:
        """Whether the coordinator's serving flag arrived after the silence watch() found."""
        since = self.stuck_since
        return since is None or getattr(self.client, "serving_at", math.inf) > since

    def overloaded(self, choices: int) -> str | None:
        """Why ``choices`` more would overload the server (None: they fit)."""
        if self.max_waiting is None or self.open == 0:
            return None
        limit = self.resident + self.max_waiting
        if self.open + choices <= limit:
            return None
        return (
            f"the server is at its queue limit: {self.open} open requests (choices) and "
            f"{choices} more exceed {limit}, the {self.resident} the coordinator runs at "
            f"once plus --max-waiting-requests {self.max_waiting}; retry later"
        )

    def refusal(self, choices: int) -> Response | None:
        """The 503 or 429 answer for a request of ``choices`` (None: admitted)."""
        down = self.unavailable()
        if down is not None:
            reason, retry = down
            return _error(503, reason, None, "service_unavailable", retry_after=retry)
        reason = self.overloaded(choices)
        if reason is not None:
            return _error(
                429, reason, None, "rate_limit_error", code="rate_limit_exceeded", retry_after=1
            )
        return None

    async def watch(self) -> None:
        """Fail open requests while the coordinator is stuck; log its silence and return."""
        tick = min(0.25, self.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            if getattr(self.client, "failure", None) is not None:
                continue  # it said it failed and goes silent as it exits: serve.py's watch
            reason = self.stuck()
            if reason is not None and self.stuck_since is None:
                # Messages this process has not read yet (its own loop stalled) go first.
                await asyncio.sleep(CONFIRM_S)
                reason = self.stuck()
            if reason is not None:
                if self.stuck_since is None:
                    self.stuck_since = self.client.last_heard
                    log.error("%s: open requests fail, new ones get 503", reason)
                ended = self.client.fail_all(reason)
                if ended:
                    log.error("ended %d open requests: the coordinator is silent", ended)
            elif self.stuck_since is not None and self._fresh():
                silent = self.client.last_heard - self.stuck_since
                log.warning(
                    "the coordinator answers again after %.1f s of silence: %s (the "
                    "requests ended meanwhile stay ended)",
                    silent,
                    "new requests are served" if self.unavailable() is None else "not serving",
                )
                self.stuck_since = None


@dataclass
class Frontend:
    """What the routes share."""

    client: CoordinatorClient
    tokenizer: ModelTokenizer
    template: ChatTemplate
    limits: ServingLimits
    metrics: ServingMetrics
    # --api-key: one key, or several (a sequence, or a comma-separated string), each a
    # tenant with its own prefix-cache salt; None: no key needed.
    api_key: str | Sequence[str] | None = None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    created: int = field(default_factory=lambda: int(time.time()))
    debug: DebugLink | None = None  # --debug-endpoints: the /debug/* routes' link
    gate: Gate | None = None  # liveness, drain and overload (None: admit everything)
    # --preprocess-workers: where large bodies are prepared (None: in this process)
    preprocess: PreprocessPool | None = None


@dataclass
class Piece:
    """Part of one choice's output: new text, the tokens it accounts for, maybe the end."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    request_id: int
    fence: int
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens its request found in the prefix cache


class EngineRefused(Exception):
    """The coordinator refused a request before it produced anything."""


def _error(
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


# ------------------------------------------------------------------ generation


def _sampling(req: GenerationRequest, index: int, seed: int, vocab: int) -> SamplingParams:
    """Choice ``index``'s sampling; ProtocolError naming the field if out of range."""
    return SamplingParams(
        req.temperature,
        req.top_p,
        -1 if req.top_k >= vocab else req.top_k,  # top-k over the whole vocabulary: off
        (seed + index) % SEED_MODULUS,
        min_tokens=req.min_tokens,
        logprobs=-1 if req.logprobs is None else req.logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias,
    )


def _submit(fe: Frontend, req: GenerationRequest, index: int, seed: int, group: int):
    """Send choice ``index`` to the coordinator (at once, or queued in the client's
    outbox: never half-sent); its request id and output queue."""
    client = fe.client
    rid = client.new_request_id()
    queue = client.submit(
        rid,
        req.prompt_token_ids,
        req.max_tokens,
        _sampling(req, index, seed, fe.limits.vocab_size),
        req.ignore_eos,
        group=group,
        cache_salt=req.cache_salt,
        message_endpoints=submit_endpoints(req.message_endpoints, len(req.prompt_token_ids)),
    )
    return rid, queue


async def _choice(
    fe: Frontend, req: GenerationRequest, index: int, seed: int, group: int, submitted=None
):
    """One choice's pieces, in order; the last carries its finish reason.  ``group``:
    the HTTP request's admission group, shared by all its choices; ``submitted``:
    the choice's (request id, queue) from :func:`_submit` (None: submit it now)."""
    client = fe.client
    rid, queue = _submit(fe, req, index, seed, group) if submitted is None else submitted
    detok = IncrementalDetokenizer(
        fe.tokenizer,
        req.prompt_token_ids,
        req.stop,
        skip_special_tokens=req.skip_special_tokens,
        min_tokens=req.min_tokens,
        include_stop=req.include_stop_str_in_output,
    )
    stop_ids = frozenset(req.stop_token_ids)
    produced = 0
    cached = 0
    done = False
    try:
        while not done:
            item = await queue.get()
            if isinstance(item, LocalEnd):  # ended by the frontend itself
                if item.failed:  # the coordinator is gone: the work is lost, an error
                    raise CoordinatorLost(item.error)
                if item.error is not None:
                    raise CoordinatorGone(item.error)  # the coordinator stopped answering
                # The server stops: "abort", whether it ran or still waited for a slot.
                out = Output(rid, 0, finish_reason="aborted")
            else:
                out = item
                if out.finish_reason == "aborted" and produced == 0 and out.fence == 0:
                    # Refused on arrival: the engine was stopping or had failed.
                    why = getattr(client, "failure", None) or "the engine is not serving"
                    raise CoordinatorGone(why)
            if out.finish_reason == "refused":
                raise EngineRefused(out.error or "refused")
            if out.finish_reason == "error":
                raise RuntimeError(f"the engine failed: {out.error}")
            tokens, logprobs = out.token_ids, out.logprobs
            cached = max(cached, out.cached_tokens)
            finish = FINISH_REASONS.get(out.finish_reason or "")
            stop_at = next(
                (
                    j
                    for j, token in enumerate(tokens)
                    if token in stop_ids and produced + j + 1 > req.min_tokens
                ),
                None,
            )
            if stop_at is not None:  # the stop token counts; shown only with the stop strings
                tokens, logprobs, finish = tokens[: stop_at + 1], logprobs[: stop_at + 1], "stop"
                delta = detok.push(tokens if req.include_stop_str_in_output else tokens[:stop_at])
            else:
                delta = detok.push(tokens)
            text = delta.text
            if delta.stopped:  # a stop string: the text after it is dropped
                used = delta.num_tokens
                tokens, logprobs, finish = tokens[:used], logprobs[:used], "stop"
            elif finish is not None:
                tail = detok.finish()
                text += tail.text
                if tail.stopped:
                    finish = "stop"
            produced += len(tokens)
            done = finish is not None
            if done and not out.finished:
                with contextlib.suppress(CoordinatorGone):
                    client.cancel(rid)  # ended here: the coordinator stops selecting it
            yield Piece(index, text, tokens, logprobs, rid, out.fence, finish, cached)
    finally:
        if not done:
            with contextlib.suppress(CoordinatorGone):
                client.cancel(rid)  # the client went away (or an error): free its slot


def _choices(reqs: list[GenerationRequest]) -> list[tuple[GenerationRequest, int]]:
    """Every choice as (its prompt's request, its index): prompt i's choice j is
    ``i * n + j``, OpenAI's numbering for batched prompts."""
    return [(req, i * req.n + j) for i, req in enumerate(reqs) for j in range(req.n)]


async def _merged(fe: Frontend, reqs: list[GenerationRequest], seed: int) -> AsyncIterator[Piece]:
    """Pieces of every choice as they come; errors surface here.  The choices share
    one admission group, so the coordinator admits them round-robin with other
    HTTP requests' choices."""
    choices = _choices(reqs)
    group = fe.client.new_group_id()
    if len(choices) == 1:
        async for piece in _choice(fe, reqs[0], 0, seed, group):
            yield piece
        return
    # Every choice is sent (or queued in the client's outbox) before any is awaited,
    # with no await in between: all of them reach the coordinator, or none does.
    submitted: list[tuple[int, asyncio.Queue]] = []
    try:
        for req, index in choices:
            submitted.append(_submit(fe, req, index, seed, group))
    except BaseException:
        _cancel_all(fe, [rid for rid, _ in submitted])
        raise
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()
    started: set[int] = set()  # choices whose _choice runs (it cancels its own request)

    async def pump(req: GenerationRequest, index: int, sent: tuple[int, asyncio.Queue]) -> None:
        started.add(index)
        try:
            async for piece in _choice(fe, req, index, seed, group, sent):
                await queue.put(piece)
        except BaseException as exc:  # handed to the consumer
            await queue.put(exc)
            raise
        finally:
            await queue.put(None)

    tasks = [
        asyncio.create_task(pump(req, index, sent))
        for (req, index), sent in zip(choices, submitted)
    ]
    try:
        remaining = len(choices)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A task cancelled before it ran never reached its choice's own cancel.
        _cancel_all(fe, [sent[0] for (_, i), sent in zip(choices, submitted) if i not in started])


def _cancel_all(fe: Frontend, request_ids: list[int]) -> None:
    for rid in request_ids:
        with contextlib.suppress(CoordinatorGone):
            fe.client.cancel(rid)


class Usage:
    """A response's token counts.  ``prompt_tokens`` counts each prompt once, however
    many choices (n) it has; so does ``prompt_tokens_details.cached_tokens``: per
    prompt, the most prompt tokens any of its choices found in the prefix cache
    (each choice is its own coordinator request, and a later one may find pages an
    earlier one cached), summed over the prompts.  Always present (0: none found)."""

    def __init__(self, prompt_tokens: int, n: int = 1) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.n = n  # choices per prompt: choice i is prompt i // n's
        self._cached: dict[int, int] = {}

    def add(self, piece: Piece) -> None:
        """Count a piece's tokens and its request's cached prompt tokens."""
        self.completion_tokens += len(piece.token_ids)
        prompt = piece.index // self.n
        self._cached[prompt] = max(self._cached.get(prompt, 0), piece.cached_tokens)

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    def json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Timing:
    """Client-visible latency of one choice, for the metrics."""

    def __init__(self, fe: Frontend, arrived: float) -> None:
        self.fe, self.arrived = fe, arrived
        self.last: dict[int, float] = {}

    def tokens(self, piece: Piece) -> None:
        if not piece.token_ids:
            return
        now = time.perf_counter()
        m = self.fe.metrics
        if piece.index not in self.last:
            m.ttft.observe(now - self.arrived)
        else:
            m.itl.observe((now - self.last[piece.index]) / len(piece.token_ids))
        self.last[piece.index] = now
        m.generation_tokens.inc(len(piece.token_ids))

    def finished(self, piece: Piece) -> None:
        self.fe.metrics.e2e.observe(time.perf_counter() - self.arrived)
        self.fe.metrics.finished(piece.finish_reason or "abort")


# ------------------------------------------------------------------ logprobs


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


def _token_text(fe: Frontend, token: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or with vLLM's
    ``return_tokens_as_token_ids`` ``"token_id:{id}"`` (any token, JSON-safe)."""
    if as_id:
        return f"token_id:{token}"
    return fe.tokenizer.decode([token], skip_special_tokens=False)


def _completion_logprobs(
    fe: Frontend, piece: Piece, offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """``text_offset`` counts the tokens' text, also when they are named by id."""
    texts = [_token_text(fe, t) for t in piece.token_ids]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [_token_text(fe, t, True) for t in piece.token_ids] if as_ids else texts,
        "token_logprobs": [_lp(item.logprob) for item in piece.logprobs],
        "top_logprobs": [_top_by_text(fe, item, as_ids) for item in piece.logprobs],
        "text_offset": offsets,
    }


def _top_by_text(fe: Frontend, item: TokenLogprobs, as_ids: bool = False) -> dict[str, float]:
    """The legacy completions map, text -> logprob; tokens decoding to the same
    text (byte pieces) keep the best entry, so the map stays best-first.  With
    ``as_ids`` the keys are ``"token_id:{id}"``, one per alternative."""
    top: dict[str, float] = {}
    for token, value in zip(item.top_token_ids, item.top_logprobs):
        top.setdefault(_token_text(fe, token, as_ids), _lp(value))
    return top


def _chat_logprobs(fe: Frontend, piece: Piece, as_ids: bool = False) -> list[dict[str, Any]]:
    """With ``as_ids`` tokens are ``"token_id:{id}"``; as in vLLM, the sampled token's
    ``bytes`` stay its text's and an alternative's are those of its ``token`` string."""

    def entry(token: int, value: float, sampled: bool = False) -> dict[str, Any]:
        name = _token_text(fe, token, as_ids)
        text = _token_text(fe, token) if sampled and as_ids else name
        return {"token": name, "logprob": _lp(value), "bytes": list(text.encode())}

    return [
        {
            **entry(token, item.logprob, sampled=True),
            "top_logprobs": [entry(t, v) for t, v in zip(item.top_token_ids, item.top_logprobs)],
        }
        for token, item in zip(piece.token_ids, piece.logprobs)
    ]


def _merge_completion_logprobs(into: dict[str, Any] | None, more: dict[str, Any]) -> dict:
    if into is None:
        return more
    for key in into:
        into[key].extend(more[key])
    return into


# ------------------------------------------------------------------ responses


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), allow_nan=False)}\n\n"


def _seed(req: GenerationRequest) -> int:
    return req.seed if req.seed is not None else secrets.randbits(63)


def _usage(reqs: list[GenerationRequest]) -> Usage:
    return Usage(sum(len(req.prompt_token_ids) for req in reqs), reqs[0].n)  # each prompt once


async def _stream(
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
    req, total = reqs[0], len(_choices(reqs))
    seed = _seed(req)
    usage = _usage(reqs)
    timing = Timing(fe, arrived)
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": request_id, "object": kind, "created": int(time.time()), "model": req.model}
    offsets = [0] * total
    if chat:
        for i in range(total):
            yield _sse(
                {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
            )  # fmt: skip
    try:
        async for piece in _merged(fe, reqs, seed):
            usage.add(piece)
            timing.tokens(piece)
            if not piece.text and piece.finish_reason is None and req.logprobs is None:
                continue  # held back (stop-string prefix, partial character)
            logprobs = None
            if req.logprobs is not None and piece.token_ids:
                as_ids = req.return_tokens_as_token_ids
                if chat:
                    logprobs = {"content": _chat_logprobs(fe, piece, as_ids)}
                else:
                    logprobs = _completion_logprobs(fe, piece, offsets[piece.index], as_ids)
            offsets[piece.index] += len(piece.text)
            if chat:
                delta = {"content": piece.text} if piece.text else {}
                choice = {"index": piece.index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": piece.finish_reason}  # fmt: skip
            else:
                choice = {"index": piece.index, "text": piece.text, "logprobs": logprobs,
                          "finish_reason": piece.finish_reason}  # fmt: skip
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


async def _collect(
    fe: Frontend, reqs: list[GenerationRequest], chat: bool, request_id: str, arrived: float
) -> dict[str, Any]:
    req, total = reqs[0], len(_choices(reqs))
    seed = _seed(req)
    usage = _usage(reqs)
    timing = Timing(fe, arrived)
    texts = [""] * total
    finish: list[str | None] = [None] * total
    completion_lp: list[dict | None] = [None] * total
    chat_lp: list[list] = [[] for _ in range(total)]
    async for piece in _merged(fe, reqs, seed):
        usage.add(piece)
        timing.tokens(piece)
        if req.logprobs is not None and piece.token_ids:
            as_ids = req.return_tokens_as_token_ids
            if chat:
                chat_lp[piece.index] += _chat_logprobs(fe, piece, as_ids)
            else:
                more = _completion_logprobs(fe, piece, len(texts[piece.index]), as_ids)
                completion_lp[piece.index] = _merge_completion_logprobs(
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
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage.json(),
    }


async def _until_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


# ------------------------------------------------------------------ app


class ApiKeyMiddleware:
    """Every HTTP route but /health and /version needs ``Authorization: Bearer KEY``
    with one of ``keys``; the scheme is case-insensitive (``bearer KEY`` too), as HTTP
    auth schemes are.  ``salts``: each key's cache salt (:func:`tenant_salts`), left
    in the scope under TENANT_SALT_SCOPE_KEY for the routes.

    Plain ASGI rather than ``@app.middleware``: Starlette's BaseHTTPMiddleware
    hides client disconnects from the routes, and a route must see them to
    cancel the requests of a client that left.
    """

    def __init__(self, app, keys: Sequence[str], salts: dict[str, str] | None = None) -> None:
        if not keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self.expected = [key.encode() for key in keys]
        self.salts = [(salts or {}).get(key, "") for key in keys]

    def matched(self, header: bytes) -> int | None:
        """The index of the key the header carries (None: none).  Every key is
        compared, in constant time each, whichever matches."""
        scheme, _, credentials = header.strip().partition(b" ")
        credentials = credentials.strip()
        found = None
        for i, key in enumerate(self.expected):
            if secrets.compare_digest(credentials, key) and found is None:
                found = i
        return found if scheme.lower() == b"bearer" else None

    def authorized(self, header: bytes) -> bool:
        return self.matched(header) is not None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            found = self.matched(given)
            if found is None:
                response = _error(401, "missing or wrong API key", None, "authentication_error")
                await response(scope, receive, send)
                return
            scope[TENANT_SALT_SCOPE_KEY] = self.salts[found]
        await self.app(scope, receive, send)


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
        return _error(415, f"Content-Type must be application/json, got {content_type!r}")
    try:
        return await _read_body(request)
    except BodyTooLarge:
        TRIMMER.soon()  # what was read of it goes back to the system
        return _error(
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
    syntax).  Parsed on the event loop: for small bodies (see _prepared)."""
    body = await _body_bytes(request)
    if isinstance(body, Response):
        return body
    try:
        return parse_json(b"".join(body))
    except RequestError as exc:
        return JSONResponse(exc.to_json(), status_code=exc.status)


async def _prepared(
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


async def _rendered(content: dict[str, Any]) -> Response:
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


def _json_reply(result: dict[str, Any] | bytes) -> Response:
    """A prepared /tokenize or /detokenize answer: rendered here, or by a worker."""
    if isinstance(result, bytes):
        return Response(result, media_type="application/json")
    return JSONResponse(result)


def create_app(fe: Frontend) -> FastAPI:
    app = FastAPI(title="flare", docs_url=None, redoc_url=None, openapi_url=None)
    keys = api_keys(fe.api_key)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys, salts=tenant_salts(keys))
    # Size limits, then parsing and tokenizing (runtime.frontend.preprocess).
    preparer = Preparer(fe.limits, fe.tokenizer, fe.template, fe.defaults)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception):
        return _error(404, f"no route {request.method} {request.url.path}")

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception):
        return _error(405, f"{request.method} is not allowed on {request.url.path}")

    if fe.debug is not None:
        add_debug_routes(app, fe.debug)

    @app.get("/health")
    async def health() -> Response:
        gate = fe.gate
        if gate is not None:
            down = gate.unavailable()
            if down is not None:
                reason, retry = down
                return _error(503, reason, None, "service_unavailable", retry_after=retry)
            # The coordinator's latest word (its heartbeat or status), no round trip:
            # answers at once under load.  A failure, an exit, a silence or a heartbeat
            # saying the engine does not serve made unavailable() answer above.
            if fe.client.serving:
                return Response(status_code=200)
        try:
            status = await fe.client.query_status()
        except CoordinatorGone as exc:
            return _error(503, str(exc), None, "service_unavailable")
        if not status.serving:
            return _error(503, status.error or "the engine is not serving", None,
                          "service_unavailable")  # fmt: skip
        return Response(status_code=200)

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

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        result = await _prepared(fe, preparer, request, "tokenize")
        return result if isinstance(result, Response) else _json_reply(result)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        result = await _prepared(fe, preparer, request, "detokenize")
        return result if isinstance(result, Response) else _json_reply(result)

    async def generate(request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        gate = fe.gate
        # Refused before any parsing when it is certain (stuck, draining, full).
        refused = None if gate is None else gate.refusal(1)
        if refused is not None:
            return refused
        # Size limits, parsing, tokenizing: off the event loop unless small.
        prepared = await _prepared(fe, preparer, request, "chat" if chat else "completions")
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
            _sampling(req, 0, 0, fe.limits.vocab_size)
        except ProtocolError as exc:
            return _error(400, str(exc), exc.field)
        # The exact check, with the choices counted (no await between it and admission).
        refused = None if gate is None else gate.refusal(len(_choices(reqs)))
        if refused is not None:
            return refused
        ticket = Ticket(gate, len(_choices(reqs)))
        fe.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in reqs))
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            if req.stream:
                chunks = _stream(fe, reqs, chat, request_id, arrived, ticket)
                # A stream the server never starts (its client left first) is released
                # when collected.
                weakref.finalize(chunks, ticket.release)
                ticket = None  # the stream's now
                return StreamingResponse(chunks, media_type="text/event-stream")
            work = asyncio.create_task(_collect(fe, reqs, chat, request_id, arrived))
            watch = asyncio.create_task(_until_disconnect(request))
            try:
                await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not work.done():  # the client left: cancelling frees its requests
                    return Response(status_code=499)
                return await _rendered(work.result())
            finally:  # also when this handler itself is cancelled (shutdown)
                for task in (work, watch):
                    task.cancel()
                await asyncio.gather(work, watch, return_exceptions=True)
        except EngineRefused as exc:
            return _error(400, str(exc))
        except CoordinatorGone as exc:
            return _error(503, str(exc), None, "service_unavailable")
        except RuntimeError as exc:
            return _error(500, str(exc))
        finally:
            if ticket is not None:
                ticket.release()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app
