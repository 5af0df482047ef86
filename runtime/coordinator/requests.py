"""Request state: progress counters, not phase flags.

A request's phase is derived from its counters: it prefills while committed
prompt consumption is short of the prompt, decodes after that until it
finishes.  Counters change only through validated completions; in-flight
counters record what submitted frames may still add.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class AdmissionError(ValueError):
    """An admission request is invalid; the message names the field."""


class Phase(str, Enum):
    WAITING = "waiting"  # admitted, not yet resident (no slot or pages)
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(frozen=True, order=True)
class RequestHandle:
    """A request's identity: unique for the scheduler's lifetime, never reused.

    Slots and their generations (what the ranks see) are reused; the handle is
    not, so a cancelled handle can never charge a request that reuses its slot.
    """

    id: int


@dataclass(frozen=True)
class RequestSpec:
    """What the scheduler needs to know of a request.

    * ``prompt_len``: uncached prompt tokens to consume.
    * ``max_output_tokens``: output limit (the final prefill chunk commits the first).
    * ``boundaries``: hard prompt positions a prefill chunk never crosses
      (system boundaries, atomic spans).
    * ``message_endpoints``: message ends, used by the prefill exploration rule
      and (later) checkpoint anchors.  The prompt end is always an endpoint.
    * ``host_stop``: stop strings are evaluated on the host, so each decode step
      needs the previous step's completion first.
    * ``grammar``: constrained decoding whose mask the host computes from the
      previous token; the same dependency.
    * ``group``: the admission group (the frontend's HTTP request: every choice
      of one request shares it).  Residency goes round-robin across groups,
      first come first served within one; None is a group of its own.
    """

    prompt_len: int
    max_output_tokens: int
    boundaries: tuple[int, ...] = ()
    message_endpoints: tuple[int, ...] = ()
    host_stop: bool = False
    grammar: bool = False
    group: int | None = None

    @property
    def step_feedback(self) -> bool:
        """Each decode step depends on the previous step's completion."""
        return self.host_stop or self.grammar

    def __post_init__(self) -> None:
        group = self.group
        if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
            raise AdmissionError(f"group must be an integer or None, got {group!r}")
        for name in ("prompt_len", "max_output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AdmissionError(f"{name} must be a positive integer, got {value!r}")
        for name in ("boundaries", "message_endpoints"):
            points = tuple(getattr(self, name))
            for p in points:
                if isinstance(p, bool) or not isinstance(p, int) or not 0 < p <= self.prompt_len:
                    raise AdmissionError(
                        f"{name} must hold integers in (0, prompt_len={self.prompt_len}], got {p!r}"
                    )
            object.__setattr__(self, name, tuple(sorted(set(points))))


def _next_point(points: tuple[int, ...], position: int, end: int) -> int:
    for p in points:
        if p > position:
            return p
    return end


class Request:
    __slots__ = (
        "accounted_output",
        "accounted_prompt",
        "arrival_ns",
        "became_decoder_ns",
        "cancelled",
        "committed_output",
        "consumed_prompt",
        "delivery_rate",
        "finish_reason",
        "generation",
        "handle",
        "inflight_fences",
        "inflight_output",
        "inflight_prompt",
        "last_selected",
        "last_visible_ns",
        "pages",
        "pending_delivery",
        "resident",
        "slot",
        "spec",
        "speculation",
        "token_rate",
        "unpublished",
    )

    def __init__(self, handle: RequestHandle, spec: RequestSpec, arrival_ns: int) -> None:
        self.handle = handle
        self.spec = spec
        self.arrival_ns = arrival_ns
        self.slot = -1
        self.generation = 0
        self.resident = False
        self.pages: list[int] = []
        self.consumed_prompt = 0
        self.committed_output = 0
        self.inflight_prompt = 0  # prompt tokens scheduled in submitted frames
        self.inflight_output = 0  # output tokens submitted frames may still add
        self.inflight_fences: list[int] = []
        # Committed prompt and output already entered into the token history.
        self.accounted_prompt = 0
        self.accounted_output = 0
        self.token_rate: float | None = None  # x, tokens/ms (physical units)
        self.delivery_rate: float | None = None  # z, deliveries/ms
        self.became_decoder_ns: int | None = None
        self.last_visible_ns: int | None = None
        self.last_selected = -1  # selection sequence of its last committed frame
        self.cancelled = False
        self.finish_reason: str | None = None
        # fence -> (frame duration ms) for bursts not yet published
        self.unpublished: dict[int, float] = {}
        # (fence, delivery normalizer) of the latest completion, correctable by publication
        self.pending_delivery: tuple[int, float | None] | None = None
        # Acceptance and confidence estimates (runtime.coordinator.speculation),
        # set at admission when the catalog has speculative programs.
        self.speculation = None

    # -- derived phase -------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def phase(self) -> Phase:
        if self.finished or self.cancelled:
            return Phase.FINISHED
        if not self.resident:
            return Phase.WAITING
        if self.consumed_prompt < self.spec.prompt_len:
            return Phase.PREFILL
        return Phase.DECODE

    @property
    def decoding(self) -> bool:
        return self.phase is Phase.DECODE

    @property
    def runnable(self) -> bool:
        return self.resident and not self.finished and not self.cancelled

    @property
    def in_flight(self) -> bool:
        return bool(self.inflight_fences)

    @property
    def remaining_output(self) -> int:
        return self.spec.max_output_tokens - self.committed_output

    def prefill_available(self, position: int) -> int:
        """Tokens a chunk starting at ``position`` may consume (up to a hard boundary)."""
        end = _next_point(self.spec.boundaries, position, self.spec.prompt_len)
        return end - position

    def distance_to_endpoint(self, position: int) -> int:
        """Tokens from ``position`` to the next message endpoint, boundary or prompt end."""
        end = _next_point(self.spec.message_endpoints, position, self.spec.prompt_len)
        return min(end, position + self.prefill_available(position)) - position

    def pages_needed(self, page_size: int) -> int:
        total = self.spec.prompt_len + self.spec.max_output_tokens
        return -(-total // page_size)


@dataclass(frozen=True, slots=True)
class Participant:
    """A resident runnable request at a commit, and whether it was a stream then."""

    request: Request
    decoding: bool
