"""The rules a :class:`~runtime.transport.frame.Frame` obeys beyond its column
types: lane ranges and phases, speculative rounds, the flat columns against
the counts that cut them, the sampling entries and the mixed program's prompt
row, the vision columns.  Each rule raises :class:`~runtime.transport.fields.ProtocolError` naming
the field; they run on every frame built or received, so each works on whole
columns where it can.
"""

from __future__ import annotations

from array import array
from operator import attrgetter
from typing import Any

from runtime.catalog import PROMPT_KINDS, GraphDescriptor, GraphKind
from runtime.transport.columns import (
    LaneRanges,
    all_equal,
    check_distinct,
    check_range,
    first_not,
    offsets,
)
from runtime.transport.fields import (
    INT32_MAX,
    INT64_MAX,
    MAX_SEQUENCE,
    ProtocolError,
    check_int,
    check_seq,
    set_field,
)
from runtime.transport.frame_lane import (
    MAX_SLOTS,
    PHASE_DECODE,
    PHASE_PREFILL,
    PHASE_STATE,
    STATE_KINDS,
)
from runtime.transport.sampling import MAX_LOGPROBS, SamplingParams

# A vision frame's pixels: float32 RGB images (the rank knows H and W).
PIXEL_CHANNELS = 3
PIXEL_BYTES = 4

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


class FrameRules:
    """The rules of :class:`~runtime.transport.frame.Frame`, which runs them from
    ``__post_init__``: its fields, as far as the rules read them."""

    program: GraphDescriptor
    slot: array
    generation: array
    phase: array
    position: array
    query_len: array
    commits: array
    prompt_start: array
    prompt_tokens: array
    page_count: array
    pages: array
    sampling: tuple[tuple[int, SamplingParams], ...]
    prompt_row: int
    score_next: array
    score_k: int
    copies: Any
    restores: Any
    release_slots: Any
    image_base: array
    pixels: bytes
    feature_rows: array

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
            if phase.count(PHASE_PREFILL) == 1:  # a mixed frame's prompt row, a single prefill
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

    def _check_scores(self, prefill: tuple[int, ...]) -> None:
        """A scored prefill: every lane a prefill lane, ``score_next`` one entry per
        lane in [-1, INT32_MAX] (the vocabulary bound is the rank's), ``score_k``
        in [0, MAX_LOGPROBS]; every other program: neither."""
        lanes = len(self.slot)
        if self.program.kind is GraphKind.SCORED_PREFILL:
            check_int("score_k", self.score_k, 0, MAX_LOGPROBS)
            if len(self.score_next) != lanes:
                reason = f"has {len(self.score_next)} entries for {lanes} lanes"
                raise ProtocolError("score_next", reason)
            if len(prefill) != lanes:
                i = next(i for i in range(lanes) if i not in prefill)
                raise ProtocolError(f"phase[{i}]", "a scored prefill has prefill lanes only")
            check_range("score_next", self.score_next, -1, INT32_MAX)
            return
        check_int("score_k", self.score_k, 0, 0)
        if self.score_next:
            reason = f"only scored prefill frames have one, not {self.program.kind.value}"
            raise ProtocolError("score_next", reason)

    def _check_vision(self) -> None:
        """A vision frame: no lanes, nothing but ``image_base`` (1..B images, rows
        >= 0) and ``pixels`` (a whole number of float32 (3, H, W) images per
        image, the exact size is the rank's); every other frame: neither, and
        ``feature_rows`` only on a prompt frame, one entry per prompt token in
        [-1, INT32_MAX] (the store bound is the rank's)."""
        kind, images = self.program.kind, len(self.image_base)
        pixels = self.pixels
        if type(pixels) is not bytes:
            if not isinstance(pixels, (bytearray, memoryview)):
                raise ProtocolError("pixels", f"must be bytes, got {type(pixels).__name__}")
            set_field(self, "pixels", pixels := bytes(pixels))
        if kind is GraphKind.VISION:
            for name in ("copies", "restores", "release_slots", "feature_rows"):
                if getattr(self, name):
                    raise ProtocolError(name, "a vision frame carries none")
            b = self.program.batch_capacity
            if not 1 <= images <= b:
                raise ProtocolError("image_base", f"{images} images for a vision program of B={b}")
            check_range("image_base", self.image_base, 0, INT32_MAX)
            if not pixels or len(pixels) % (images * PIXEL_CHANNELS * PIXEL_BYTES):
                reason = f"{len(pixels)} bytes are not {images} float32 images of 3 x H x W"
                raise ProtocolError("pixels", reason)
            return
        if images:
            raise ProtocolError("image_base", f"only vision frames have one, not {kind.value}")
        if pixels:
            raise ProtocolError("pixels", f"only vision frames have them, not {kind.value}")
        rows = self.feature_rows
        if not rows:
            return
        if kind not in PROMPT_KINDS:
            raise ProtocolError("feature_rows", f"only prompt frames have one, not {kind.value}")
        if len(rows) != len(self.prompt_tokens):
            reason = f"has {len(rows)} entries for {len(self.prompt_tokens)} prompt tokens"
            raise ProtocolError("feature_rows", reason)
        check_range("feature_rows", rows, -1, INT32_MAX)
