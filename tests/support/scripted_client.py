"""A stand-in for the frontend's coordinator client that answers every request with
a script of outputs, and what the tests read from an app's responses."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from runtime.frontend.client import CoordinatorGone
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.transport.api import Output, Status, Submit

MODEL = "tiny"


class ScriptedClient:
    """Stands in for CoordinatorClient: each request gets ``script`` as its outputs."""

    def __init__(self, script: list[Output], serving: bool = True, gone: bool = False) -> None:
        self.script = script
        self.serving = serving
        self.gone = gone
        self.published: list[tuple[int, int]] = []
        self.cancelled: list[int] = []
        self.submitted: list[int] = []
        self.groups: list[int | None] = []
        self.sampling: list = []
        self.prompts: list[tuple[int, ...]] = []
        self.submits: list[Submit] = []
        self._ids = iter(range(1, 1000))
        self._groups = iter(range(1, 1000))

    def new_request_id(self) -> int:
        return next(self._ids)

    def new_group_id(self) -> int:
        return next(self._groups)

    def submit(
        self,
        request_id,
        prompt,
        max_tokens,
        sampling,
        ignore_eos=False,
        group=None,
        *,
        cache_salt="",
        message_endpoints=(),
        prompt_logprobs=-1,
        images=(),
    ):
        # What CoordinatorClient would send: Submit validates the fields.
        self.submits.append(
            Submit(request_id, tuple(prompt), max_tokens, sampling, ignore_eos, group,
                   cache_salt=cache_salt, message_endpoints=message_endpoints,
                   prompt_logprobs=prompt_logprobs, images=images)
        )  # fmt: skip
        self.submitted.append(request_id)
        self.groups.append(group)
        self.sampling.append(sampling)
        self.prompts.append(tuple(prompt))
        queue: asyncio.Queue[Output] = asyncio.Queue()
        for out in self.script:
            queue.put_nowait(dataclasses.replace(out, request_id=request_id))
        return queue

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)

    def publish(self, request_id: int, fence: int, at_ns: int) -> None:
        self.published.append((request_id, fence))

    async def query_status(self, timeout_s: float = 2.0) -> Status:
        if self.gone:
            raise CoordinatorGone("no status")
        return Status(1, self.serving, MODEL, 512, 4096, 1, 4, kv_tokens=4096)


def script_for(tokenizer: ModelTokenizer, text: str, per_frame: int = 1) -> list[Output]:
    """The outputs of a request producing ``text`` (as the tokenizer splits it)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = [ids[i : i + per_frame] for i in range(0, len(ids), per_frame)]
    outs = [Output(0, 10 + i, tuple(c)) for i, c in enumerate(chunks)]
    last = outs[-1]
    outs[-1] = Output(0, last.fence, last.token_ids, "length")
    return outs


def sse(response) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
