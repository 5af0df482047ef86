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

Vision (protocol version 10, docs/vision.md "Rank programs"): a VISION
program's frame has no lanes; it carries ``image_base`` and ``pixels`` and
writes image features into the ranks' feature store; a prompt frame of a
vision model may carry ``feature_rows``, the store row each packed prompt
token reads.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from runtime.catalog import CatalogError, GraphDescriptor, GraphKind
from runtime.transport.columns import (
    as_column,
    check_distinct,
    column,
    column_from_wire,
    column_to_wire,
    offsets,
)
from runtime.transport.fields import (
    MAX_SEQUENCE,
    ProtocolError,
    check_fields,
    check_int,
    check_ints,
    check_seq,
    parse_nested,
    set_field,
)
from runtime.transport.frame_checks import FrameRules
from runtime.transport.frame_lane import MAX_SLOTS, PHASE_NAMES, STATE_KINDS, FrameLane
from runtime.transport.restore import (
    Restore,
    check_copies,
    check_restores,
    copies_from_wire,
    restores_from_wire,
)
from runtime.transport.sampling import SamplingParams

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
# Every int64 column of a frame, in field order (the flat ones too, the scored
# prefill's ``score_next``: one entry per lane there, else empty, and the
# vision columns: ``image_base`` per image, ``feature_rows`` per prompt token).
FRAME_COLUMNS = (
    *LANE_COLUMNS[:7], "prompt_tokens", "page_count", "pages", "score_next", "image_base",
    "feature_rows",
)  # fmt: skip


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


_frame_columns = attrgetter(*FRAME_COLUMNS)
_lane_columns = attrgetter(*LANE_COLUMNS[1:])
_typecode = attrgetter("typecode")
_ARRAY = {array}
_INT64 = {"q"}


@dataclass(frozen=True)
class Frame(FrameRules):
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

    Scored prefill (protocol version 9; ``program.kind`` SCORED_PREFILL,
    docs/scored-prefill.md): every lane is a prefill lane, ``score_next`` has
    one entry per lane, the prompt token right after the lane's chunk (-1 when
    the chunk ends the prompt), so the rank can score the chunk's last position,
    and ``score_k`` (0..MAX_LOGPROBS) is the top-k count rank 0 returns per
    position.  Every other program takes ``score_next`` empty and ``score_k``
    0.

    Vision (protocol version 10; docs/vision.md, "Rank programs"): a VISION
    program's frame encodes ``len(image_base)`` images (1..B) into the ranks'
    feature store: image ``i``'s feature rows go to store rows ``image_base[i]
    + 0..N-1`` (N the model's image tokens); ``pixels`` holds the images as
    float32 (count, 3, H, W), C order, little-endian bytes (the ranks
    know H and W and check the size).  It has no lanes, prompt tokens, pages,
    sampling, copies, restores or releases, and commits nothing.  A prompt
    frame (PREFILL, SCORED_PREFILL, MIXED) may carry ``feature_rows``, one
    entry per prompt token (the order of ``prompt_tokens``): the store row
    whose feature replaces that token's embedding, -1 for a text token; empty
    when it reads no image.  The store bounds are the ranks'.

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
    score_next: array = field(default_factory=_empty)
    score_k: int = 0
    image_base: array = field(default_factory=_empty)
    pixels: bytes = b""
    feature_rows: array = field(default_factory=_empty)

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
        if lanes and program.kind is GraphKind.VISION:
            raise ProtocolError("slot", f"a vision frame has no lanes, got {lanes}")
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
        self._check_scores(prefill)
        self._check_vision()
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
        score_next: Sequence[int] = (),
        score_k: int = 0,
        feature_rows: Sequence[int] = (),
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
            score_next=column(score_next),
            score_k=score_k,
            feature_rows=column(feature_rows),
        )

    @classmethod
    def vision(
        cls,
        fence: int,
        program: GraphDescriptor,
        image_base: Sequence[int],
        pixels: bytes,
        expected_ns: int = 0,
    ) -> Frame:
        """A vision frame: ``len(image_base)`` images (``pixels``: float32
        (count, 3, H, W) bytes, C order) into the feature store at those rows."""
        return cls(
            fence, program, image_base=column(image_base), pixels=pixels, expected_ns=expected_ns
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
            "score_next": column_to_wire(self.score_next),
            "score_k": self.score_k,
            "image_base": column_to_wire(self.image_base),
            "pixels": self.pixels,
            "feature_rows": column_to_wire(self.feature_rows),
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
