"""A fake rank for the engine tests: the real rank protocol, deterministic "sampling".

:class:`FakeRank` keeps per-slot state like the real worker (generation, next
KV position, pending token, a digest of the prompt, and the slot's page table,
which a new generation starts empty and every lane appends its pages to),
and the "KV" of every page (the token written at each of its positions, so
an attached cached prefix and a copy-on-write page are checked to hold the
tokens the coordinator claims), checks every frame against it, and "samples"
``(31 * input + 7 * position + digest + 3) % vocab``, where ``input`` is the
token at ``position``: the chunk's last prompt token for a prefill lane, the
slot's pending token for a decode lane (decode lanes carry no tokens).
:func:`reference` gives what a request must receive.

:func:`main` runs it as a rank process: handshake, one CatalogReport, then one
Completion per Frame (lanes on rank 0 only) until shutdown.  A frame that does
not fit the slot state is a coordinator bug: the process prints why and exits
with :data:`EXIT_BAD_FRAME`, so the engine sees a missing completion.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.rounds import device_allocation
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.columns import column
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.frame import Frame
from runtime.transport.rank_channel import RankChannel
from runtime.transport.schema import PROTOCOL_VERSION
from runtime.transport.security import ClientKeys
from runtime.transport.tensor import Tensor

EXIT_OK = 0
EXIT_NO_PING = 3
EXIT_IDLE = 4
EXIT_BAD_FRAME = 7

VOCAB = 101
EOS = 2
PAGE_SIZE = 16
NUM_PAGES = 512
MAX_CONTEXT = 4096
MODEL = "fake-model"
# The identity a fake rank reports (runtime/identity.py): fixed digests.
CONFIG_DIGEST = hashlib.sha256(b"fake config").hexdigest()
TOKENIZER_DIGEST = hashlib.sha256(b"fake tokenizer").hexdigest()
WEIGHTS_DIGEST = hashlib.sha256(b"fake weights").hexdigest()
DESCRIPTORS = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=128),
    *(GraphDescriptor(GraphKind.DECODE, b) for b in (1, 2, 4, 8, 16, 32)),
)


def sample(digest: int, token: int, position: int, vocab: int = VOCAB) -> int:
    return (31 * token + 7 * position + digest + 3) % vocab


def digest_of(tokens: list[int] | tuple[int, ...], start: int, digest: int, vocab: int) -> int:
    for i, token in enumerate(tokens):
        digest = (digest + (start + i + 1) * token) % vocab
    return digest


def reference(
    prompt: list[int] | tuple[int, ...],
    max_tokens: int,
    vocab: int = VOCAB,
    eos: int = EOS,
    ignore_eos: bool = False,
) -> tuple[list[int], str]:
    """The tokens and finish reason the engine must deliver for ``prompt``."""
    digest = digest_of(prompt, 0, 0, vocab)
    token, position = prompt[-1], len(prompt) - 1
    out: list[int] = []
    while len(out) < max_tokens:
        token = sample(digest, token, position, vocab)
        position += 1
        out.append(token)
        if token == eos and not ignore_eos:
            return out, "stop"
    return out, "length"


class BadFrame(ValueError):
    pass


@dataclass
class _Slot:
    generation: int
    next_position: int = 0
    pending: int | None = None
    digest: int = 0
    pages: tuple[int, ...] = ()  # the slot's table: every page its lanes appended
    output_start: int = 1 << 62  # positions from here on are output (a restored generation)


@dataclass
class FakeSpec:
    """What a fake rank reports and how it behaves; ``per_rank`` overrides by rank."""

    descriptors: tuple[GraphDescriptor, ...] = DESCRIPTORS
    vocab_size: int = VOCAB
    max_context: int = MAX_CONTEXT
    page_size: int = PAGE_SIZE
    num_pages: int = NUM_PAGES
    model_name: str = MODEL
    kv_page_bytes: int = 4096
    dtype: str = "float32"
    device_type: str = "cpu"
    protocol_version: int = PROTOCOL_VERSION
    code_version: str = "fake-code"
    config_digest: str = CONFIG_DIGEST
    tokenizer_digest: str = TOKENIZER_DIGEST
    weights_digest: str = WEIGHTS_DIGEST
    weights_full_digest: str = ""
    draft_digest: str = ""
    eos: int = EOS
    sleep_s: float = 0.0  # "device time" per frame
    device_ns: int | None = None  # a fixed reported interval instead of the measured one
    readiness_delay_ns: int = 0
    idle_exit_s: float = 60.0  # leave when nothing arrives for this long
    # Speculative rounds: every lane accepts this many of its offered proposals
    # (the tokens are the reference's next ones, as a correct verifier gives), and
    # a device-allocated program's lanes report these joint prefix probabilities.
    accept: int = 0
    confidence: tuple[float, ...] = ()
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)

    def for_rank(self, rank: int) -> FakeSpec:
        spec = FakeSpec(**{**self.__dict__, "per_rank": {}})
        for name, value in self.per_rank.get(rank, {}).items():
            setattr(spec, name, value)
        return spec

    def to_args(self) -> dict[str, Any]:
        """Plain data for the spawned process."""
        out = dict(self.__dict__)
        out["descriptors"] = [d.to_wire() for d in self.descriptors]
        out["per_rank"] = {
            rank: {
                k: [d.to_wire() for d in v] if k == "descriptors" else v
                for k, v in overrides.items()
            }
            for rank, overrides in self.per_rank.items()
        }
        return out

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> FakeSpec:
        args = dict(args)
        args["descriptors"] = tuple(GraphDescriptor.from_wire(d) for d in args["descriptors"])
        args["per_rank"] = {
            rank: {
                k: tuple(GraphDescriptor.from_wire(d) for d in v) if k == "descriptors" else v
                for k, v in overrides.items()
            }
            for rank, overrides in args["per_rank"].items()
        }
        return cls(**args)


class FakeRank:
    """One rank's slot table and program "execution"."""

    def __init__(self, spec: FakeSpec, rank: int, world_size: int) -> None:
        self.spec = spec.for_rank(rank)
        self.rank = rank
        self.world_size = world_size
        self.slots: dict[int, _Slot] = {}
        self.frames = 0
        self.lanes_run = 0
        self.generations: dict[int, list[int]] = {}  # slot -> generations seen, in order
        self.appended: list[tuple[int, int, int, tuple[int, ...]]] = []  # fence, slot, gen, pages
        self.kv: dict[int, dict[int, int]] = {}  # page -> offset -> the token written there
        self.restored: list[tuple[int, int, int]] = []  # (fence, slot, position) of restores
        self.copied = 0  # pages copied
        self.terminal: list[tuple[int, int, int]] = []  # (fence, slot, generation) retired

    def _write(self, table: tuple[int, ...], position: int, token: int) -> None:
        size = self.spec.page_size
        self.kv.setdefault(table[position // size], {})[position % size] = token

    def _check_restored(self, i: int, table: tuple[int, ...], tokens, position: int) -> None:
        """Positions before ``position`` must hold ``tokens`` in the lane's table."""
        size = self.spec.page_size
        for q in range(position):
            held = self.kv.get(table[q // size], {}).get(q % size)
            if held != tokens[q]:
                raise BadFrame(
                    f"lane {i}: attached page {table[q // size]} holds {held} at position {q}, "
                    f"the restore says {tokens[q]}"
                )

    def report(self) -> CatalogReport:
        s = self.spec
        return CatalogReport(
            self.rank,
            self.world_size,
            tuple(s.descriptors),
            s.vocab_size,
            s.max_context,
            s.page_size,
            s.num_pages,
            s.model_name,
            kv_page_bytes=s.kv_page_bytes,
            dtype=s.dtype,
            device_type=s.device_type,
            protocol_version=s.protocol_version,
            code_version=s.code_version,
            config_digest=s.config_digest,
            tokenizer_digest=s.tokenizer_digest,
            weights_digest=s.weights_digest,
            weights_full_digest=s.weights_full_digest,
            draft_digest=s.draft_digest,
        )

    def _table(self, i: int, held: tuple[int, ...], appended: tuple[int, ...]) -> tuple[int, ...]:
        """The slot's table after lane ``i`` appends ``appended`` to the ``held`` pages."""
        again = set(held).intersection(appended)
        if again:
            raise BadFrame(f"lane {i}: appends page(s) {sorted(again)} the slot already holds")
        if any(not 0 <= p < self.spec.num_pages for p in appended):
            raise BadFrame(f"lane {i}: page out of range in {appended}")
        return held + appended

    def _check_pages(self, i: int, table: tuple[int, ...], last_position: int) -> None:
        s = self.spec
        if last_position >= len(table) * s.page_size:
            raise BadFrame(f"lane {i}: position {last_position} beyond {len(table)} pages")
        if last_position >= s.max_context:
            raise BadFrame(f"lane {i}: position {last_position} beyond the context")

    def execute(self, frame: Frame) -> Completion:
        """Run ``frame`` against the slot table (checked in full before any change)."""
        s = self.spec
        if frame.program not in s.descriptors:
            raise BadFrame(f"fence {frame.fence}: unknown program {frame.program.describe()}")
        released = set(frame.release_slots)
        restores = dict(frame.restores)
        kv = self.kv
        for src, dst in frame.copies:  # before anything reads or writes
            kv[dst] = dict(kv.get(src, {}))
            self.copied += 1
        if frame.program.kind in (GraphKind.RESTORE, GraphKind.SNAPSHOT):
            return self._state(frame, restores, released)
        plans = []
        for i, lane in enumerate(frame.lanes):
            state = None if lane.slot in released else self.slots.get(lane.slot)
            if state is not None and state.generation != lane.generation:
                if lane.generation < state.generation:
                    raise BadFrame(f"lane {i}: slot {lane.slot} generation went backwards")
                state = None
            if lane.phase == "prefill":
                restore = restores.get(i)
                output_start = 1 << 62
                if state is None and restore is not None:
                    if lane.prompt_start != lane.position or lane.position > len(restore.tokens):
                        raise BadFrame(f"lane {i}: a restored prefill starts at its position")
                    table = self._table(i, (), lane.pages)
                    self._check_restored(i, table, restore.tokens, lane.position)
                    output_start = restore.output_start
                    known = restore.tokens[: min(lane.position, output_start)]
                    digest = digest_of(known, 0, 0, s.vocab_size)
                    self.restored.append((frame.fence, lane.slot, lane.position))
                elif state is None:
                    if lane.position != 0 or lane.prompt_start != 0:
                        raise BadFrame(f"lane {i}: a new tenant's prefill must start at 0")
                    digest = 0
                else:
                    if lane.position != state.next_position or lane.prompt_start != lane.position:
                        raise BadFrame(
                            f"lane {i}: prefill at {lane.position} (prompt_start "
                            f"{lane.prompt_start}), slot {lane.slot} is at {state.next_position}"
                        )
                    if state.pending is not None:
                        raise BadFrame(f"lane {i}: prefill after the prompt ended")
                    digest = state.digest
                    output_start = state.output_start
                tokens = lane.prompt_tokens
                for t in tokens:
                    if not 0 <= t < s.vocab_size:
                        raise BadFrame(f"lane {i}: prompt token {t} outside the vocabulary")
                last = lane.position + len(tokens) - 1
                table = self._table(i, () if state is None else state.pages, lane.pages)
                self._check_pages(i, table, last)
                prompt_part = tokens[: max(0, output_start - lane.position)]  # outputs: no digest
                digest = digest_of(prompt_part, lane.position, digest, s.vocab_size)
                plans.append((lane, digest, tokens[-1], last, table, output_start))
            else:
                if state is None or state.pending is None:
                    raise BadFrame(f"lane {i}: decode for slot {lane.slot} without a pending token")
                if frame.program.kind is GraphKind.SPECULATIVE:
                    # Behind a queued round the position is a bound: continue from the slot.
                    if lane.position < state.next_position:
                        raise BadFrame(
                            f"lane {i}: round at {lane.position}, slot {lane.slot} is at "
                            f"{state.next_position}"
                        )
                    table = self._table(i, state.pages, lane.pages)
                    plans.append((lane, state.digest, state.pending, state.next_position, table, 0))
                    continue
                if lane.position != state.next_position:
                    raise BadFrame(
                        f"lane {i}: decode at {lane.position}, slot {lane.slot} is at "
                        f"{state.next_position}"
                    )
                table = self._table(i, state.pages, lane.pages)
                self._check_pages(i, table, lane.position)
                plans.append((lane, state.digest, state.pending, lane.position, table, 0))

        start = time.perf_counter_ns()
        if s.sleep_s:
            time.sleep(s.sleep_s)
        measured = max(1, time.perf_counter_ns() - start)

        for slot in released:
            self.slots.pop(slot, None)
        rows = self._round_rows(frame)
        sidecars = {}
        if rows is not None and frame.program.device_allocated:
            sidecars["confidence"] = self._confidence(frame)
        slots, generations, counts, sampled_tokens, finished = [], [], [], [], []
        for i, (lane, digest, token, last, table, output_start) in enumerate(plans):
            if lane.phase == "prefill":
                for q, t in enumerate(lane.prompt_tokens):
                    self._write(table, lane.position + q, t)
            if rows is not None:  # a speculative round: accepted proposals + 1, in order
                n = min(self.spec.accept, rows[i] - 1) + 1
                chain = []
                for position in range(last, last + n):
                    self._check_pages(i, table, position)
                    self._write(table, position, token)
                    token = sample(digest, token, position, s.vocab_size)
                    chain.append(token)
                    if token == s.eos:
                        break
                state = self.slots[lane.slot]
                state.pages = table
                self.appended.append((frame.fence, lane.slot, lane.generation, lane.pages))
                state.next_position = last + len(chain)
                state.pending = chain[-1]
                slots.append(lane.slot)
                generations.append(lane.generation)
                counts.append(len(chain))
                sampled_tokens += chain
                finished.append(int(chain[-1] == s.eos))
                continue
            state = self.slots.get(lane.slot)
            if state is None or state.generation != lane.generation:
                state = _Slot(lane.generation, output_start=output_start)
                self.slots[lane.slot] = state
                self.generations.setdefault(lane.slot, []).append(lane.generation)
            if lane.phase == "decode":
                self._write(table, last, token)
            state.digest = digest
            state.pages = table
            self.appended.append((frame.fence, lane.slot, lane.generation, lane.pages))
            state.next_position = last + 1
            slots.append(lane.slot)
            generations.append(lane.generation)
            counts.append(lane.commits)
            finished.append(0)
            if lane.commits:
                sampled = sample(digest, token, last, s.vocab_size)
                state.pending = sampled
                sampled_tokens.append(sampled)
                finished[-1] = int(sampled == s.eos)
        self.frames += 1
        self.lanes_run += len(plans)
        lanes = self.rank == 0
        if not lanes:
            sidecars = {}
        return Completion(
            frame.fence,
            self.rank,
            self.world_size,
            device_ns=s.device_ns if s.device_ns is not None else measured,
            readiness_delay_ns=s.readiness_delay_ns,
            slot=column(slots if lanes else ()),
            generation=column(generations if lanes else ()),
            token_count=column(counts if lanes else ()),
            tokens=column(sampled_tokens if lanes else ()),
            finished=column(finished if lanes else ()),
            sidecars=sidecars,
        )

    def _state(self, frame: Frame, restores: dict, released: set[int]) -> Completion:
        """A state program: restore rows start generations over their attached
        pages (decode-ready when only the last known token is left), terminal
        rows drop theirs."""
        s = self.spec
        for i, lane in enumerate(frame.lanes):
            state = None if lane.slot in released else self.slots.get(lane.slot)
            restore = restores.get(i)
            if restore is None:  # a terminal row
                if state is None or state.generation != lane.generation:
                    raise BadFrame(f"lane {i}: a terminal row for an unknown generation")
                self.slots.pop(lane.slot)
                self.terminal.append((frame.fence, lane.slot, lane.generation))
                continue
            if state is not None and state.generation == lane.generation:
                raise BadFrame(f"lane {i}: a restore row for a known generation")
            table = self._table(i, (), lane.pages)
            tokens = restore.tokens
            self._check_restored(i, table, tokens, lane.position)
            new = _Slot(lane.generation, output_start=restore.output_start, pages=table)
            if lane.position == len(tokens) - 1:  # decode-ready: its prompt is all known
                known = tokens[: restore.output_start]
            else:
                known = tokens[: min(lane.position, restore.output_start)]
            new.digest = digest_of(known, 0, 0, s.vocab_size)
            new.next_position = lane.position
            if lane.position == len(tokens) - 1:  # decode-ready
                new.pending = tokens[-1]
            self.slots[lane.slot] = new
            self.generations.setdefault(lane.slot, []).append(lane.generation)
            self.appended.append((frame.fence, lane.slot, lane.generation, lane.pages))
            self.restored.append((frame.fence, lane.slot, lane.position))
        for slot in released:
            self.slots.pop(slot, None)
        self.frames += 1
        lanes = self.rank == 0
        n = len(frame.slot) if lanes else 0
        return Completion(
            frame.fence,
            self.rank,
            self.world_size,
            device_ns=s.device_ns if s.device_ns is not None else 1000,
            slot=column(list(frame.slot) if lanes else ()),
            generation=column(list(frame.generation) if lanes else ()),
            token_count=column([0] * n),
            tokens=column(()),
            finished=column([0] * n),
        )

    def _round_rows(self, frame: Frame) -> list[int] | None:
        """Each lane's target rows in a speculative round (None: not a round)."""
        program = frame.program
        if program.kind is not GraphKind.SPECULATIVE:
            return None
        if not program.device_allocated:
            return list(frame.query_len)
        joint = [list(self.spec.confidence)] * frame.num_lanes
        return device_allocation(
            joint, list(frame.query_len), list(frame.slot), program.target_capacity
        )

    def _confidence(self, frame: Frame) -> Tensor:
        """The [2, lanes, D] sidecar: conditional confidences, then joint prefix
        probabilities (the scripted ones, every lane alike)."""
        depth = frame.program.proposal_depth
        joint = list(self.spec.confidence[:depth]) + [0.0] * (depth - len(self.spec.confidence))
        conditional = [
            joint[d] / joint[d - 1] if d and joint[d - 1] else joint[d] for d in range(depth)
        ]
        values = conditional * frame.num_lanes + joint * frame.num_lanes
        return Tensor.from_values("float32", (2, frame.num_lanes, depth), values)


def main(
    frames: str,
    completions: str,
    rank: int,
    world_size: int,
    args: dict,
    keys: tuple[str, str, str] | None = None,
) -> None:
    """The rank process; ``keys``: its CURVE client keys (server, public, secret)."""
    spec = FakeSpec.from_args(args)
    fake = FakeRank(spec, rank, world_size)
    endpoints = ChannelEndpoints(frames=frames, completions=completions)
    client = ClientKeys(*keys) if keys is not None else None
    with RankChannel(endpoints, rank, keys=client) as channel:
        try:
            channel.handshake(timeout_ms=int(fake.spec.idle_exit_s * 1000))
        except TimeoutError:
            sys.exit(EXIT_NO_PING)
        channel.send(fake.report())
        while True:
            message = channel.recv(timeout_ms=int(fake.spec.idle_exit_s * 1000))
            if message is None:
                sys.exit(EXIT_IDLE)
            if isinstance(message, Control):
                if message.command == "shutdown":
                    break
                continue
            try:
                completion = fake.execute(message)
            except BadFrame as exc:
                print(f"fake rank {rank}: fence {message.fence}: {exc}", file=sys.stderr)
                sys.exit(EXIT_BAD_FRAME)
            channel.send(completion)
        channel.close(linger_ms=1000)
    sys.exit(EXIT_OK)


# ---------------------------------------------------------------- test harness


def spawn_ranks(
    endpoints: ChannelEndpoints,
    world_size: int,
    spec: FakeSpec,
    keys: ClientKeys | None = None,
) -> list[Any]:
    """Start ``world_size`` fake rank processes (spawned) against ``endpoints``;
    ``keys``: CURVE client keys (``Engine.rank_keys()`` of a TCP engine)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    key_strings = None if keys is None else (keys.server, keys.public, keys.secret)
    processes = [
        context.Process(
            target=main,
            args=(
                endpoints.frames,
                endpoints.completions,
                rank,
                world_size,
                spec.to_args(),
                key_strings,
            ),
            name=f"fake-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    return processes


def join_ranks(processes: list[Any], timeout_s: float = 10.0) -> list[int | None]:
    """Wait for the processes; kill any still alive.  Their exit codes."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout_s)
    return [process.exitcode for process in processes]


class LocalRanks:
    """Fake ranks in this process, driven by the test: full control over answer order."""

    def __init__(self, endpoints: ChannelEndpoints, world_size: int, spec: FakeSpec) -> None:
        self.world_size = world_size
        self.channels = [RankChannel(endpoints, rank) for rank in range(world_size)]
        self.fakes = [FakeRank(spec, rank, world_size) for rank in range(world_size)]
        self.reordered = 0

    def handshake_in_background(self, report: bool = True) -> list[Any]:
        """Answer the handshake (and send the catalog) from threads; join them after start()."""
        import threading

        def run(rank: int) -> None:
            self.channels[rank].handshake(timeout_ms=10_000)
            if report:
                self.channels[rank].send(self.fakes[rank].report())

        threads = [
            threading.Thread(target=run, args=(r,), daemon=True) for r in range(self.world_size)
        ]
        for thread in threads:
            thread.start()
        return threads

    def take(self, timeout_ms: int = 0) -> list[list[Completion]]:
        """Execute every frame that arrived; each rank's completions, not yet sent."""
        out: list[list[Completion]] = []
        for channel, fake in zip(self.channels, self.fakes):
            done = []
            message = channel.recv(timeout_ms=timeout_ms)
            while message is not None:
                if isinstance(message, Frame):
                    done.append(fake.execute(message))
                message = channel.recv(timeout_ms=0)
            out.append(done)
        return out

    def send(self, completions: list[list[Completion]], reverse: bool = False) -> None:
        for rank, done in enumerate(completions):
            if reverse and len(done) > 1:
                self.reordered += 1
                done = done[::-1]
            for completion in done:
                self.channels[rank].send(completion)

    def serve(self, reverse: bool = False, timeout_ms: int = 0) -> int:
        completions = self.take(timeout_ms)
        self.send(completions, reverse)
        return sum(len(c) for c in completions)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
