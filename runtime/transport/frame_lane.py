"""One lane of a frame: the lane phases, the slot bound and :class:`FrameLane`,
the per-lane view of a :class:`~runtime.transport.frame.Frame` (tests,
debugging, scripts; never the hot path).

State programs (``GraphKind.RESTORE`` and ``GraphKind.SNAPSHOT``, protocol
version 7) run no forward: their lanes have phase :data:`PHASE_STATE`, feed and
commit nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.catalog import MAX_BATCH_CAPACITY, GraphKind
from runtime.transport.fields import INT32_MAX, ProtocolError, check_choice, check_ints, set_field
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams

MAX_SLOTS = MAX_BATCH_CAPACITY  # slots are 0..63

PHASE_DECODE = 0
PHASE_PREFILL = 1
PHASE_STATE = 2
PHASE_NAMES = ("decode", "prefill", "state")  # PHASE_NAMES[code]
# The state programs (protocol version 7): their frames hold only state lanes,
# which feed and commit nothing, and state lanes appear in no other program.
STATE_KINDS = frozenset({GraphKind.RESTORE, GraphKind.SNAPSHOT})


@dataclass(frozen=True)
class FrameLane:
    """One lane of a frame, as a view (tests, debugging, scripts; not the hot path).

    ``phase``: "prefill", "decode" or "state" (a state program's row: it feeds
    and commits nothing; with a ``restore`` and its ``sampling`` it starts a
    new generation, else it drops a known one).  ``prompt_tokens``: a prefill lane's
    chunk, written from ``position`` (``prompt_start`` is where it starts in the
    prompt); a decode lane carries none (the ranks keep each slot's pending
    token) and feeds 1 token.  ``pages``: the pages this lane appends to its
    slot's rank-side table (see :mod:`runtime.transport.frame`).  ``commits``: tokens the
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
