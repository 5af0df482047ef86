"""Request state: progress counters, not phase flags.

A request's phase is derived from its counters: it prefills while committed
prompt consumption is short of the prompt, decodes after that until it
finishes.  Counters change only through validated completions; in-flight
counters record what submitted frames may still add.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from runtime.coordinator.speculation import SpeculationState
from runtime.image_spans import ImageSpan, ImageSpanError, check_spans, keyed_tokens

if TYPE_CHECKING:
    from runtime.coordinator.windows import VisionState


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

    * ``prompt_len``: prompt tokens (a prefix found in the cache is attached,
      not consumed: only the uncached rest is prompt work).
    * ``max_output_tokens``: output limit (the final prefill chunk commits the first).
    * ``boundaries``: hard prompt positions a prefill chunk never crosses
      (system boundaries, atomic spans).
    * ``message_endpoints``: message ends, used by the prefill exploration rule
      and (later) checkpoint anchors.  The prompt end is always an endpoint.
    * ``host_stop``: stop strings are evaluated on the host, so each decode step
      needs the previous step's completion first.
    * ``grammar``: constrained decoding whose mask the host computes from the
      previous token; the same dependency.
    * ``prompt_tokens``: the prompt's token ids, the content key of its pages in
      the prefix cache; empty: the request neither reuses nor publishes pages
      (and, naming no tokens to recompute, is never chosen for preemption).
    * ``cache_salt``: requests share cached pages only with equal salts.
    * ``score_prompt``: the prompt's log probabilities are wanted (echo with
      logprobs, prompt_logprobs): its prompt work runs only on scored prefill
      programs (never a plain prefill or a mixed prompt row), it attaches no
      cached prefix (the cache holds no scores; it recomputes them and may
      still publish) and its ``max_output_tokens`` may be 0 (it finishes when
      its prompt completes).  docs/scored-prefill.md.
    * ``images``: the prompt's image spans (positions of each image's feature
      rows and the digest of its pixels), in prompt order, disjoint: each is
      atomic (a prefill chunk holds it whole or not at all), its features are
      encoded by a vision frame before a prefill chunk may consume it, and its
      digest enters the content key of every page it touches
      (docs/vision.md, "Scheduling").
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
    prompt_tokens: tuple[int, ...] = ()
    cache_salt: str = ""
    score_prompt: bool = False
    images: tuple[ImageSpan, ...] = ()

    @property
    def step_feedback(self) -> bool:
        """Each decode step depends on the previous step's completion."""
        return self.host_stop or self.grammar

    def __post_init__(self) -> None:
        group = self.group
        if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
            raise AdmissionError(f"group must be an integer or None, got {group!r}")
        if not isinstance(self.score_prompt, bool):
            raise AdmissionError(f"score_prompt must be a bool, got {self.score_prompt!r}")
        for name in ("prompt_len", "max_output_tokens"):
            value = getattr(self, name)
            least = 0 if name == "max_output_tokens" and self.score_prompt else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a non-negative" if least == 0 else "a positive"
                raise AdmissionError(f"{name} must be {kind} integer, got {value!r}")
        if not isinstance(self.cache_salt, str):
            raise AdmissionError(f"cache_salt must be a string, got {self.cache_salt!r}")
        tokens = tuple(self.prompt_tokens)
        if tokens and len(tokens) != self.prompt_len:
            raise AdmissionError(
                f"prompt_tokens has {len(tokens)} ids, prompt_len is {self.prompt_len}"
            )
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
            raise AdmissionError("prompt_tokens must hold non-negative integers")
        object.__setattr__(self, "prompt_tokens", tokens)
        for name in ("boundaries", "message_endpoints"):
            points = tuple(getattr(self, name))
            for p in points:
                if isinstance(p, bool) or not isinstance(p, int) or not 0 < p <= self.prompt_len:
                    raise AdmissionError(
                        f"{name} must hold integers in (0, prompt_len={self.prompt_len}], got {p!r}"
                    )
            object.__setattr__(self, name, tuple(sorted(set(points))))
        try:
            object.__setattr__(self, "images", check_spans(self.images, self.prompt_len))
        except ImageSpanError as exc:
            raise AdmissionError(str(exc)) from None


def _next_point(points: tuple[int, ...], position: int, end: int) -> int:
    for p in points:
        if p > position:
            return p
    return end


class Request:
    __slots__ = (
        "accounted_output",
        "accounted_prompt",
        "admitted_seq",
        "arrival_ns",
        "became_decoder_ns",
        "cached_tokens",
        "cancelled",
        "committed_output",
        "consumed_prompt",
        "copy_fence",
        "copy_sources",
        "delivery_rate",
        "finish_reason",
        "generation",
        "handle",
        "history_end",
        "inflight_fences",
        "inflight_output",
        "inflight_prompt",
        "last_selected",
        "last_visible_ns",
        "output_tokens",
        "pages",
        "pending_delivery",
        "preempted",
        "preemptions",
        "prefill_target",
        "resident",
        "restore_pending",
        "scored_through",
        "slot",
        "spec",
        "speculation",
        "start",
        "terminal_since_ns",
        "token_rate",
        "unpublished",
        "vision",
    )

    def __init__(self, handle: RequestHandle, spec: RequestSpec, arrival_ns: int) -> None:
        self.handle = handle
        self.spec = spec
        self.arrival_ns = arrival_ns
        self.slot = -1
        self.generation = 0
        self.resident = False
        self.pages: list[int] = []
        # Prefix cache and preemption (runtime.coordinator.residency): the KV
        # positions to fill before decoding (the prompt; after a preemption the
        # prompt and the output emitted so far), positions below which filling is
        # restored history (no value, no service), the first residency's cached
        # prompt tokens (usage), every committed output token, the copy-on-write
        # source held until the generation's first frame (``copy_fence``) ran,
        # and how the current generation starts on the ranks.
        self.prefill_target = spec.prompt_len
        self.history_end = 0
        self.cached_tokens: int | None = None
        self.output_tokens: list[int] = []
        self.copy_sources: list[int] = []
        self.copy_fence: int | None = None
        self.start: GenerationStart | None = None
        self.preempted = False
        self.preemptions = 0
        # State programs (runtime.coordinator.state_ops): a resumed request's
        # restore row is still to run; when termination (finish or preemption)
        # was identified, the start of its terminal age.
        self.restore_pending = False
        self.terminal_since_ns: int | None = None
        self.admitted_seq = 0
        self.consumed_prompt = 0
        # A scored prompt (spec.score_prompt): positions whose scores its
        # completed chunks returned (what it may attach from the cache).
        self.scored_through = 0
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
        self.speculation: SpeculationState | None = None
        # Image windows (runtime.coordinator.vision), set at admission for a
        # request with images: its active window, what is encoded, its stage.
        self.vision: VisionState | None = None

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
        if self.consumed_prompt < self.prefill_target:
            return Phase.PREFILL
        return Phase.DECODE

    @property
    def decoding(self) -> bool:
        """``phase is Phase.DECODE``, read without building the phase (hot)."""
        return (
            self.resident
            and self.finish_reason is None
            and not self.cancelled
            and self.consumed_prompt >= self.prefill_target
        )

    @property
    def runnable(self) -> bool:
        return (
            self.resident
            and not (
                self.finish_reason is not None
                or self.cancelled
                or self.preempted
                or self.restore_pending
            )
            and (self.vision is None or not self.vision.transition)
        )

    @property
    def window_waiting(self) -> bool:
        """Resident, alive, and between two image windows: its next row is a
        window snapshot or restore (runtime.coordinator.vision)."""
        return (
            self.vision is not None
            and self.vision.transition
            and self.resident
            and not (self.finish_reason is not None or self.cancelled or self.preempted)
        )

    @property
    def participates(self) -> bool:
        """An interval of service history counts it (docs/scheduling-utility.md,
        "Every participant, every interval"): runnable, or resident awaiting the
        restore that makes it runnable (a candidate of every decision meanwhile,
        so a decision that passes it over starves it like any other)."""
        return self.resident and not (
            self.finish_reason is not None or self.cancelled or self.preempted
        )

    @property
    def in_flight(self) -> bool:
        return bool(self.inflight_fences)

    @property
    def remaining_output(self) -> int:
        return self.spec.max_output_tokens - self.committed_output

    def prefill_available(self, position: int) -> int:
        """Tokens a chunk starting at ``position`` may consume (up to a hard boundary)."""
        end = _next_point(self.spec.boundaries, position, self.prefill_target)
        if self.vision is not None:  # up to the first image not yet encoded
            end = min(end, self.vision.stop(position))
            return max(0, min(end, self.prefill_target) - position)
        return min(end, self.prefill_target) - position

    def prefill_reach(self, position: int) -> int:
        """:meth:`prefill_available` once the active image window is encoded
        (what the pages of its next chunks should cover)."""
        if self.vision is None:
            return self.prefill_available(position)
        end = _next_point(self.spec.boundaries, position, self.prefill_target)
        end = min(end, self.vision.window_stop())
        return max(0, min(end, self.prefill_target) - position)

    def distance_to_endpoint(self, position: int) -> int:
        """Tokens from ``position`` to the next message endpoint, boundary or prompt end."""
        end = _next_point(self.spec.message_endpoints, position, self.prefill_target)
        return min(end, position + self.prefill_available(position)) - position

    @property
    def kv_filled(self) -> int:
        """KV positions the ranks hold for this request once its in-flight work is
        done: the filled prefix while it prefills; else the prompt and every
        committed output token but the last (the pending one, fed by the next
        decode step)."""
        if self.consumed_prompt < self.prefill_target:
            return self.consumed_prompt
        if not self.committed_output:  # decode-ready after a restore: its last token pends
            return self.prefill_target - 1
        return self.spec.prompt_len + self.committed_output - 1

    def known_tokens(self) -> tuple[int, ...]:
        """Its prompt and committed output, by position (empty without prompt ids)."""
        if not self.spec.prompt_tokens:
            return ()
        return self.spec.prompt_tokens + tuple(self.output_tokens)

    def cache_tokens(self) -> tuple[int, ...]:
        """The content key of its pages in the prefix cache: its known tokens,
        with every image position keyed by the image's digest."""
        tokens = self.known_tokens()
        if not self.spec.images or not tokens:
            return tokens
        return keyed_tokens(tokens, self.spec.images)


@dataclass(frozen=True)
class GenerationStart:
    """How a request's new generation (slot tenancy) begins on the ranks.

    ``tokens``: its known sequence (prompt, then output already emitted, which
    a resumed request recomputes); ``output_start``: where the output begins in
    ``tokens``; ``position``: KV positions already valid in its attached cached
    pages; ``copies``: (cached page, private page) copy-on-write pairs to run
    before its first frame.  A plain start (position 0, no output, no copies)
    needs nothing beyond today's first prefill lane.
    """

    tokens: tuple[int, ...]
    output_start: int
    position: int
    copies: tuple[tuple[int, int], ...] = ()

    @property
    def plain(self) -> bool:
        return not self.position and self.output_start == len(self.tokens) and not self.copies


@dataclass(frozen=True, slots=True)
class Participant:
    """A resident runnable request at a commit, and whether it was a stream then."""

    request: Request
    decoding: bool
