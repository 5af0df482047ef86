"""The rank worker: receive a frame, run its prepared program, publish a completion.

Every rank of the tensor-parallel group runs the same program on the same frame
(the collectives inside the model keep them in step).  Rank 0's sampled tokens
are the ones reported; sampling is a pure function of the logits and the
request's (seed, step), so every rank's slot table holds the same pending tokens.
Every rank reports its own device interval; the coordinator takes the maximum.

When a lane of the frame asks for log probabilities (``sampling.logprobs >= 0``),
rank 0 adds the ``logprobs`` and ``logprob_token_ids`` sidecars (see
:class:`~runtime.transport.schema.Completion`); otherwise nothing extra is read
back from the device.

A mixed frame (one prompt row, ``Frame.prompt_row``, and decode rows) runs like
any other: its prompt row commits its whole chunk and, when the chunk ends the
prompt, one first token; each decode row commits one token.

Logit bias and penalties (``SamplingParams``) are applied inside the programs,
over per-slot state the programs keep on the device (``PreparedProgram``); a
lane whose ``logit_bias`` names a token outside the vocabulary is refused.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable

from runtime.catalog import GraphDescriptor
from runtime.ranks.capacity import CapacityConfig, build_catalog
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.programs import PreparedProgram, ProgramError, prepare_programs
from runtime.ranks.slots import FrameError, SlotTable
from runtime.transport.schema import (
    CatalogReport,
    Completion,
    Control,
    Frame,
    LaneResult,
    Tensor,
    tensor_from_torch,
)

log = logging.getLogger("runtime.ranks")


class RankWorker:
    def __init__(
        self,
        model: LlamaForCausalLM,
        capacity: CapacityConfig,
        *,
        num_pages: int,
        page_size: int,
        rank: int = 0,
        world_size: int = 1,
        model_name: str = "model",
        capture: bool = True,
        progress: Callable[[Iterable], Iterable] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.page_size = page_size
        self.num_pages = num_pages
        self.model_name = model_name
        config = model.config
        # Captured programs attend over the whole context width: cap it.
        self.max_context = min(config.max_position_embeddings, max_model_len or 1 << 62)
        self.eos_ids = frozenset(config.eos_token_ids)
        self.catalog: list[GraphDescriptor] = build_catalog(capacity, self.max_context)
        model.allocate_kv_cache(num_pages, page_size)
        self.programs: dict[tuple, PreparedProgram] = prepare_programs(
            self.catalog, model, page_size, self.max_context, capture=capture, progress=progress
        )
        # Slots are cheap on a rank: hold the protocol bound, so any coordinator
        # concurrency up to 64 fits whatever decode buckets were captured.
        self.slots = SlotTable(64)
        self.frames = 0
        # FLARE_DEBUG_DELAY_NS_RANK<r>: this rank sleeps that long in every frame
        # and reports it as device time (a slow-rank drill).
        self.debug_delay_ns = int(os.environ.get(f"FLARE_DEBUG_DELAY_NS_RANK{rank}", "0"))

    def report(self) -> CatalogReport:
        return CatalogReport(
            rank=self.rank,
            world_size=self.world_size,
            descriptors=tuple(self.catalog),
            vocab_size=self.model.config.vocab_size,
            max_context=self.max_context,
            page_size=self.page_size,
            num_pages=self.num_pages,
            model_name=self.model_name,
        )

    def execute(self, frame: Frame) -> Completion:
        """Run one frame; raises FrameError / ProgramError with nothing changed."""
        program = self.programs.get(frame.program.key)
        if program is None:
            raise ProgramError(f"fence {frame.fence}: program {frame.program.describe()} unknown")
        inputs = self.slots.prepare(frame)
        vocab = self.model.config.vocab_size
        for i, (inp, lane) in enumerate(zip(inputs, frame.lanes)):
            if inp.start_position + len(inp.tokens) > self.max_context:
                raise FrameError(f"fence {frame.fence}: slot {inp.slot} exceeds the context")
            # Bias ids index the logits: one outside the vocabulary is refused here
            # (decode lanes reuse the settings their prefill brought, checked then).
            outside = [token for token, _ in inp.sampling.logit_bias if token >= vocab]
            if outside:
                raise FrameError(
                    f"fence {frame.fence}: lane {i}: logit_bias token id {outside[0]} is "
                    f"outside the vocabulary [0, {vocab})"
                )
            # Page ids are non-negative by schema; a decode lane without a table
            # reuses the one its prefill brought (checked then).
            if lane.page_table and max(lane.page_table) >= self.num_pages:
                raise FrameError(f"fence {frame.fence}: slot {inp.slot} names a page out of range")
        if not inputs:  # an empty frame: releases only, no program runs
            self.slots.commit(frame, inputs, [])
            return Completion(frame.fence, self.rank, self.world_size, device_ns=0)
        # The most log probabilities a lane asks for; -1: none (no readback).
        top = max(inp.sampling.logprobs for inp in inputs) if self.rank == 0 else -1
        tokens, device_ns = program.run(inputs, logprobs=top >= 0, prompt_row=frame.prompt_row)
        if self.debug_delay_ns:  # a deliberately slow rank, for debugging and tests
            time.sleep(self.debug_delay_ns / 1e9)
            device_ns += self.debug_delay_ns
        self.slots.commit(frame, inputs, tokens)
        self.frames += 1
        lanes: tuple[LaneResult, ...] = ()
        sidecars: dict[str, Tensor] = {}
        if top >= 0:
            k = min(top, program.outputs.max_logprobs)
            values, ids = program.logprobs(len(inputs), k)
            sidecars["logprobs"] = tensor_from_torch(values)  # (R, 1 + k) float32
            sidecars["logprob_token_ids"] = tensor_from_torch(ids)  # (R, k) int32
        if self.rank == 0:
            lanes = tuple(
                LaneResult(
                    inp.slot,
                    inp.generation,
                    (tok,) if inp.samples else (),
                    "stop" if inp.samples and tok in self.eos_ids else None,
                )
                for inp, tok in zip(inputs, tokens)
            )
        return Completion(
            fence=frame.fence,
            rank=self.rank,
            world_size=self.world_size,
            device_ns=device_ns,
            readiness_delay_ns=0,
            lanes=lanes,
            sidecars=sidecars,
        )

    def serve(self, channel, spin_us: int = 0) -> None:
        """Answer frames until a shutdown control arrives.

        ``spin_us``: after each completion, busy-poll that long for the next
        frame before blocking (the coordinator usually sends it within a round
        trip, and waking a blocked process costs more than the spin).
        """
        channel.send(self.report())
        spin = 0
        while True:
            message = channel.recv(timeout_ms=1000, spin_us=spin)
            spin = 0
            if message is None:
                continue
            if isinstance(message, Control):
                if message.command == "shutdown":
                    return
                continue
            if not isinstance(message, Frame):
                log.warning("rank %d: ignoring %s", self.rank, type(message).__name__)
                continue
            try:
                completion = self.execute(message)
            except (FrameError, ProgramError) as exc:
                # A frame this rank cannot run is a coordinator bug: say so at once
                # (the slot state is unchanged) so the coordinator fails fast.
                log.error("rank %d: rejected frame %d: %s", self.rank, message.fence, exc)
                channel.send(self._error(message.fence, f"rejected: {exc}"))
                continue
            except Exception as exc:
                # Out of memory, a failed collective: report, then stop this rank.
                log.exception("rank %d: frame %d failed", self.rank, message.fence)
                channel.send(self._error(message.fence, f"{type(exc).__name__}: {exc}"))
                raise
            channel.send(completion)
            spin = spin_us

    def _error(self, fence: int, reason: str) -> Completion:
        return Completion(
            fence=fence,
            rank=self.rank,
            world_size=self.world_size,
            device_ns=0,
            error=reason[:4096],
        )
