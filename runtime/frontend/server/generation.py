"""A generation request's choices at the coordinator: each choice is submitted as
its own request (seeds ``seed``, ``seed + 1``, ...), its outputs detokenized
incrementally into :class:`Piece` objects; stop strings hold text back until they
are ruled out, and stop token ids end a choice.  A choice that ends on the
frontend (stop string, stop token) or whose client disconnects is cancelled at
the coordinator, which stops selecting it at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from runtime.frontend.client import CoordinatorGone, CoordinatorLost, LocalEnd
from runtime.frontend.detokenizer import IncrementalDetokenizer
from runtime.frontend.protocol.requests import GenerationRequest
from runtime.frontend.server.state import Frontend
from runtime.transport.api import Output, TokenLogprobs
from runtime.transport.images import SubmitImage
from runtime.transport.sampling import SamplingParams

SEED_MODULUS = 1 << 63
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "aborted": "abort"}
MAX_MESSAGE_ENDPOINTS = 4096  # Submit's bound on message_endpoints


def submit_endpoints(ends: Sequence[int], prompt_len: int) -> tuple[int, ...]:
    """Chat message endpoints as ``Submit`` takes them: strictly increasing, each in
    [1, prompt_len] (a message that adds no token of its own gives no anchor), at
    most MAX_MESSAGE_ENDPOINTS (the last ones: the longest prefixes)."""
    out = sorted({end for end in ends if 1 <= end <= prompt_len})
    return tuple(out[-MAX_MESSAGE_ENDPOINTS:])


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
    # A scored prompt's entries (every prompt token after the first), on the
    # choice's first piece (Output.prompt_logprobs).
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class EngineRefused(Exception):
    """The coordinator refused a request before it produced anything."""


# ------------------------------------------------------------------ generation


def sampling_params(req: GenerationRequest, index: int, seed: int, vocab: int) -> SamplingParams:
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
    images = {"images": submit_images(req)} if req.images else {}  # text: as before
    queue = client.submit(
        rid,
        req.prompt_token_ids,
        req.max_tokens,
        sampling_params(req, index, seed, fe.limits.vocab_size),
        req.ignore_eos,
        group=group,
        cache_salt=req.cache_salt,
        message_endpoints=submit_endpoints(req.message_endpoints, len(req.prompt_token_ids)),
        prompt_logprobs=req.scored_k,
        **images,
    )
    return rid, queue


def submit_images(req: GenerationRequest) -> tuple[SubmitImage, ...]:
    """The request's images as ``Submit`` carries them: each one's span and pixels
    (the coordinator recomputes each digest from the pixels)."""
    return tuple(
        SubmitImage(span.start, span.length, span.digest, image.pixels, image.shape, image.dtype)
        for span, image in zip(req.image_spans, req.images, strict=True)
    )


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
            yield Piece(
                index, text, tokens, logprobs, rid, out.fence, finish, cached,
                out.prompt_logprobs,
            )  # fmt: skip
    finally:
        if not done:
            with contextlib.suppress(CoordinatorGone):
                client.cancel(rid)  # the client went away (or an error): free its slot


def choices_of(reqs: list[GenerationRequest]) -> list[tuple[GenerationRequest, int]]:
    """Every choice as (its prompt's request, its index): prompt i's choice j is
    ``i * n + j``, OpenAI's numbering for batched prompts."""
    return [(req, i * req.n + j) for i, req in enumerate(reqs) for j in range(req.n)]


async def merged_pieces(
    fe: Frontend, reqs: list[GenerationRequest], seed: int
) -> AsyncIterator[Piece]:
    """Pieces of every choice as they come; errors surface here.  The choices share
    one admission group, so the coordinator admits them round-robin with other
    HTTP requests' choices."""
    choices = choices_of(reqs)
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
