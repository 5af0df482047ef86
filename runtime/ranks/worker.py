"""The rank worker: receive a frame, check it, pack it, launch it, publish a completion.

Every rank of the tensor-parallel group runs the same program on the same frame
(the collectives inside the model keep them in step).  Rank 0's sampled tokens
are the ones reported; sampling is a pure function of the logits and the
request's (seed, step), so every rank's pending tokens (on the device, see
:class:`~runtime.ranks.arena.SlotArena`) are the same.  Every rank reports its
own device interval; the coordinator takes the maximum.

A frame goes through host stages, timed per frame (:attr:`RankWorker.stages`,
the names the debugging tools report): ``receive`` (socket, decode, schema
validation), ``validate`` (against the slot table), ``pack`` (the lane columns
into the host arena), ``launch`` (copies and the replay), ``wait`` (until the
device finishes) and ``publish`` (the completion built and sent); while
``Control("profile")`` runs, :class:`~runtime.ranks.profiling.RankProfiler`
records them as named ranges (NVTX on CUDA).  The slot table and the device
rows (:class:`~runtime.ranks.device_rows.DeviceRows`) are updated at launch,
so the frame loop (:mod:`runtime.ranks.frame_loop`) can check and pack frame
N+1 while frame N runs; the completion of a finished frame is built by
:mod:`runtime.ranks.completions`.  Logit bias and penalties are applied inside
the programs; a lane whose ``logit_bias`` names a token outside the vocabulary
is refused.

State frames (RESTORE and SNAPSHOT programs, protocol version 7) run no
forward: the rank applies the page copies, binds each restore row (page table,
settings, penalty rows, history and, for a decode-ready row, the pending
token, its position and step) and drops each terminal row's slot, all on the
compute stream between two CUDA events (``perf_counter_ns`` on CPU), and
reports one lane per row with no tokens and that interval as the program's
device time (:meth:`RankWorker._start_state`).

Vision frames (VISION programs, protocol version 10) encode their images into
the feature store (:mod:`runtime.ranks.vision_programs`) and are published
like state frames: no lanes, no tokens, the program's device interval.
"""

from __future__ import annotations

import logging
import time
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import psutil
import torch

from runtime.catalog import GraphDescriptor, GraphKind, validate_catalog
from runtime.identity import ModelIdentity, code_version, loaded_identity
from runtime.ranks.arena import HostStaging, SlotArena
from runtime.ranks.capacity import CapacityConfig, build_catalog, forward_programs
from runtime.ranks.checked_frame import CheckedFrame
from runtime.ranks.completions import (
    forward_columns,
    frame_completion,
    ints,
    logprob_sidecars,
    prompt_logprob_sidecars,
    round_columns,
    round_logprob_sidecars,
    state_columns,
)
from runtime.ranks.device_rows import DeviceRows
from runtime.ranks.draft import DraftContext
from runtime.ranks.drills import DebugDrills
from runtime.ranks.launch import Launch
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.outputs import HostOutputs
from runtime.ranks.profiling import RankProfiler
from runtime.ranks.programs import PreparedProgram, prepare_programs
from runtime.ranks.proposals import ProposerConfig
from runtime.ranks.shapes import ProgramError, variant_of
from runtime.ranks.slots import SlotTable
from runtime.ranks.vision_programs import FeatureStore, VisionProgram, vision_programs
from runtime.ranks.watchdog import frame_deadline_ns
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.completion import STAGE_NAMES, Completion
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import MAX_SLOTS, STATE_KINDS
from runtime.transport.inspection import RankStatus
from runtime.transport.schema import PROTOCOL_VERSION
from runtime.transport.tensor import Tensor, tensor_from_torch

log = logging.getLogger("runtime.ranks")

STAGES = STAGE_NAMES
STAGE_HISTORY = 4096  # frames whose stage times are kept


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
        frame_timeout_multiple: float = 20.0,
        frame_timeout_margin_s: float = 60.0,
        check_ranks: bool = False,
        profile_dir: str | None = None,
        draft_model: LlamaForCausalLM | None = None,
        proposer: ProposerConfig | None = None,
        identity: ModelIdentity | None = None,
        draft_identity: ModelIdentity | None = None,
        kv_page_bytes: int = 0,
        catalog: Sequence[GraphDescriptor] | None = None,
    ) -> None:
        """``catalog``: the programs to prepare and report instead of
        ``build_catalog(capacity)`` (shapes the capacity settings do not build,
        e.g. packed prefill programs, for tests and scripts); the capacity
        still gives the speculative settings."""
        if frame_timeout_multiple <= 0 or frame_timeout_margin_s <= 0:
            raise ValueError("frame_timeout_multiple and frame_timeout_margin_s must be > 0")
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.page_size = page_size
        self.num_pages = num_pages
        self.model_name = model_name
        # Start-up agreement (runtime/identity.py): the files this rank loaded, or
        # what the model in memory shows when built without them.
        self.identity = identity or loaded_identity(model)
        self.draft_identity = draft_identity or (
            loaded_identity(draft_model) if draft_model is not None else None
        )
        self.kv_page_bytes = kv_page_bytes
        self.frame_timeout_multiple = frame_timeout_multiple
        self.frame_timeout_margin_s = frame_timeout_margin_s
        config = model.config
        self.max_context = min(config.max_position_embeddings, max_model_len or 1 << 62)
        self.vocab = config.vocab_size
        self.is_eos = np.zeros(config.vocab_size, bool)  # token -> EOS, one lookup per frame
        self.is_eos[list(config.eos_token_ids)] = True
        self.catalog: list[GraphDescriptor] = (
            build_catalog(capacity, self.max_context, vision=config.vision is not None)
            if catalog is None
            else list(validate_catalog(list(catalog)))
        )
        model.allocate_kv_cache(num_pages, page_size)
        self.device = model.model.embed_tokens.weight.device
        speculative = bool(capacity.speculative_widths)
        if speculative and proposer is None:
            raise ValueError("speculative programs need a proposer (ProposerConfig)")
        self.proposer = proposer if speculative else None
        draft = _draft_context(draft_model, config.vocab_size, num_pages, page_size)
        self.draft_model = draft_model
        self._prepare(capacity, capture, progress, draft)
        self.frames = 0
        self.last_fence = -1
        # The highest fence taken (a refused frame leaves it): a frame at or below it
        # is a replay, refused.
        self.last_received_fence = -1
        self.stages: deque[dict[str, int]] = deque(maxlen=STAGE_HISTORY)
        self.drills = DebugDrills.from_env(rank)  # FLARE_DEBUG_*_RANK<r>
        self.check_ranks = check_ranks
        self.last_publish_ns = 0  # the previous frame's publish stage
        # Control("profile"): torch.profiler over the next frames (runtime/ranks/profiling.py).
        self.profiler = RankProfiler(rank, self.device, profile_dir)

    def _prepare(
        self,
        capacity: CapacityConfig,
        capture: bool,
        progress: Callable[[Iterable], Iterable] | None,
        draft: DraftContext | None,
    ) -> None:
        """The device state: the slot arena, the prepared programs (captured on
        CUDA) and their outputs, the slot table, the host staging and buffers."""
        max_pages = -(-self.max_context // self.page_size)
        speculative = bool(capacity.speculative_widths)
        # Token history (copy proposals): every position, plus a round's width.
        history = self.max_context + 2 * max(capacity.speculative_widths, default=0) + 2
        self.arena = SlotArena(MAX_SLOTS, max_pages, self.device, history=history * speculative)
        # A vision model's feature store and VISION programs (None and none: text-only).
        self.store = FeatureStore.for_model(self.model, capacity)
        self.vision: dict[tuple, VisionProgram] = vision_programs(
            self.catalog, self.model, self.store
        )
        self.programs: dict[tuple, PreparedProgram]
        self.programs, self.outputs = prepare_programs(
            forward_programs(self.catalog),
            self.model,
            self.arena,
            self.page_size,
            capture=capture,
            progress=progress,
            draft=draft,
            proposer=self.proposer,
            store=self.store,
            vision=self.vision.values(),
        )
        # Slots are cheap on a rank: hold the protocol bound, so any coordinator
        # concurrency fits whatever decode buckets were captured.
        self.slots = SlotTable(
            MAX_SLOTS,
            page_size=self.page_size,
            max_pages=max_pages,
            num_pages=self.num_pages,
            max_context=self.max_context,
        )
        # The state programs: no prepared body (see _start_state).
        self.state_programs = {d.key for d in self.catalog if d.kind in STATE_KINDS}
        self.staging = HostStaging(max(p.int_size for p in self.programs.values()), self.device)
        lanes = self.outputs.tokens.shape[0]
        k = self.outputs.max_logprobs
        scored = self.outputs.score_logprob.shape[0]  # the largest scored program's tokens
        self.host_buffers = [HostOutputs(lanes, k, self.device, scored) for _ in "ab"]
        self._next_host = 0
        self.rows = DeviceRows(self.arena, self.outputs.penalties, self.device)

    def report(self) -> CatalogReport:
        return CatalogReport(
            rank=self.rank,
            world_size=self.world_size,
            descriptors=tuple(self.catalog),
            vocab_size=self.vocab,
            max_context=self.max_context,
            page_size=self.page_size,
            num_pages=self.num_pages,
            model_name=self.model_name,
            kv_page_bytes=self.kv_page_bytes,
            dtype=str(self.model.dtype).removeprefix("torch."),
            device_type=self.device.type,
            protocol_version=PROTOCOL_VERSION,
            code_version=code_version(),
            config_digest=self.identity.config_digest,
            tokenizer_digest=self.identity.tokenizer_digest,
            weights_digest=self.identity.weights_digest,
            weights_full_digest=self.identity.weights_full_digest,
            draft_digest=self.draft_identity.combined() if self.draft_identity else "",
            **(self.store.report() if self.store is not None else {}),  # text-only: zeros
        )

    def inspect(self, nonce: int = 0) -> RankStatus:
        """This rank's state for ``Control("inspect")``: slots in use, programs and
        their capture status, frames run, memory."""
        table = self.slots
        used = np.nonzero(table.generation)[0]
        # Every program of the catalog; the state programs have nothing to capture.
        programs = sorted(
            [(p.desc.describe(), int(p.captured)) for p in self.programs.values()]
            + [(p.desc.describe(), int(p.captured)) for p in self.vision.values()]
            + [(d.describe(), 0) for d in self.catalog if d.key in self.state_programs]
        )
        cuda = self.device.type == "cuda"
        return RankStatus(
            rank=self.rank,
            world_size=self.world_size,
            nonce=nonce,
            device=str(self.device),
            frames=self.frames,
            last_fence=self.last_fence,
            rss_bytes=psutil.Process().memory_info().rss,
            device_allocated_bytes=torch.cuda.memory_allocated(self.device) if cuda else 0,
            device_reserved_bytes=torch.cuda.memory_reserved(self.device) if cuda else 0,
            kv_cache_bytes=self.model.kv_cache.nbytes if self.model.kv_cache is not None else 0,
            programs=tuple(name for name, _ in programs),
            captured=[captured for _, captured in programs],
            slot=ints(used),
            generation=ints(table.generation[used]),
            next_position=ints(table.next_position[used]),
            page_count=ints(table.page_count[used]),
            pending=ints(table.pending[used]),
            step=ints(table.step[used]),
        )

    def deadline_ns(self, frame: Frame) -> int:
        return frame_deadline_ns(
            frame.expected_ns, self.frame_timeout_multiple, self.frame_timeout_margin_s
        )

    # -- stages ------------------------------------------------------------------
    def check(self, frame: Frame) -> tuple[PreparedProgram, CheckedFrame]:
        """Validate ``frame`` against the programs and the slot table; nothing changes."""
        program = self.programs.get(frame.program.key)
        if program is None:
            raise ProgramError(f"fence {frame.fence}: program {frame.program.describe()} unknown")
        return program, self.slots.check(frame, self.vocab)

    def _known_program(self, frame: Frame) -> None:
        """Raises ProgramError when the frame's program is not in this rank's catalog."""
        key = frame.program.key
        if key not in self.programs and key not in self.state_programs:
            raise ProgramError(f"fence {frame.fence}: program {frame.program.describe()} unknown")

    def start(
        self, frame: Frame, received_ns: int = 0, received_at: int = 0
    ) -> Launch | Completion:
        """Check, pack and launch ``frame``; an empty frame answers at once.

        Raises FrameError / ProgramError with nothing changed.  The slot table
        and the device rows are updated here, before the frame finishes.
        """
        if frame.program.kind is GraphKind.VISION:
            return self._start_vision(frame, received_ns, received_at)
        if not frame.slot:  # an empty frame: page copies and releases, no program runs
            self._known_program(frame)
            self.slots.check_copies(frame)
            self._copy_pages(frame)
            for slot in frame.release_slots:
                self.slots.release(slot)
            return Completion(frame.fence, self.rank, self.world_size, device_ns=0)
        if frame.program.kind in STATE_KINDS:
            return self._start_state(frame, received_ns, received_at)
        profiler = self.profiler
        t0 = time.perf_counter_ns()
        with profiler.range("check+pack"):
            program, checked = self.check(frame)
            t1 = time.perf_counter_ns()
            tensor, array_ = self.staging.take()
            used, width = program.pack(checked, array_, self.staging.memo)  # may refuse
        t2 = time.perf_counter_ns()
        self._copy_pages(frame)
        self.rows.update(checked)
        host = self.host_buffers[self._next_host]
        self._next_host ^= 1
        variant = variant_of(checked)
        self.drills.before_launch(frame.fence, self.rank, self.device)
        launched_at = time.monotonic_ns()
        with profiler.range("launch"):
            launch = program.launch(checked, tensor, used, width, host, variant)
        launch.times = [received_at or launched_at, launched_at]
        self.slots.apply(checked)
        t3 = time.perf_counter_ns()
        # On CPU the program ran inside launch(): that time is the device's ("wait").
        host_launch = t3 - t2 - launch.device_ns
        launch.stages.update(
            receive=received_ns, validate=t1 - t0, pack=t2 - t1, launch=host_launch
        )
        return launch

    def _start_state(self, frame: Frame, received_ns: int, received_at: int) -> Launch:
        """A state frame: checked, then its copies and row writes as one timed
        interval (nothing changes when the check refuses it)."""
        t0 = time.perf_counter_ns()
        with self.profiler.range("check+pack"):
            self._known_program(frame)
            checked = self.slots.check_state(frame, self.vocab)
        t1 = time.perf_counter_ns()
        self.drills.before_launch(frame.fence, self.rank, self.device)
        launched_at = time.monotonic_ns()
        host = self.host_buffers[self._next_host]  # unused: a state frame reads nothing back
        launch = Launch(checked, None, "state", host, time.perf_counter_ns(), state=True)
        cuda = self.device.type == "cuda"
        with self.profiler.range("launch"):
            if cuda:  # the interval the writes take on the compute stream
                launch.start = torch.cuda.Event(enable_timing=True)
                launch.end = torch.cuda.Event(enable_timing=True)
                launch.done = torch.cuda.Event()
                launch.start.record()
            started = time.perf_counter_ns()
            self._copy_pages(frame)
            self.rows.update(checked)
            self.rows.ready(checked)
            if cuda:
                launch.end.record()
                launch.done.record()
            else:
                launch.device_ns = time.perf_counter_ns() - started
        self.slots.apply_state(checked)
        launch.times = [received_at or launched_at, launched_at]
        t2 = time.perf_counter_ns()
        launch.stages.update(
            receive=received_ns, validate=t1 - t0, pack=0, launch=t2 - t1 - launch.device_ns
        )
        return launch

    def _start_vision(self, frame: Frame, received_ns: int, received_at: int) -> Launch:
        """A vision frame: its images encoded into the feature store (nothing
        changes when the program refuses it), published like a state frame."""
        program = self.vision.get(frame.program.key)
        if program is None:
            raise ProgramError(f"fence {frame.fence}: program {frame.program.describe()} unknown")
        self.drills.before_launch(frame.fence, self.rank, self.device)
        launched_at = time.monotonic_ns()
        host = self.host_buffers[self._next_host]  # unused: nothing is read back
        with self.profiler.range("launch"):
            launch = program.launch(frame, host)
        launch.times = [received_at or launched_at, launched_at]
        launch.stages["receive"] = received_ns
        return launch

    def _copy_pages(self, frame: Frame) -> None:
        """The frame's page copies in every KV cache this rank holds (the target's,
        the draft's), before its program: eager on the current (compute) stream,
        so on CUDA they follow the frames already launched and precede this
        frame's replay.  Each rank copies its own head shard of the pages."""
        if not frame.copies:
            return
        self.model.kv_cache.copy_pages(frame.copies)
        if self.draft_model is not None:
            self.draft_model.kv_cache.copy_pages(frame.copies)

    def finish(self, launch: Launch) -> Completion:
        """The completion of a finished launch (waits for it if needed)."""
        t0 = time.perf_counter_ns()
        with self.profiler.range("wait"):
            launch.wait()
        t1 = time.perf_counter_ns()
        ended_at = time.monotonic_ns()
        checked = launch.checked
        device_ns = launch.elapsed_ns()
        if self.drills.delay_ns:  # a deliberately slow rank, for debugging and tests
            time.sleep(self.drills.delay_ns / 1e9)
            device_ns += self.drills.delay_ns
        self.frames += 1
        self.last_fence = checked.frame.fence
        columns, sidecars, sampled = self._results(launch)
        launch.stages["wait"] = t1 - t0 + launch.device_ns
        crc = -1
        if self.check_ranks:  # every rank's sampled tokens, to compare across ranks
            if sampled is None:
                sampled = launch.tokens().astype("<i8")
            sampled = self.drills.perturb(sampled, checked.frame.fence)
            crc = zlib.crc32(sampled.tobytes())
        completion = frame_completion(
            launch, self.rank, self.world_size, device_ns, ended_at, self.last_publish_ns, crc,
            columns, sidecars,
        )  # fmt: skip
        launch.stages["publish"] = time.perf_counter_ns() - t1
        self.last_publish_ns = launch.stages["publish"]
        return completion

    def _results(
        self, launch: Launch
    ) -> tuple[dict[str, array], dict[str, Tensor], np.ndarray | None]:
        """A finished launch's (columns, sidecars, what ``--check-ranks`` compares:
        None for the sampled tokens): rank 0 reports the lanes."""
        checked = launch.checked
        if launch.state:  # one lane per row, nothing committed
            return (state_columns(checked) if self.rank == 0 else {}), {}, np.zeros(0, "<i8")
        if launch.round is not None:
            return self._round_results(launch)
        if self.rank != 0:
            return {}, {}, None
        columns = forward_columns(checked, launch.tokens(), self.is_eos)
        sidecars: dict[str, Tensor] = {}
        if checked.logprobs >= 0:
            k = min(checked.logprobs, self.outputs.max_logprobs)
            sidecars = logprob_sidecars(*launch.logprobs(k))
        if launch.program is not None and launch.program.shape.scored:
            k = min(checked.frame.score_k, self.outputs.max_logprobs)
            sidecars.update(prompt_logprob_sidecars(*launch.prompt_scores(k)))
        return columns, sidecars, None

    def _round_results(
        self, launch: Launch
    ) -> tuple[dict[str, array], dict[str, Tensor], np.ndarray]:
        """A finished speculative round: the slot table settled, and (columns,
        sidecars, what ``--check-ranks`` compares).  Every rank publishes the
        confidence and survival sidecars (valid probabilities; rank 0's drive
        the coordinator); rank 0 adds the lanes and, when asked, one row of log
        probabilities per emitted token, in lane order."""
        out, checked = launch.round, launch.checked
        assert out is not None
        counts = out.counts.numpy().astype(np.int64)
        tokens = out.tokens.numpy()
        self.slots.settle(checked, counts)
        kept = np.arange(tokens.shape[1])[None, :] < counts[:, None]  # (R, K + 1)
        flat = tokens[kept]  # lane order
        sampled = np.concatenate([counts, flat]).astype("<i8")  # allocation and acceptance
        sidecars = {
            "confidence": tensor_from_torch(out.confidence.contiguous()),
            "survival": tensor_from_torch(out.survival.contiguous()),
        }
        if self.rank != 0:
            return {}, sidecars, sampled
        columns = round_columns(checked, counts, tokens, self.is_eos)
        if checked.logprobs >= 0 and out.logprob is not None:
            k = min(checked.logprobs, self.outputs.max_logprobs)
            sidecars.update(round_logprob_sidecars(out, kept, k))
        return columns, sidecars, sampled

    def execute(self, frame: Frame) -> Completion:
        """Run one frame to its completion; raises FrameError / ProgramError with
        nothing changed."""
        started = self.start(frame)
        if isinstance(started, Completion):
            return started
        completion = self.finish(started)
        self.stages.append(dict(started.stages))
        return completion


def _draft_context(
    draft_model: LlamaForCausalLM | None, vocab: int, num_pages: int, page_size: int
) -> DraftContext | None:
    """The draft model's context over the same page ids as the target's, or None;
    its vocabulary must be the target's."""
    if draft_model is None:
        return None
    if draft_model.config.vocab_size != vocab:
        raise ValueError(
            f"the draft's vocabulary ({draft_model.config.vocab_size} tokens) is not "
            f"the target's ({vocab})"
        )
    draft_model.allocate_kv_cache(num_pages, page_size)  # the same page ids
    return DraftContext(draft_model)


__all__ = ["STAGES", "RankWorker"]
