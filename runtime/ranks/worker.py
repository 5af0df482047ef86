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
records them as named ranges (NVTX on CUDA).  The slot
table is updated at launch, so on CUDA the loop checks and packs frame N+1
while frame N runs (the spec's two-slot queue, seen from the rank; a third
waits in the socket until the first is answered, since the host buffers are
double) and polls
events instead of blocking, watching each frame's deadline (``multiple`` x
its expected duration + a margin); a missed deadline is reported as an error
completion naming the fence and the rank, and the rank exits.  On CPU frames
run synchronously; a watchdog thread with its own socket does the same.

When a lane of the frame asks for log probabilities, rank 0 adds the
``logprobs`` and ``logprob_token_ids`` sidecars (see
:class:`~runtime.transport.completion.Completion`); otherwise only the sampled
tokens are read back.  Logit bias and penalties are applied inside the
programs; a lane whose ``logit_bias`` names a token outside the vocabulary is
refused.

State frames (RESTORE and SNAPSHOT programs, protocol version 7) run no
forward: the rank applies the page copies, binds each restore row (page table,
settings, penalty rows, history and, for a decode-ready row, the pending
token, its position and step) and drops each terminal row's slot, all on the
compute stream between two CUDA events (``perf_counter_ns`` on CPU), and
reports one lane per row with no tokens and that interval as the program's
device time (:meth:`RankWorker._start_state`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np
import psutil
import torch

from runtime.catalog import GraphDescriptor
from runtime.identity import ModelIdentity, code_version, loaded_identity
from runtime.ranks.arena import HostStaging, SlotArena
from runtime.ranks.capacity import CapacityConfig, build_catalog, forward_programs
from runtime.ranks.checked_frame import CheckedFrame, FrameError
from runtime.ranks.draft import DraftContext
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.outputs import HostOutputs
from runtime.ranks.profiling import RankProfiler
from runtime.ranks.programs import Launch, PreparedProgram, prepare_programs
from runtime.ranks.proposals import ProposerConfig
from runtime.ranks.shapes import ProgramError, variant_of
from runtime.ranks.slots import SlotTable
from runtime.ranks.watchdog import HANG_EXIT_CODE, Watchdog, frame_deadline_ns, hang_message
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.completion import STAGE_NAMES, Completion
from runtime.transport.control import Control
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import MAX_SLOTS, STATE_KINDS
from runtime.transport.inspection import RankStatus
from runtime.transport.restore import Restore
from runtime.transport.schema import PROTOCOL_VERSION
from runtime.transport.tensor import Tensor, tensor_from_torch

log = logging.getLogger("runtime.ranks")

STAGES = STAGE_NAMES
STAGE_HISTORY = 4096  # frames whose stage times are kept


class RankHang(RuntimeError):
    """A frame missed its deadline; the rank reported it and must exit."""


def _ints(values: np.ndarray) -> array:
    """A numpy column as the wire's ``array('q')``."""
    return array("q", values.astype(np.int64, copy=False).tobytes())


def _libc_malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library, not Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc keeps what tensors of
    varying shapes freed in its arenas, and a rank's RSS creeps up with the mix of
    prompt lengths it has seen).  Called when the rank has been idle a second, so
    it costs no frame any time; a no-op without glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


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
    ) -> None:
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
        self.catalog: list[GraphDescriptor] = build_catalog(capacity, self.max_context)
        model.allocate_kv_cache(num_pages, page_size)
        self.device = model.model.embed_tokens.weight.device
        max_pages = -(-self.max_context // page_size)
        speculative = bool(capacity.speculative_widths)
        if speculative and proposer is None:
            raise ValueError("speculative programs need a proposer (ProposerConfig)")
        self.proposer = proposer if speculative else None
        draft = None
        if draft_model is not None:
            if draft_model.config.vocab_size != config.vocab_size:
                raise ValueError(
                    f"the draft's vocabulary ({draft_model.config.vocab_size} tokens) is not "
                    f"the target's ({config.vocab_size})"
                )
            draft_model.allocate_kv_cache(num_pages, page_size)  # the same page ids
            draft = DraftContext(draft_model)
        self.draft_model = draft_model
        # Token history (copy proposals): every position, plus a round's width.
        history = self.max_context + 2 * max(capacity.speculative_widths, default=0) + 2
        self.arena = SlotArena(MAX_SLOTS, max_pages, self.device, history=history * speculative)
        self.programs: dict[tuple, PreparedProgram]
        self.programs, self.outputs = prepare_programs(
            forward_programs(self.catalog),
            model,
            self.arena,
            page_size,
            capture=capture,
            progress=progress,
            draft=draft,
            proposer=self.proposer,
        )
        # Slots are cheap on a rank: hold the protocol bound, so any coordinator
        # concurrency fits whatever decode buckets were captured.
        self.slots = SlotTable(
            MAX_SLOTS,
            page_size=page_size,
            max_pages=max_pages,
            num_pages=num_pages,
            max_context=self.max_context,
        )
        # The state programs: no prepared body (see _start_state).
        self.state_programs = {d.key for d in self.catalog if d.kind in STATE_KINDS}
        self.staging = HostStaging(max(p.int_size for p in self.programs.values()), self.device)
        lanes = self.outputs.tokens.shape[0]
        self._host = [HostOutputs(lanes, self.outputs.max_logprobs, self.device) for _ in "ab"]
        self._next_host = 0
        self.frames = 0
        self.last_fence = -1
        # The highest fence taken (a refused frame leaves it): a frame at or below it
        # is a replay, refused.
        self.last_received_fence = -1
        self.stages: deque[dict[str, int]] = deque(maxlen=STAGE_HISTORY)
        # FLARE_DEBUG_DELAY_NS_RANK<r>: this rank sleeps that long in every frame
        # and reports it as device time (a slow-rank drill).
        self.debug_delay_ns = int(os.environ.get(f"FLARE_DEBUG_DELAY_NS_RANK{rank}", "0"))
        # FLARE_DEBUG_HANG_FENCE_RANK<r>: this rank's program hangs in the first
        # frame it runs whose fence is at least that (a hang drill: CPU sleeps in
        # the call, CUDA spins on the device).
        self.debug_hang_fence = int(os.environ.get(f"FLARE_DEBUG_HANG_FENCE_RANK{rank}", "-1"))
        # FLARE_DEBUG_LAUNCH_DELAY_NS_RANK<r>: this rank sleeps that long before
        # each launch, outside its timed region (a slow host: the other ranks
        # wait at the first collective, which their launch wait reports).
        self.debug_launch_delay_ns = int(
            os.environ.get(f"FLARE_DEBUG_LAUNCH_DELAY_NS_RANK{rank}", "0")
        )
        self.check_ranks = check_ranks
        # FLARE_DEBUG_PERTURB_FENCE_RANK<r>: with check_ranks, this rank reports
        # one token off in the first frame from that fence (a divergence drill).
        self.debug_perturb_fence = int(
            os.environ.get(f"FLARE_DEBUG_PERTURB_FENCE_RANK{rank}", "-1")
        )
        self._last_publish_ns = 0  # the previous frame's publish stage
        # Control("profile"): torch.profiler over the next frames (runtime/ranks/profiling.py).
        self.profiler = RankProfiler(rank, self.device, profile_dir)

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
        )

    def inspect(self, nonce: int = 0) -> RankStatus:
        """This rank's state for ``Control("inspect")``: slots in use, programs and
        their capture status, frames run, memory."""
        table = self.slots
        used = np.nonzero(table.generation)[0]
        # Every program of the catalog; the state programs have nothing to capture.
        programs = sorted(
            [(p.desc.describe(), int(p.captured)) for p in self.programs.values()]
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
            slot=_ints(used),
            generation=_ints(table.generation[used]),
            next_position=_ints(table.next_position[used]),
            page_count=_ints(table.page_count[used]),
            pending=_ints(table.pending[used]),
            step=_ints(table.step[used]),
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
        self._update_rows(checked)
        host = self._host[self._next_host]
        self._next_host ^= 1
        variant = variant_of(checked)
        if 0 <= self.debug_hang_fence <= frame.fence:
            self.debug_hang_fence = -1
            self._hang()
        if self.debug_launch_delay_ns:  # a slow host: late to launch, not a slow device
            time.sleep(self.debug_launch_delay_ns / 1e9)
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
        if 0 <= self.debug_hang_fence <= frame.fence:
            self.debug_hang_fence = -1
            self._hang()
        if self.debug_launch_delay_ns:
            time.sleep(self.debug_launch_delay_ns / 1e9)
        launched_at = time.monotonic_ns()
        host = self._host[self._next_host]  # unused: a state frame reads nothing back
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
            self._update_rows(checked)
            self._ready_rows(checked)
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

    def _ready_rows(self, checked: CheckedFrame) -> None:
        """A state frame's restore rows on the device: each slot's next position
        and step (what a lane continuing from its pending token reads), and for
        a decode-ready row (``position == len(tokens) - 1``) the pending token
        ``tokens[-1]`` and the whole record in its history, as a prefill that
        committed ``tokens[-1]`` at ``position`` would have left them."""
        if not checked.restores:
            return
        lanes = sorted(checked.restores)
        rows = [int(checked.slot[i]) for i in lanes]
        position = [int(checked.position[i]) for i in lanes]
        values = torch.tensor(
            [
                position,
                [checked.restores[i].step for i in lanes],
                [checked.restores[i].tokens[-1] for i in lanes],
            ],
            dtype=torch.int64,
        ).to(self.device)
        index = torch.tensor(rows, dtype=torch.int64).to(self.device)
        arena = self.arena
        arena.next_pos.index_copy_(0, index, values[0])
        arena.steps.index_copy_(0, index, values[1])
        ready = [
            k for k, i in enumerate(lanes) if position[k] == len(checked.restores[i].tokens) - 1
        ]
        if ready:
            at = torch.tensor(ready, dtype=torch.int64).to(self.device)
            arena.pending.index_copy_(0, index.index_select(0, at), values[2].index_select(0, at))
            for k in ready:
                arena.set_history(rows[k], checked.restores[lanes[k]].tokens)

    def _update_rows(self, checked: CheckedFrame) -> None:
        """Appended pages and new generations' settings into the device rows; a new
        generation's page-table row starts empty (a round's draft extent past
        the pages a slot holds must find no page there)."""
        if checked.starts.any():
            fresh = torch.from_numpy(checked.slot[checked.starts]).to(self.device)
            self.arena.page_tables.index_fill_(0, fresh, -1)
        self.arena.append_pages(checked.slot, checked.page_base, checked.page_count, checked.pages)
        for i, params in checked.sampling.items():
            if checked.starts[i]:
                self.arena.set_sampling(int(checked.slot[i]), params)
        for i, restore in checked.restores.items():
            self._restore_rows(int(checked.slot[i]), restore, int(checked.position[i]))

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

    def _restore_rows(self, slot: int, restore: Restore, position: int) -> None:
        """A restored generation's device rows: the penalty row as if the slot had
        consumed ``restore.tokens[:output_start]`` and committed the rest (the
        program does not reset it, see ``PreparedProgram.pack``), and the known
        prefix ``tokens[:position]`` in the slot's history (speculation); the
        sampling step travels in the frame's packed step."""
        tokens, start = restore.tokens, restore.output_start
        self.outputs.penalties.restore(slot, tokens[:start], tokens[start:])
        self.arena.set_history(slot, tokens[:position])

    def _hang(self) -> None:
        log.warning("rank %d: FLARE_DEBUG_HANG_FENCE: hanging", self.rank)
        if self.device.type == "cuda":
            torch.cuda._sleep(1 << 62)  # a device spin: the frame's event never completes
            return
        while True:  # the hung call does not return; the watchdog ends the process
            time.sleep(3600)

    def finish(self, launch: Launch) -> Completion:
        """The completion of a finished launch (waits for it if needed)."""
        t0 = time.perf_counter_ns()
        with self.profiler.range("wait"):
            launch.wait()
        t1 = time.perf_counter_ns()
        ended_at = time.monotonic_ns()
        checked = launch.checked
        device_ns = launch.elapsed_ns()
        if self.debug_delay_ns:  # a deliberately slow rank, for debugging and tests
            time.sleep(self.debug_delay_ns / 1e9)
            device_ns += self.debug_delay_ns
        self.frames += 1
        self.last_fence = checked.frame.fence
        columns: dict[str, array] = {}
        sidecars: dict[str, Tensor] = {}
        sampled = None
        if launch.state:  # one lane per row, nothing committed
            sampled = np.zeros(0, "<i8")
            if self.rank == 0:
                zeros = np.zeros(checked.lanes, np.int64)
                columns = {
                    "slot": _ints(checked.slot),
                    "generation": _ints(checked.generation),
                    "token_count": _ints(zeros),
                    "tokens": array("q"),
                    "finished": _ints(zeros),
                }
        elif launch.round is not None:
            columns, sidecars, sampled = self._round_results(launch)
        elif self.rank == 0:
            tokens = launch.tokens()
            commits = checked.commits
            committed = commits > 0
            columns = {
                "slot": _ints(checked.slot),
                "generation": _ints(checked.generation),
                "token_count": _ints(commits),
                "tokens": _ints(tokens[committed]),
                "finished": _ints(committed & self.is_eos[tokens]),
            }
            if checked.logprobs >= 0:
                k = min(checked.logprobs, self.outputs.max_logprobs)
                values, ids = launch.logprobs(k)
                sidecars["logprobs"] = tensor_from_torch(values)  # (R, 1 + k) float32
                sidecars["logprob_token_ids"] = tensor_from_torch(ids)  # (R, k) int32
        launch.stages["wait"] = t1 - t0 + launch.device_ns
        stages = launch.stages
        crc = -1
        if self.check_ranks:  # every rank's sampled tokens, to compare across ranks
            if sampled is None:
                sampled = launch.tokens().astype("<i8")
            if 0 <= self.debug_perturb_fence <= checked.frame.fence and sampled.size:
                self.debug_perturb_fence = -1  # the drill: one token off, once
                sampled = sampled.copy()
                sampled[0] += 1
            crc = zlib.crc32(sampled.tobytes())
        completion = Completion(
            fence=checked.frame.fence,
            rank=self.rank,
            world_size=self.world_size,
            device_ns=device_ns,
            readiness_delay_ns=0,
            sidecars=sidecars,
            launch_wait_ns=min(launch.launch_wait_ns, device_ns),
            host_times=(*launch.times[:2], ended_at, time.monotonic_ns())
            if len(launch.times) >= 2
            else (),
            stage_ns=(
                stages.get("receive", 0),
                stages.get("validate", 0),
                stages.get("pack", 0),
                stages.get("launch", 0),
                stages["wait"],
                self._last_publish_ns,
            ),
            token_crc=crc,
            **columns,
        )
        stages["publish"] = time.perf_counter_ns() - t1
        self._last_publish_ns = stages["publish"]
        return completion

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
        last = tokens[np.arange(len(counts)), np.maximum(counts - 1, 0)]
        columns = {
            "slot": _ints(checked.slot),
            "generation": _ints(checked.generation),
            "token_count": _ints(counts),
            "tokens": _ints(flat),
            "finished": _ints((counts > 0) & self.is_eos[np.maximum(last, 0)]),
        }
        if checked.logprobs >= 0 and out.logprob is not None:
            k = min(checked.logprobs, self.outputs.max_logprobs)
            mask = torch.from_numpy(kept)
            values = torch.cat(
                [out.logprob[mask][:, None], out.top_logprobs[mask][:, :k]], dim=1
            )  # (T, 1 + k), T = emitted tokens
            sidecars["logprobs"] = tensor_from_torch(values.contiguous())
            ids = out.top_ids[mask][:, :k].to(torch.int32).contiguous()
            sidecars["logprob_token_ids"] = tensor_from_torch(ids)
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

    # -- the loop ------------------------------------------------------------------
    def serve(self, channel, spin_us: int = 0) -> None:
        """Answer frames until a shutdown control arrives.

        ``spin_us``: after each completion, busy-poll that long for the next
        frame before blocking (the coordinator usually sends it within a round
        trip, and waking a blocked process costs more than the spin).
        """
        channel.send(self.report())
        watchdog = None
        if self.device.type != "cuda":
            # A tick of an eighth of the margin (at most 1 s): few wake-ups, an
            # early enough report.
            tick = min(1.0, self.frame_timeout_margin_s / 8)
            watchdog = Watchdog(
                channel.endpoints.completions, self.rank, self.world_size, tick_s=tick,
                keys=getattr(channel, "keys", None),
            )  # fmt: skip
        try:
            self._loop(channel, spin_us, watchdog)
        finally:
            if watchdog is not None:
                watchdog.close()

    def _loop(self, channel, spin_us: int, watchdog: Watchdog | None) -> None:
        queue: deque[tuple[Frame, Launch | Completion, int]] = deque()  # in fence order
        head_since = 0  # when the head of the queue became the head
        trimmed = True  # freed memory was handed back since the last message
        spin = 0
        while True:
            while queue:  # publish what finished, in order
                frame, item, _ = queue[0]
                if isinstance(item, Launch) and not item.finished():
                    waited = time.monotonic_ns() - head_since
                    limit = self.deadline_ns(frame)
                    if waited > limit:
                        reason = hang_message(frame.fence, self.rank, limit, frame.expected_ns)
                        log.error("%s; this rank exits", reason)
                        channel.send(self._error(frame.fence, reason))
                        raise RankHang(reason)
                    break
                queue.popleft()
                head_since = time.monotonic_ns()
                self._publish(channel, item)
                spin = spin_us
            if sum(isinstance(item, Launch) for _, item, _ in queue) >= len(self._host):
                continue  # both host buffers are in flight: the head must finish first
            t0 = time.perf_counter_ns()
            message = channel.recv(timeout_ms=0 if queue else 1000, spin_us=0 if queue else spin)
            received = time.perf_counter_ns() - t0
            if message is None:
                if not queue and not trimmed:  # idle for a second: hand freed memory back
                    release_free_memory()
                    trimmed = True
                continue
            received_at = time.monotonic_ns()
            spin = 0
            trimmed = False
            if isinstance(message, Control):
                if message.command == "inspect":
                    channel.send(self.inspect(message.nonce))
                    continue
                if message.command == "profile":
                    refused = self.profiler.start(message.nonce, message.count)
                    if refused is not None:
                        channel.send(refused)
                    continue
                if message.command == "shutdown":
                    while queue:  # the frames in flight finish and are answered first
                        self._publish(channel, queue.popleft()[1])
                    if self.profiler.active:  # the frames profiled so far
                        channel.send(self.profiler.finish())
                    return
                continue
            if not isinstance(message, Frame):
                log.warning("rank %d: ignoring %s", self.rank, type(message).__name__)
                continue
            if watchdog is not None:
                watchdog.arm(message.fence, self.deadline_ns(message), message.expected_ns)
            try:
                self._check_fresh(message)
                item = self.start(message, received, received_at)
                # Only a frame taken advances the mark: a refused one changes nothing.
                self.last_received_fence = message.fence
            except (FrameError, ProgramError) as exc:
                # A frame this rank cannot run is a coordinator bug: say so at once
                # (the slot state is unchanged) so the coordinator fails fast.
                log.error("rank %d: rejected frame %d: %s", self.rank, message.fence, exc)
                item = self._error(message.fence, f"rejected: {exc}")
            except Exception as exc:
                # Out of memory, a failed collective: report, then stop this rank.
                log.exception("rank %d: frame %d failed", self.rank, message.fence)
                channel.send(self._error(message.fence, f"{type(exc).__name__}: {exc}"))
                raise
            finally:
                if watchdog is not None:
                    watchdog.disarm()
            if not queue:
                head_since = time.monotonic_ns()
            queue.append((message, item, received))

    def _check_fresh(self, frame: Frame) -> None:
        """Refuse a replayed frame: fences only grow, so a fence at or below the
        highest this rank took was sent before (raises FrameError)."""
        last = self.last_received_fence
        if frame.fence <= last:
            raise FrameError(
                f"fence {frame.fence} replayed: not greater than fence {last}, "
                "the last frame this rank received"
            )

    def _publish(self, channel, item: Launch | Completion) -> None:
        if isinstance(item, Completion):
            channel.send(item)
            return
        with self.profiler.range("publish"):
            completion = self.finish(item)
            t0 = time.perf_counter_ns()
            channel.send(completion)
        item.stages["publish"] += time.perf_counter_ns() - t0
        self._last_publish_ns = item.stages["publish"]
        self.stages.append(dict(item.stages))
        profiled = self.profiler.frame_done()
        if profiled is not None:
            channel.send(profiled)

    def _error(self, fence: int, reason: str) -> Completion:
        return Completion(
            fence=fence,
            rank=self.rank,
            world_size=self.world_size,
            device_ns=0,
            error=reason[:4096],
        )


__all__ = ["HANG_EXIT_CODE", "STAGES", "RankHang", "RankWorker"]
