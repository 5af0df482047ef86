"""The coordinator -> ranks message: :class:`Frame`, in columns (protocol version 2).

A frame runs one prepared program on ``R`` lanes.  Every per-lane field is one
int64 column (:mod:`runtime.transport.columns`) of length ``R``; the prefill
lanes' prompt chunks and every lane's appended pages are flat columns cut by
``query_len`` and ``page_count``.  Decoding is one ``frombytes`` per column
and validation a few whole-column operations, so a 64-lane decode frame is
decoded and checked in tens of microseconds.  :class:`FrameLane` is a per-lane
view for tests and debugging (:attr:`Frame.lanes`, :meth:`Frame.from_lanes`),
never the hot path.

Pages are *appended*: a lane whose (slot, generation) is new to a rank starts
an empty page table for the slot and appends its ``pages``; a later lane of the
same generation appends only pages the rank has not been sent yet (none, when
the coordinator reserved the whole table at admission).

State programs (``GraphKind.RESTORE`` and ``GraphKind.SNAPSHOT``, protocol
version 7) run no forward: their lanes have phase :data:`PHASE_STATE`, feed and
commit nothing (``query_len == commits == 0``, no prompt tokens) and either
restore a new generation (a *restore row*: RESTORE programs only, with a
``restores`` record and its ``sampling``) or drop a known one (a *terminal
row*); see :class:`Frame`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from runtime.catalog import MAX_BATCH_CAPACITY, CatalogError, GraphDescriptor, GraphKind
from runtime.transport.columns import (
    LaneRanges,
    all_equal,
    as_column,
    check_distinct,
    check_range,
    column,
    column_from_wire,
    column_to_wire,
    first_not,
    offsets,
)
from runtime.transport.fields import (
    INT32_MAX,
    INT64_MAX,
    MAX_SEQUENCE,
    ProtocolError,
    check_choice,
    check_fields,
    check_int,
    check_ints,
    check_seq,
    parse_nested,
    set_field,
)
from runtime.transport.restore import (
    Restore,
    check_copies,
    check_restores,
    copies_from_wire,
    restores_from_wire,
)
from runtime.transport.sampling import SamplingParams

MAX_SLOTS = MAX_BATCH_CAPACITY  # slots are 0..63

PHASE_DECODE = 0
PHASE_PREFILL = 1
PHASE_STATE = 2
PHASE_NAMES = ("decode", "prefill", "state")  # PHASE_NAMES[code]
# The state programs (protocol version 7): their frames hold only state lanes,
# which feed and commit nothing, and state lanes appear in no other program.
STATE_KINDS = frozenset({GraphKind.RESTORE, GraphKind.SNAPSHOT})

# The per-lane columns, in field order; each has one entry per lane.
LANE_COLUMNS = (
    "slot",
    "generation",
    "phase",
    "position",
    "query_len",
    "commits",
    "prompt_start",
    "page_count",
)
# Every int64 column of a frame, in field order (the flat ones too).
FRAME_COLUMNS = (*LANE_COLUMNS[:7], "prompt_tokens", "page_count", "pages")


@dataclass(frozen=True)
class FrameLane:
    """One lane of a frame, as a view (tests, debugging, scripts; not the hot path).

    ``phase``: "prefill", "decode" or "state" (a state program's row: it feeds
    and commits nothing; with a ``restore`` and its ``sampling`` it starts a
    new generation, else it drops a known one).  ``prompt_tokens``: a prefill lane's
    chunk, written from ``position`` (``prompt_start`` is where it starts in the
    prompt); a decode lane carries none (the ranks keep each slot's pending
    token) and feeds 1 token.  ``pages``: the pages this lane appends to its
    slot's rank-side table (see the module docstring).  ``commits``: tokens the
    lane commits, 0 or 1 (always 1 for decode; in a speculative round, up to its
    query length, which is then also what it feeds).  ``sampling``: a prefill lane's
    settings, which the ranks keep for the slot; decode lanes carry None.
    ``restore``: a prefill lane's :class:`~runtime.transport.restore.Restore`
    record (a new generation resuming a known sequence), or None.
    """

    slot: int
    generation: int
    phase: str
    prompt_start: int
    prompt_tokens: tuple[int, ...]
    position: int
    pages: tuple[int, ...]
    commits: int
    sampling: SamplingParams | None = None
    restore: Restore | None = None

    def __post_init__(self) -> None:
        phase = check_choice("phase", self.phase, PHASE_NAMES)
        tokens = check_ints("prompt_tokens", self.prompt_tokens, 0, INT32_MAX)
        pages = check_ints("pages", self.pages, 0, INT32_MAX)
        if phase == "decode" and tokens:
            raise ProtocolError("prompt_tokens", f"a decode lane carries none, got {len(tokens)}")
        if phase == "prefill" and not isinstance(self.sampling, SamplingParams):
            raise ProtocolError("sampling", "a prefill lane needs its SamplingParams")
        if phase == "decode" and self.sampling is not None:
            raise ProtocolError("sampling", "a decode lane carries none (the slot keeps its own)")
        if phase == "state":
            if tokens:
                raise ProtocolError(
                    "prompt_tokens", f"a state lane carries none, got {len(tokens)}"
                )
            if self.commits != 0:
                raise ProtocolError("commits", f"a state lane commits nothing, got {self.commits}")
            if (self.sampling is None) != (self.restore is None):
                raise ProtocolError(
                    "sampling", "a state lane carries SamplingParams exactly with a restore"
                )
            if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
                raise ProtocolError("sampling", "must be a SamplingParams")
        if self.restore is not None and (
            phase == "decode" or not isinstance(self.restore, Restore)
        ):
            raise ProtocolError("restore", "only a prefill or state lane carries one, a Restore")
        set_field(self, "phase", phase)
        set_field(self, "prompt_tokens", tokens)
        set_field(self, "pages", pages)

    @property
    def query_len(self) -> int:
        """Tokens the lane feeds: its chunk for prefill, 1 for decode (a
        speculative round's lane: its query length, ``commits``), 0 for state."""
        if self.phase == "state":
            return 0
        return len(self.prompt_tokens) if self.phase == "prefill" else max(1, self.commits)


_PROGRAMS: dict[tuple, GraphDescriptor] = {}  # wire form -> descriptor (a catalog is small)
_MAX_CACHED_PROGRAMS = 4096


def _program(data: Any) -> GraphDescriptor:
    """The frame's program; a wire form seen before is not validated again."""
    key: tuple | None = None
    if type(data) is dict:
        # The key carries the value types: True == 1 must not hit the entry of 1.
        key = (tuple(data.items()), tuple(map(type, data.values())))
        try:
            cached = _PROGRAMS.get(key)
        except TypeError:  # an unhashable value, which validation refuses below
            key = cached = None
        if cached is not None:
            return cached
    try:
        program = GraphDescriptor.from_wire(data)
    except (CatalogError, TypeError, ValueError) as exc:
        raise ProtocolError("program", str(exc)) from None
    if key is not None:
        if len(_PROGRAMS) >= _MAX_CACHED_PROGRAMS:
            _PROGRAMS.clear()
        _PROGRAMS[key] = program
    return program


def _empty() -> array:
    return column()


# Every lane's range rules, checked in one pass; the phase rules when a lane prefills.
_LANE_RANGES = LaneRanges(
    ("slot", 0, MAX_SLOTS - 1),
    ("generation", 1, INT64_MAX),
    ("position", 0, INT32_MAX),
    ("prompt_start", 0, INT32_MAX),
    ("page_count", 0, MAX_SEQUENCE - 1),
)
_PREFILL_RANGES = LaneRanges(
    ("phase", PHASE_DECODE, PHASE_PREFILL), ("query_len", 1, INT32_MAX), ("commits", 0, 1)
)
_ranged_columns = attrgetter(*(name for name, _, _ in _LANE_RANGES.bounds))
_STATE_RANGES = LaneRanges(
    ("phase", PHASE_STATE, PHASE_STATE), ("query_len", 0, 0), ("commits", 0, 0)
)
_prefill_columns = attrgetter(*(name for name, _, _ in _PREFILL_RANGES.bounds))
_frame_columns = attrgetter(*FRAME_COLUMNS)
_lane_columns = attrgetter(*LANE_COLUMNS[1:])
_typecode = attrgetter("typecode")
_ARRAY = {array}
_INT64 = {"q"}


@dataclass(frozen=True)
class Frame:
    """Coordinator -> ranks: run ``program`` on ``R`` lanes, given as int64 columns.

    Per lane (each column has ``R`` <= ``program.batch_capacity`` entries):
    ``slot`` (distinct, in [0, :data:`MAX_SLOTS`)), ``generation`` (>= 1, the
    slot's request epoch; a new one replaces the slot's rank-side state),
    ``phase`` (0 decode, 1 prefill, 2 state), ``position`` (KV position of the lane's
    first new token), ``query_len`` (new tokens it feeds: a prefill chunk's
    length >= 1; exactly 1 for decode), ``commits`` (tokens it commits, 0 or 1;
    1 for decode), ``prompt_start`` (prefill: where the chunk starts in the
    prompt), ``page_count`` (pages it appends to its slot's table, >= 0; a
    prefill lane at position 0 appends at least one).

    Flat: ``prompt_tokens``, the prefill lanes' chunks in lane order (its
    length is the sum of their ``query_len``, within ``program.prompt_capacity``);
    ``pages``, every lane's appended pages in lane order (length
    ``sum(page_count)``, distinct within each lane's run).  ``sampling``:
    (lane index, settings) for exactly the prefill lanes, in lane order.

    A frame with no lanes is an *empty frame*: the ranks check it, apply its
    releases and answer without running the program.  ``prompt_row``: the
    prefill lane of a mixed program (at most one; -1 for none); every other
    program takes -1.  ``release_slots``: slots whose rank-side state may be
    dropped, distinct and disjoint from the lanes' slots.  ``expected_ns``: the
    coordinator's estimate of the frame's device time (0 = unknown), for a
    per-frame hang timeout on the ranks.

    Prefix reuse (protocol version 6, :mod:`runtime.transport.restore`):
    ``copies``, (source page, destination page) pairs every rank copies in
    each KV cache it holds before the program runs (an empty frame's too),
    in order; ``restores``, (lane index, :class:`Restore`) for prefill lanes
    starting a new generation from a known sequence (at most one per lane):
    such a lane may start at ``position == prompt_start`` > 0 over KV its
    appended pages already hold, and its slot's sampling step, penalty state
    and history resume as the record says.  A frame with either is never the
    ranks' steady decode path.

    State programs (protocol version 7; ``program.kind`` in
    :data:`STATE_KINDS`, RESTORE or SNAPSHOT): every lane has phase 2
    (:data:`PHASE_STATE`), ``query_len == commits == 0`` and no prompt tokens,
    and no other program has such lanes.  The ranks run no forward: they apply
    the copies, then per lane either a *restore row* (RESTORE programs only:
    a new generation with a ``restores`` record and its ``sampling`` entry,
    ``position == prompt_start <= len(tokens) - 1`` the leading positions its
    appended pages already hold; at ``len(tokens) - 1`` the slot is
    decode-ready, its pending token ``tokens[-1]`` at that position, else it is
    prefill-ready at ``position``) or a *terminal row* (a known generation, no
    record, no sampling: its state is dropped), then the releases.  In a state
    frame ``sampling`` names exactly the lanes with a record.

    Columns are ``array('q')``; a list or tuple of ints is converted.  Treat
    them as read-only once the frame is built.
    """

    fence: int
    program: GraphDescriptor
    slot: array = field(default_factory=_empty)
    generation: array = field(default_factory=_empty)
    phase: array = field(default_factory=_empty)
    position: array = field(default_factory=_empty)
    query_len: array = field(default_factory=_empty)
    commits: array = field(default_factory=_empty)
    prompt_start: array = field(default_factory=_empty)
    prompt_tokens: array = field(default_factory=_empty)
    page_count: array = field(default_factory=_empty)
    pages: array = field(default_factory=_empty)
    sampling: tuple[tuple[int, SamplingParams], ...] = ()
    prompt_row: int = -1
    release_slots: tuple[int, ...] = ()
    expected_ns: int = 0
    copies: tuple[tuple[int, int], ...] = ()
    restores: tuple[tuple[int, Restore], ...] = ()

    def __post_init__(self) -> None:
        check_int("fence", self.fence)
        program = self.program
        if not isinstance(program, GraphDescriptor):
            raise ProtocolError("program", "must be a GraphDescriptor")
        cols = _frame_columns(self)
        if set(map(type, cols)) != _ARRAY or set(map(_typecode, cols)) != _INT64:
            for name in FRAME_COLUMNS:
                set_field(self, name, as_column(name, getattr(self, name)))
        lanes = len(self.slot)
        if lanes > program.batch_capacity:
            raise ProtocolError(
                "slot",
                f"{lanes} lanes exceed the program's batch_capacity {program.batch_capacity}",
            )
        if set(map(len, _lane_columns(self))) - {lanes}:  # a column of another length
            for name in LANE_COLUMNS[1:]:
                if len(getattr(self, name)) != lanes:
                    raise ProtocolError(
                        name, f"has {len(getattr(self, name))} entries for {lanes} lanes"
                    )
        prefill = self._check_lanes() if lanes else ()
        self._check_flat(prefill)
        state = program.kind in STATE_KINDS
        if state:  # the records first: the settings name exactly their lanes
            eligible = tuple(range(lanes)) if program.kind is GraphKind.RESTORE else ()
            set_field(self, "restores", check_restores(self.restores, eligible, "state"))
            self._check_sampling(tuple(sorted(lane for lane, _ in self.restores)), "restored")
        else:
            self._check_sampling(prefill)
        self._check_roles(prefill)
        released = check_ints("release_slots", self.release_slots, 0, MAX_SLOTS - 1, MAX_SLOTS)
        check_distinct("release_slots", released)
        if released and lanes:
            overlap = set(released).intersection(self.slot)
            if overlap:
                raise ProtocolError("release_slots", f"slot(s) {sorted(overlap)} also run in lanes")
        set_field(self, "release_slots", released)
        check_int("expected_ns", self.expected_ns)
        if self.copies or type(self.copies) is not tuple:
            set_field(self, "copies", check_copies(self.copies))
        if not state and (self.restores or type(self.restores) is not tuple):
            set_field(self, "restores", check_restores(self.restores, prefill))

    def _check_lanes(self) -> tuple[int, ...]:
        """Range and phase rules of the per-lane columns; the prefill lanes' indices."""
        _LANE_RANGES.check(_ranged_columns(self))
        check_distinct("slot", self.slot)
        phase = self.phase
        prefill: tuple[int, ...] = ()
        program = self.program
        if program.kind in STATE_KINDS:
            _STATE_RANGES.check(_prefill_columns(self))
            return prefill
        rounds = program.kind is GraphKind.SPECULATIVE or (
            program.kind is GraphKind.MIXED and program.token_capacity > 1
        )
        if not all_equal(phase, PHASE_DECODE):
            if rounds:  # decode rows commit up to their query length: ranges per role
                check_range("phase", phase, PHASE_DECODE, PHASE_PREFILL)
            else:
                _PREFILL_RANGES.check(_prefill_columns(self))
            if phase.count(PHASE_PREFILL) == 1:  # a mixed frame's prompt row, a prefill frame
                prefill = (phase.index(PHASE_PREFILL),)
            else:
                prefill = tuple(i for i, p in enumerate(phase) if p)
        if rounds:
            for i in prefill:
                if self.query_len[i] < 1 or not 0 <= self.commits[i] <= 1:
                    raise ProtocolError(
                        f"commits[{i}]", "a prompt row feeds >= 1 token and commits 0 or 1"
                    )
            self._check_rounds(prefill)
            return prefill
        # Decode lanes feed and commit 1 token: one comparison per run between prefill lanes.
        start = 0
        for end in (*prefill, len(phase)):
            for name, lane_rule in (("query_len", "feeds"), ("commits", "commits")):
                i = first_not(getattr(self, name)[start:end], 1)
                if i >= 0:
                    reason = f"a decode lane {lane_rule} exactly 1 token"
                    raise ProtocolError(f"{name}[{start + i}]", reason)
            start = end + 1
        for i in prefill:
            if self.position[i] == 0 and self.page_count[i] == 0:
                reason = "a prefill lane at position 0 needs at least one page"
                raise ProtocolError(f"page_count[{i}]", reason)
        return prefill

    def _check_rounds(self, prefill: tuple[int, ...]) -> None:
        """A speculative round (or a wide mixed program's decode rows): each decode
        lane with its query length (or, device-allocated, its ceiling) in
        [1, min(W, D + 1)], committing at most that many; host-allocated lengths
        fit the program's P target rows.  A speculative round has no prompt row."""
        program = self.program
        if prefill and program.kind is GraphKind.SPECULATIVE:
            raise ProtocolError("phase", "a speculative round has decode lanes only")
        rows = 0
        for i, (q, c) in enumerate(zip(self.query_len, self.commits)):
            if i in prefill:
                continue
            rows += q
            if not 1 <= q <= min(program.token_capacity, program.proposal_depth + 1):
                raise ProtocolError(f"query_len[{i}]", f"{q} outside [1, min(W, D + 1)]")
            if c != q:
                raise ProtocolError(f"commits[{i}]", "a round lane commits up to its query length")
        if not program.device_allocated and rows > program.target_capacity:
            raise ProtocolError(
                "query_len", f"decode rows sum to {rows}, above P = {program.target_capacity}"
            )

    def _check_flat(self, prefill: tuple[int, ...]) -> None:
        """The flat columns against the counts that cut them."""
        tokens = self.prompt_tokens
        expected = sum(self.query_len[i] for i in prefill)
        if len(tokens) != expected:
            raise ProtocolError(
                "prompt_tokens",
                f"has {len(tokens)} tokens, the prefill lanes' query_len sum to {expected}",
            )
        capacity = self.program.prompt_capacity
        if len(tokens) > capacity:
            raise ProtocolError(
                "prompt_tokens",
                f"{len(tokens)} prompt tokens exceed the program's prompt_capacity {capacity}",
            )
        check_range("prompt_tokens", tokens, 0, INT32_MAX)
        pages = self.pages
        total = 0 if all_equal(self.page_count, 0) else sum(self.page_count)
        if len(pages) != total:
            raise ProtocolError("pages", f"has {len(pages)} pages, page_count sums to {total}")
        check_range("pages", pages, 0, INT32_MAX)
        if len(set(pages)) != len(pages):  # distinct overall is enough; else lane by lane
            bounds = offsets(self.page_count)
            for i in range(len(self.page_count)):
                run = pages[bounds[i] : bounds[i + 1]]
                if len(set(run)) != len(run):
                    dup = next(p for k, p in enumerate(run) if p in run[:k])
                    raise ProtocolError("pages", f"lane {i} appends page {dup} twice")

    def _check_sampling(self, prefill: tuple[int, ...], role: str = "prefill") -> None:
        """``sampling`` names exactly the lanes ``prefill`` (the prefill lanes; in a
        state frame the restored ones), in lane order."""
        sampling = self.sampling
        if type(sampling) is not tuple:
            sampling = check_seq("sampling", sampling, MAX_SLOTS)
        if not sampling and not prefill:
            return
        lanes = []
        for k, entry in enumerate(sampling):
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise ProtocolError(f"sampling[{k}]", "must be a (lane index, SamplingParams) pair")
            lane, params = entry
            check_int(f"sampling[{k}][0]", lane, 0, MAX_SLOTS - 1)
            if not isinstance(params, SamplingParams):
                raise ProtocolError(f"sampling[{k}][1]", "must be a SamplingParams")
            lanes.append(lane)
        if tuple(lanes) != prefill:
            raise ProtocolError(
                "sampling", f"must name exactly the {role} lanes {list(prefill)}, got {lanes}"
            )
        set_field(self, "sampling", tuple((lane, params) for lane, params in sampling))

    def _check_roles(self, prefill: tuple[int, ...]) -> None:
        row = check_int("prompt_row", self.prompt_row, -1, len(self.slot) - 1)
        if row >= 0 and self.phase[row] != PHASE_PREFILL:
            raise ProtocolError("prompt_row", f"lane {row} is not a prefill lane")
        kind = self.program.kind
        if kind is GraphKind.MIXED:
            if len(prefill) > 1:
                lanes = list(prefill)
                raise ProtocolError("phase", f"a mixed frame has one prefill lane at most: {lanes}")
            named = prefill[0] if prefill else -1
            if row != named:
                reason = f"must name the prefill lane ({named}), got {row}"
                raise ProtocolError("prompt_row", reason)
        elif row != -1:
            raise ProtocolError("prompt_row", f"only mixed programs have one, not {kind.value}")

    # ------------------------------------------------------------------ views

    @property
    def num_lanes(self) -> int:
        """R, the number of lanes."""
        return len(self.slot)

    def prompt_offsets(self) -> array:
        """Where each lane's chunk lies in ``prompt_tokens``: ``[out[i], out[i + 1])``.

        Decode lanes have empty runs.
        """
        return offsets(q if p else 0 for q, p in zip(self.query_len, self.phase))

    def page_offsets(self) -> array:
        """Where each lane's appended pages lie in ``pages``: ``[out[i], out[i + 1])``."""
        return offsets(self.page_count)

    @property
    def lanes(self) -> tuple[FrameLane, ...]:
        """Every lane as a :class:`FrameLane` (tests and debugging; builds objects)."""
        tokens, pages = self.prompt_offsets(), self.page_offsets()
        settings = dict(self.sampling)
        restores = dict(self.restores)
        return tuple(
            FrameLane(
                self.slot[i],
                self.generation[i],
                PHASE_NAMES[self.phase[i]],
                self.prompt_start[i],
                tuple(self.prompt_tokens[tokens[i] : tokens[i + 1]]),
                self.position[i],
                tuple(self.pages[pages[i] : pages[i + 1]]),
                self.commits[i],
                settings.get(i),
                restores.get(i),
            )
            for i in range(self.num_lanes)
        )

    @classmethod
    def from_lanes(
        cls,
        fence: int,
        program: GraphDescriptor,
        lanes: Sequence[FrameLane],
        prompt_row: int = -1,
        release_slots: Sequence[int] = (),
        expected_ns: int = 0,
        copies: Sequence[tuple[int, int]] = (),
    ) -> Frame:
        """The frame of per-lane views (tests and scripts); each lane's
        ``restore`` goes into ``restores``."""
        lanes = check_seq("lanes", lanes, MAX_SEQUENCE)
        for i, lane in enumerate(lanes):
            if not isinstance(lane, FrameLane):
                raise ProtocolError(f"lanes[{i}]", "must be a FrameLane")
        prefill = [i for i, lane in enumerate(lanes) if lane.phase == "prefill"]
        settings = [i for i, lane in enumerate(lanes) if lane.sampling is not None]
        return cls(
            fence,
            program,
            slot=column(lane.slot for lane in lanes),
            generation=column(lane.generation for lane in lanes),
            phase=column(PHASE_NAMES.index(lane.phase) for lane in lanes),
            position=column(lane.position for lane in lanes),
            query_len=column(lane.query_len for lane in lanes),
            commits=column(lane.commits for lane in lanes),
            prompt_start=column(lane.prompt_start for lane in lanes),
            prompt_tokens=column(t for i in prefill for t in lanes[i].prompt_tokens),
            page_count=column(len(lane.pages) for lane in lanes),
            pages=column(p for lane in lanes for p in lane.pages),
            sampling=tuple((i, lanes[i].sampling) for i in settings),  # type: ignore[misc]
            prompt_row=prompt_row,
            release_slots=tuple(release_slots),
            expected_ns=expected_ns,
            copies=tuple(copies),
            restores=tuple(
                (i, lane.restore) for i, lane in enumerate(lanes) if lane.restore is not None
            ),
        )

    # ------------------------------------------------------------------ wire

    def to_wire(self) -> dict[str, Any]:
        return {
            "fence": self.fence,
            "program": self.program.to_wire(),
            "slot": column_to_wire(self.slot),
            "generation": column_to_wire(self.generation),
            "phase": column_to_wire(self.phase),
            "position": column_to_wire(self.position),
            "query_len": column_to_wire(self.query_len),
            "commits": column_to_wire(self.commits),
            "prompt_start": column_to_wire(self.prompt_start),
            "prompt_tokens": column_to_wire(self.prompt_tokens),
            "page_count": column_to_wire(self.page_count),
            "pages": column_to_wire(self.pages),
            "sampling": [[lane, params.to_wire()] for lane, params in self.sampling],
            "prompt_row": self.prompt_row,
            "release_slots": list(self.release_slots),
            "expected_ns": self.expected_ns,
            "copies": [[src, dst] for src, dst in self.copies],
            "restores": [[lane, restore.to_wire()] for lane, restore in self.restores],
        }

    @classmethod
    def from_wire(cls, data: Any) -> Frame:
        fields = dict(check_fields(cls, data))
        fields["program"] = _program(fields["program"])
        for name in FRAME_COLUMNS:
            fields[name] = column_from_wire(name, fields[name])
        sampling = check_seq("sampling", fields["sampling"], MAX_SLOTS)
        if sampling:
            pairs = []
            for k, entry in enumerate(sampling):
                if not isinstance(entry, list) or len(entry) != 2:
                    raise ProtocolError(
                        f"sampling[{k}]", "must be a (lane index, SamplingParams) pair"
                    )
                params = parse_nested(f"sampling[{k}]", SamplingParams.from_wire, entry[1])
                pairs.append((entry[0], params))
            sampling = tuple(pairs)
        fields["sampling"] = sampling
        fields["copies"] = copies_from_wire(fields["copies"])
        fields["restores"] = restores_from_wire(fields["restores"])
        return cls(**fields)


__all__ = [
    "FRAME_COLUMNS",
    "LANE_COLUMNS",
    "MAX_SLOTS",
    "PHASE_DECODE",
    "PHASE_NAMES",
    "PHASE_PREFILL",
    "PHASE_STATE",
    "STATE_KINDS",
    "Frame",
    "FrameLane",
    "Restore",
]
