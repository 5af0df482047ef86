"""Request preparation (JSON parsing, validation, chat templates, tokenization) kept
off the frontend's event loop, and the size limits that bound it.

Parsing JSON and tokenizing hold the GIL, so a thread does not help: while a
30 MB body is parsed and tokenized, every open stream and /health wait.  Here a
body is prepared in one of two places:

- inline, on the event loop, when it is small (at most ``INLINE_BODY_BYTES``)
  and cheap (its text times its chat messages, the tokenizer's work, at most
  ``INLINE_COST``): most requests, at no extra latency;
- otherwise in a :class:`PreprocessPool` worker, a ``python -m
  runtime.frontend.preprocess`` process (``--preprocess-workers``, default 2)
  that loaded the tokenizer, the chat template and the defaults once.  It gets the
  raw body bytes and answers the validated request(s) or the RequestError, as
  msgpack (nothing is pickled across processes; the frontend checks each field
  of the answer, :func:`requests_from_wire`).  /tokenize and /detokenize get
  their finished JSON response from it.

A worker runs at a lower CPU priority (``nice`` +10): a large body never takes
the CPU from the event loop, the coordinator or the ranks.  It is never wedged:
a job that runs over ``PREPARE_TIMEOUT_S`` is a 413 and the worker is killed and
replaced.  Its memory comes back: after a large job
it collects garbage and hands freed heap pages back (``malloc_trim``), and one
whose RSS still grew by more than ``RECYCLE_GROWTH_BYTES`` over its start is
replaced.  When every worker is busy, at most ``MAX_QUEUED_PER_WORKER`` large
requests per worker wait (each holds its body); beyond, 503 with Retry-After.

Limits (:func:`check_sizes`, before any tokenizing; every refusal is a 400
naming the limit, the body's own size a 413 in runtime.frontend.server):

- chat ``messages`` (also /tokenize's): at most ``MAX_MESSAGES``;
- a prompt's text: no longer than the context can hold (``max_context`` times the
  longest token's characters), as before;
- a prompt of token ids: at most ``max_context`` ids, counted before any id is
  looked at;
- /tokenize and /detokenize: ``TOKENIZE_CONTEXTS`` contexts' worth of text and
  tokens (/tokenize counts past the context, which is what it is for);
- a prompt with ``truncate_prompt_tokens`` (which keeps its last tokens) may be
  longer than the context: the body's size and the worker's time limit bound it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import fcntl
import gc
import json
import logging
import os
import signal
import struct
import sys
import time
import types
import typing
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack

from runtime.frontend.chat import ChatTemplate
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.protocol import (
    MAX_PROMPTS,
    GenerationRequest,
    RequestError,
    ServingLimits,
    parse_chat,
    parse_completions,
    parse_detokenize,
    parse_tokenize,
)
from runtime.frontend.tokenizer import ModelTokenizer

log = logging.getLogger("runtime.frontend")

__all__ = [
    "INLINE_BODY_BYTES",
    "INLINE_COST",
    "MAX_MESSAGES",
    "PREPARE_TIMEOUT_S",
    "ROUTES",
    "TOKENIZE_CONTEXTS",
    "Preparer",
    "PreprocessPool",
    "check_sizes",
    "release_memory",
    "requests_from_wire",
    "requests_to_wire",
]

ROUTES = ("completions", "chat", "tokenize", "detokenize")
INLINE_BODY_BYTES = 16 << 10  # bodies up to this size may be prepared on the event loop...
INLINE_COST = 32 << 10  # ...when the characters the tokenizer sees stay within this
MAX_MESSAGES = 4096  # chat messages of one request (Submit's message_endpoints bound)
TOKENIZE_CONTEXTS = 4  # /tokenize, /detokenize and truncated prompts: this many contexts
PREPARE_TIMEOUT_S = 30.0  # a worker's job: longer is a 413, and the worker is replaced
DEFAULT_WORKERS = 2
MAX_QUEUED_PER_WORKER = 4  # large requests waiting for a busy worker, per worker
RECYCLE_GROWTH_BYTES = 32 << 20  # a worker grown this much over its start is replaced
TRIM_BODY_BYTES = 1 << 20  # after a body this large, free heap pages go back to the system
WORKER_START_S = 120.0
WORKER_NICE = 10  # the workers' CPU priority below the frontend's, coordinator's and ranks'
MAX_FRAME_BYTES = 1 << 30
PIPE_BYTES = 1 << 20  # the pipe to a worker (Linux's default limit for one)
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_FRAME = struct.Struct(">II")  # header length, payload length; then msgpack header, payload


# ------------------------------------------------------------------ size limits


def _limit_error(message: str, param: str | None, code: str | None = None) -> RequestError:
    return RequestError(400, message, param, code=code)


def _text_len(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


def _messages_chars(messages: Any) -> int:
    """Characters of a messages list's text (its string contents and text parts)."""
    total = 0
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(_text_len(p.get("text")) for p in content if isinstance(p, dict))
    return total


def _truncating(obj: dict) -> bool:
    """Whether the body asks to truncate its prompt (a bad value is refused later,
    naming the field, rather than as a context overflow)."""
    return obj.get("truncate_prompt_tokens") is not None


def check_sizes(route: str, body: object, limits: ServingLimits, max_token_chars: int) -> None:
    """RequestError (400, naming the limit) for a body bigger than the work it may
    cause: see the module docstring.  Cheap: it counts, it converts nothing."""
    if not isinstance(body, dict):
        return  # the parser refuses it, naming the body
    context = limits.max_context
    wide = TOKENIZE_CONTEXTS * context  # /tokenize, /detokenize, truncated prompts
    messages = body.get("messages")
    if (
        route in ("chat", "tokenize")
        and isinstance(messages, list)
        and len(messages) > MAX_MESSAGES
    ):
        raise _limit_error(
            f"messages has {len(messages)} messages; this server takes at most "
            f"{MAX_MESSAGES} per request",
            "messages",
        )
    if route == "detokenize":
        tokens = body.get("tokens")
        if isinstance(tokens, list) and len(tokens) > wide:
            raise _limit_error(
                f"tokens has {len(tokens)} token ids; /detokenize takes at most {wide} "
                f"({TOKENIZE_CONTEXTS} x the model's maximum context of {context} tokens)",
                "tokens",
            )
        return
    if route == "tokenize":
        chars = _text_len(body.get("prompt")) + _messages_chars(messages)
        if chars > wide * max_token_chars:
            param = "messages" if body.get("prompt") is None else "prompt"
            raise _limit_error(
                f"{param} has {chars} characters, more than /tokenize's limit of {wide} "
                f"tokens ({TOKENIZE_CONTEXTS} x the model's maximum context of {context}) "
                f"can hold",
                param,
            )
        return
    # Generation: a prompt longer than the context cannot be served.  With
    # truncate_prompt_tokens it can (its last tokens are kept): only the body's size
    # and the worker's time limit bound it then.
    if _truncating(body):
        return
    what = f"the model's maximum context of {context} tokens"
    room = context
    if route == "chat":
        if _messages_chars(messages) > room * max_token_chars:
            raise _limit_error(
                f"messages is longer than {what}", "messages", code="context_length_exceeded"
            )
        return
    prompt = body.get("prompt")
    batch = (  # as parse_completions tells a batch (all() stops at the first id)
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(p, (str, list)) for p in prompt)
        and not (len(prompt) == 1 and isinstance(prompt[0], str))
    )
    if batch and len(prompt) > MAX_PROMPTS:
        return  # refused by the parser, naming the batch limit
    prompts = prompt if batch else [prompt]
    for i, one in enumerate(prompts):
        param = f"prompt[{i}]" if batch else "prompt"
        if isinstance(one, str) and len(one) > room * max_token_chars:
            raise _limit_error(
                f"{param} is longer than {what}", param, code="context_length_exceeded"
            )
        if isinstance(one, list) and len(one) > room:
            raise _limit_error(
                f"{param} has {len(one)} token ids, more than {what}",
                param,
                code="context_length_exceeded",
            )


def inline_cost(route: str, body: object, size: int) -> int:
    """The characters the tokenizer would go through for this body, roughly: a chat
    request encodes its conversation once per message (its prefix-cache anchors)."""
    if route == "chat" and isinstance(body, dict) and isinstance(body.get("messages"), list):
        return size * (1 + len(body["messages"]))
    return size


# ------------------------------------------------------------------ preparation


class Preparer:
    """What preparing a body needs: the limits, tokenizer, chat template and defaults."""

    def __init__(
        self,
        limits: ServingLimits,
        tokenizer: ModelTokenizer,
        template: ChatTemplate,
        defaults: GenerationDefaults,
    ) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.template = template
        self.defaults = defaults
        self.max_token_chars = tokenizer.max_token_chars

    def run(self, route: str, body: object) -> list[GenerationRequest] | dict[str, Any]:
        """The requests of a generation route, or the response of /tokenize and
        /detokenize; RequestError for anything invalid or over a limit."""
        check_sizes(route, body, self.limits, self.max_token_chars)
        if route == "chat":
            return [parse_chat(body, self.limits, self.tokenizer, self.template, self.defaults)]
        if route == "completions":
            return parse_completions(body, self.limits, self.tokenizer, self.defaults)
        if route == "tokenize":
            return self._tokenize(body)
        if route == "detokenize":
            ids = parse_detokenize(body, self.limits)
            return {"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)}
        raise ValueError(f"no route {route!r}")

    def _tokenize(self, body: object) -> dict[str, Any]:
        ids, token_strs = parse_tokenize(body, self.limits, self.tokenizer, self.template)
        wide = TOKENIZE_CONTEXTS * self.limits.max_context
        if len(ids) > wide:
            given = isinstance(body, dict) and body.get("prompt") is not None
            param = "prompt" if given else "messages"
            raise _limit_error(
                f"{param} encodes to {len(ids)} tokens; /tokenize counts at most {wide} "
                f"({TOKENIZE_CONTEXTS} x the model's maximum context of "
                f"{self.limits.max_context})",
                param,
            )
        strs = None
        if token_strs:
            strs = [self.tokenizer.backend.id_to_token(t) or "" for t in ids]
        return {
            "count": len(ids),
            "max_model_len": self.limits.max_context,
            "tokens": ids,
            "token_strs": strs,
        }


def parse_json(body: bytes) -> object:
    """The body's JSON; RequestError 400 when it is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise RequestError(400, f"body is not valid JSON: {str(exc)[:200]}", None) from None


def render_json(content: Any) -> bytes:
    """JSON as Starlette's JSONResponse renders it."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


# ------------------------------------------------------------------ wire


class WireError(ValueError):
    """A worker's answer that does not check out."""


def _union_args(tp: Any) -> tuple | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _encode(tp: Any, value: Any) -> Any:
    """``value`` (of dataclass field type ``tp``) as msgpack takes it: int tuples as
    packed 64-bit arrays, other tuples as lists."""
    args = _union_args(tp)
    if args is not None:
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _encode(inner, value)
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)
        if len(inner) == 2 and inner[1] is Ellipsis:
            if inner[0] is int:
                return array("q", value).tobytes()
            return [_encode(inner[0], v) for v in value]
        return [_encode(t, v) for t, v in zip(inner, value)]
    if tp in (int, float, bool, str):
        return value
    raise TypeError(f"no wire form for {tp!r}")


def _decode(tp: Any, value: Any, name: str) -> Any:
    """The inverse of :func:`_encode`, checking every type (WireError naming ``name``)."""
    args = _union_args(tp)
    if args is not None:
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value, name)
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)
        if len(inner) == 2 and inner[1] is Ellipsis:
            if inner[0] is int:
                if not isinstance(value, bytes) or len(value) % 8:
                    raise WireError(f"{name}: expected packed 64-bit ints")
                return tuple(array("q", value))
            if not isinstance(value, (list, tuple)):
                raise WireError(f"{name}: expected a list")
            return tuple(_decode(inner[0], v, name) for v in value)
        if not isinstance(value, (list, tuple)) or len(value) != len(inner):
            raise WireError(f"{name}: expected {len(inner)} items")
        return tuple(_decode(t, v, name) for t, v in zip(inner, value))
    if tp is float and type(value) in (int, float):
        return float(value)
    if tp in (int, bool, str) and type(value) is tp:
        return value
    raise WireError(f"{name}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_HINTS: dict[type, dict[str, Any]] = {}


def to_wire(obj: Any) -> dict[str, Any]:
    """A flat frozen dataclass (GenerationRequest, ServingLimits, ...) as a msgpack map."""
    cls = type(obj)
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, _hints(cls))
    return {f.name: _encode(hints[f.name], getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def from_wire(cls: type, data: Any) -> Any:
    """``cls`` from :func:`to_wire`'s map, every field checked (missing ones take
    their defaults); WireError when something does not check out."""
    if not isinstance(data, dict):
        raise WireError(f"{cls.__name__}: expected a map")
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, _hints(cls))
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise WireError(f"{cls.__name__}: unknown fields {sorted(map(str, unknown))}")
    values = {name: _decode(hints[name], value, name) for name, value in data.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise WireError(f"{cls.__name__}: {exc}") from None


def requests_to_wire(reqs: Sequence[GenerationRequest]) -> list[dict[str, Any]]:
    return [to_wire(r) for r in reqs]


def requests_from_wire(data: Any, limits: ServingLimits) -> list[GenerationRequest]:
    """A worker's requests, checked: every field's type, and the token ids in the
    vocabulary and within the context."""
    if not isinstance(data, (list, tuple)) or not data:
        raise WireError("requests: expected a non-empty list")
    out = []
    for item in data:
        req = from_wire(GenerationRequest, item)
        ids = req.prompt_token_ids
        if not ids or len(ids) >= max(limits.max_context, 1) + 1:
            raise WireError("prompt_token_ids: empty, or longer than the context")
        if min(ids) < 0 or max(ids) >= limits.vocab_size:
            raise WireError("prompt_token_ids: outside the vocabulary")
        out.append(req)
    return out


def error_to_wire(exc: RequestError) -> dict[str, Any]:
    return {
        "status": exc.status,
        "message": exc.message,
        "param": exc.param,
        "type": exc.type,
        "code": exc.code,
    }


def error_from_wire(data: Any) -> RequestError:
    if not isinstance(data, dict):
        raise WireError("error: expected a map")
    status = data.get("status")
    if type(status) is not int or not 400 <= status < 600:
        raise WireError("error: bad status")
    message, kind = data.get("message"), data.get("type")
    if not isinstance(message, str) or not isinstance(kind, str):
        raise WireError("error: bad message or type")
    param, code = data.get("param"), data.get("code")
    if not (param is None or isinstance(param, str)) or not (code is None or isinstance(code, str)):
        raise WireError("error: bad param or code")
    return RequestError(status, message, param, kind, code=code)


Body = bytes | Sequence[bytes]  # a body whole, or in the chunks it arrived in


def body_size(body: Body) -> int:
    return len(body) if isinstance(body, bytes) else sum(len(chunk) for chunk in body)


def body_bytes(body: Body) -> bytes:
    return body if isinstance(body, bytes) else b"".join(body)


def _pack_frame(header: dict[str, Any], payload: bytes = b"") -> list[bytes]:
    head = msgpack.packb(header, use_bin_type=True)
    return [_FRAME.pack(len(head), len(payload)), head, payload]


def _unpack_header(data: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("the header is not a map")
    return header


# ------------------------------------------------------------------ memory


def _libc_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc keeps what a large
    body freed); a no-op without glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def rss_bytes(pid: int | None = None) -> int:
    """A process's resident set size (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Trimmer:
    """malloc_trim once, a moment after the last large body (not once per body)."""

    def __init__(self) -> None:
        self.handle: asyncio.TimerHandle | None = None

    def soon(self, delay_s: float = 0.5) -> None:
        loop = asyncio.get_running_loop()
        if self.handle is not None:
            self.handle.cancel()
        self.handle = loop.call_later(delay_s, self._run)

    def _run(self) -> None:
        self.handle = None
        release_memory()


TRIMMER = _Trimmer()


# ------------------------------------------------------------------ the pool (frontend)


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.ready_rss = 0
        self.jobs = 0

    async def send(self, header: dict[str, Any], payload: Body = b"") -> None:
        """A frame; the payload slice by slice, so no copy of a large body is made
        (nor a long memcpy on the event loop)."""
        stdin = self.proc.stdin
        assert stdin is not None
        head = msgpack.packb(header, use_bin_type=True)
        stdin.write(_FRAME.pack(len(head), body_size(payload)) + head)
        for chunk in [payload] if isinstance(payload, bytes) else payload:
            view = memoryview(chunk)
            for start in range(0, len(view), PIPE_BYTES):
                stdin.write(view[start : start + PIPE_BYTES])
                await stdin.drain()
        await stdin.drain()

    async def receive(self) -> tuple[dict[str, Any], bytes]:
        stdout = self.proc.stdout
        assert stdout is not None
        size_head, size_payload = _FRAME.unpack(await stdout.readexactly(_FRAME.size))
        if size_head > MAX_FRAME_BYTES or size_payload > MAX_FRAME_BYTES:
            raise WireError("a frame over the size limit")
        header = _unpack_header(await stdout.readexactly(size_head))
        payload = await stdout.readexactly(size_payload) if size_payload else b""
        return header, payload

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


class PreprocessPool:
    """``workers`` preprocessing processes (see the module docstring); :meth:`start`
    before use (it waits until they are ready), :meth:`close` at the end."""

    def __init__(
        self,
        limits: ServingLimits,
        template: ChatTemplate,
        defaults: GenerationDefaults,
        model_dir: str,
        workers: int = DEFAULT_WORKERS,
        timeout_s: float = PREPARE_TIMEOUT_S,
        max_queued: int | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.limits = limits
        self.size = workers
        self.timeout_s = timeout_s
        self.max_queued = workers * MAX_QUEUED_PER_WORKER if max_queued is None else max_queued
        self.config = {
            "model_dir": str(model_dir),
            "limits": to_wire(limits),
            "template": to_wire(template),
            "defaults": to_wire(defaults),
        }
        self.workers: set[_Worker] = set()
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self.waiting = 0
        self.replaced = 0  # workers killed (time limit, death) or recycled (memory)
        self.closed = False
        self._tasks: set[asyncio.Task] = set()

    # -------------------------------------------------------------- life

    async def start(self) -> None:
        workers = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        for worker in workers:
            self.idle.put_nowait(worker)

    async def _spawn(self) -> _Worker:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = f"{root}{os.pathsep}{path}" if path else root
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "runtime.frontend.preprocess",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            limit=1 << 20,
        )
        _widen_pipe(proc.stdin)
        worker = _Worker(proc)
        self.workers.add(worker)
        try:
            await worker.send(self.config)
            header, _ = await asyncio.wait_for(worker.receive(), WORKER_START_S)
            if header.get("ready") is not True:
                raise WireError(f"not ready: {header.get('error')}")
            rss = header.get("rss")
            worker.ready_rss = rss if type(rss) is int else 0
        except BaseException:
            self._discard(worker)
            raise
        return worker

    def _discard(self, worker: _Worker) -> None:
        self.workers.discard(worker)
        worker.kill()
        if worker.proc.stdin is not None:
            worker.proc.stdin.close()
        self._background(worker.proc.wait())

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _replace(self, worker: _Worker, why: str) -> None:
        """Kill ``worker`` and start another in its place (in the background)."""
        self.replaced += 1
        self._discard(worker)
        if not self.closed:
            log.warning("preprocessing worker %d replaced: %s", worker.proc.pid, why)
            self._background(self._respawn())

    async def _respawn(self) -> None:
        delay = 0.5
        while not self.closed:
            try:
                worker = await self._spawn()
            except Exception as exc:
                log.error("a preprocessing worker failed to start (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            if self.closed:
                self._discard(worker)
            else:
                self.idle.put_nowait(worker)
            return

    async def close(self) -> None:
        self.closed = True
        for worker in list(self.workers):
            if worker.proc.stdin is not None:
                worker.proc.stdin.close()  # EOF: it exits
        for worker in list(self.workers):
            try:
                await asyncio.wait_for(worker.proc.wait(), 2.0)
            except asyncio.TimeoutError:
                worker.kill()
                await worker.proc.wait()
        self.workers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc.returncode is None]

    # -------------------------------------------------------------- jobs

    async def prepare(self, route: str, body: Body) -> list[GenerationRequest] | bytes:
        """The requests of a generation route's body, or the JSON response of a
        /tokenize or /detokenize body; RequestError for an invalid one or when the
        pool is overloaded (503) or the job overran its time (413)."""
        if self.waiting >= self.max_queued + self.size:
            raise RequestError(
                503,
                f"the server is preparing too many large requests ({self.waiting}); retry later",
                None,
                "service_unavailable",
            )
        self.waiting += 1
        try:
            try:
                worker = await asyncio.wait_for(self.idle.get(), self.timeout_s)
            except asyncio.TimeoutError:
                raise RequestError(
                    503,
                    f"no preprocessing worker was free within {self.timeout_s:g} s; retry later",
                    None,
                    "service_unavailable",
                ) from None
            # Shielded: a handler cancelled meanwhile leaves the job to finish (or be
            # timed out) and the worker to go back to the pool.
            job = asyncio.ensure_future(self._job(worker, route, body))
            job.add_done_callback(_retrieved)
            result, error = await asyncio.shield(job)
            del job  # (no reference cycle through a traceback keeps the body alive)
        finally:
            self.waiting -= 1
        if error is not None:
            try:
                raise error
            finally:  # no cycle (error -> traceback -> this frame -> error) holds the body
                error = None
        return result

    async def _job(
        self, worker: _Worker, route: str, body: Body
    ) -> tuple[Any, RequestError | None]:
        """(the result, None) or (None, the error): nothing raised, so no traceback
        (holding this frame, and the body) outlives the job in the task."""
        started = time.monotonic()
        try:
            header, payload = await asyncio.wait_for(
                self._exchange(worker, route, body), self.timeout_s
            )
        except asyncio.TimeoutError:
            self._replace(worker, f"a {route} job ran over {self.timeout_s:g} s")
            return None, RequestError(
                413,
                f"the request took more than {self.timeout_s:g} s to prepare (parse, render, "
                "tokenize): it is too large for this server",
                None,
                code="request_too_large",
            )
        except (OSError, EOFError, asyncio.IncompleteReadError, WireError) as exc:
            code = worker.proc.returncode
            self._replace(worker, f"it failed ({type(exc).__name__}; exit code {code})")
            return None, RequestError(
                500, "the request's preprocessing worker failed", None, "server_error"
            )
        finally:
            if body_size(body) >= TRIM_BODY_BYTES:
                TRIMMER.soon()
        worker.jobs += 1
        rss = header.get("rss")
        if type(rss) is int and rss > worker.ready_rss + RECYCLE_GROWTH_BYTES:
            self._replace(
                worker, f"its memory grew to {rss >> 20} MiB ({worker.ready_rss >> 20} at start)"
            )
        elif worker in self.workers:
            self.idle.put_nowait(worker)
        elapsed = time.monotonic() - started
        if elapsed > 1.0:
            log.info("a %d-byte %s body took %.1f s to prepare", body_size(body), route, elapsed)
        try:
            return self._result(route, header, payload)
        except WireError as exc:
            log.error("a preprocessing worker answered badly: %s", exc)
            return None, RequestError(
                500, "the request's preprocessing worker answered badly", None, "server_error"
            )

    @staticmethod
    async def _exchange(worker: _Worker, route: str, body: Body) -> tuple[dict[str, Any], bytes]:
        await worker.send({"route": route}, body)
        return await worker.receive()

    def _result(self, route: str, header: dict[str, Any], payload: bytes):
        """(the result, None) or (None, the request's error); WireError for a bad answer."""
        if "error" in header:
            return None, error_from_wire(header["error"])
        if route in ("tokenize", "detokenize"):
            if header.get("json") is not True:
                raise WireError("expected a JSON response")
            return payload, None
        return requests_from_wire(header.get("requests"), self.limits), None


def _widen_pipe(writer: asyncio.StreamWriter | None) -> None:
    """Linux: a 1 MiB pipe to the worker (not 64 KiB): a large body crosses in
    fewer event-loop turns."""
    pipe = writer.get_extra_info("pipe") if writer is not None else None
    if pipe is not None:
        with contextlib.suppress(OSError, ValueError):
            fcntl.fcntl(pipe.fileno(), F_SETPIPE_SZ, PIPE_BYTES)


def _retrieved(task: asyncio.Future) -> None:
    """A job's outcome counts as seen (its handler may have gone)."""
    if not task.cancelled():
        task.exception()


def _die_with_parent() -> None:
    """Linux: the worker gets SIGKILL if the frontend dies (no orphans)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# ------------------------------------------------------------------ inline or pooled


async def prepare_body(
    preparer: Preparer, pool: PreprocessPool | None, route: str, body: Body
) -> list[GenerationRequest] | dict[str, Any] | bytes:
    """The prepared body (:meth:`Preparer.run`'s result, or a worker's JSON bytes for
    /tokenize and /detokenize), from inline or from the pool (module docstring);
    RequestError when it is invalid or over a limit.  ``body``: whole, or in the
    chunks it arrived in (a large one goes to a worker without being joined)."""
    size = body_size(body)
    if pool is not None and size > INLINE_BODY_BYTES:
        return await pool.prepare(route, body)
    data = body_bytes(body)
    if pool is None and size > INLINE_BODY_BYTES:  # no pool: a thread, as good as it gets
        return await asyncio.to_thread(_parse_and_run, preparer, route, data)
    obj = parse_json(data)
    if pool is None:
        return preparer.run(route, obj)
    if inline_cost(route, obj, size) > INLINE_COST:
        return await pool.prepare(route, data)
    return preparer.run(route, obj)


def _parse_and_run(preparer: Preparer, route: str, data: bytes):
    return preparer.run(route, parse_json(data))


# ------------------------------------------------------------------ the worker process


def _read_frame(stream) -> tuple[dict[str, Any], bytes] | None:
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    size_head, size_payload = _FRAME.unpack(head)
    header = _unpack_header(stream.read(size_head))
    payload = stream.read(size_payload) if size_payload else b""
    if len(payload) < size_payload:
        return None
    return header, payload


def _write_frame(stream, header: dict[str, Any], payload: bytes = b"") -> None:
    for part in _pack_frame(header, payload):
        stream.write(part)
    stream.flush()


def _handle(preparer: Preparer, route: Any, payload: bytes) -> tuple[dict[str, Any], bytes]:
    if route not in ROUTES:
        return {"error": error_to_wire(RequestError(500, "unknown route", None))}, b""
    try:
        result = preparer.run(route, parse_json(payload))
    except RequestError as exc:
        return {"error": error_to_wire(exc)}, b""
    if isinstance(result, dict):
        return {"json": True}, render_json(result)
    return {"requests": requests_to_wire(result)}, b""


def worker_main() -> int:
    """``python -m runtime.frontend.preprocess``: frames on stdin, answers on stdout."""
    from runtime.logs import basic_config

    basic_config(logging.WARNING, "[preprocess] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend ends it (EOF, or a kill)
    with contextlib.suppress(OSError):  # background work: the event loop and ranks go first
        os.nice(WORKER_NICE)
    stdin = sys.stdin.buffer
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, never into the answers
    sys.stdout = sys.stderr
    frame = _read_frame(stdin)
    if frame is None:
        return 0
    config, _ = frame
    try:
        tokenizer = ModelTokenizer.from_dir(config["model_dir"])
        preparer = Preparer(
            from_wire(ServingLimits, config["limits"]),
            tokenizer,
            from_wire(ChatTemplate, config["template"]),
            from_wire(GenerationDefaults, config["defaults"]),
        )
    except Exception as exc:
        _write_frame(stdout, {"ready": False, "error": str(exc)[:500]})
        return 1
    gc.collect()
    release_memory()
    _write_frame(stdout, {"ready": True, "rss": rss_bytes()})
    while True:
        frame = _read_frame(stdin)
        if frame is None:
            return 0
        header, payload = frame
        try:
            answer, out = _handle(preparer, header.get("route"), payload)
        except Exception as exc:  # a bug: one line, and the request gets a 500
            log.error("preparing a %s body failed: %r", header.get("route"), exc)
            answer, out = {"error": error_to_wire(RequestError(500, str(exc)[:300], None))}, b""
        big = len(payload) >= TRIM_BODY_BYTES
        del payload, frame
        if big:
            gc.collect()
            release_memory()
        answer["rss"] = rss_bytes()
        _write_frame(stdout, answer, out)


if __name__ == "__main__":
    sys.exit(worker_main())
