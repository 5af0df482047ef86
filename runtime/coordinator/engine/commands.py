"""The engine's commands: what other threads ask of the engine thread.

Any thread may call :meth:`Engine.submit`, :meth:`Engine.cancel`,
:meth:`Engine.publish`, :meth:`Engine.fail`, :meth:`Engine.rank_gone`,
:meth:`Engine.measure_round_trip` or ask the ranks a question; each queues one
of the frozen commands below, and the engine thread takes them in order at its
next round (``Engine._run_command`` dispatches on their type).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from runtime.coordinator.engine.ranks import RankAsk
from runtime.coordinator.engine.stream import RequestStream


@dataclass
class Probe:
    """A round-trip measurement: ``count`` empty frames, one at a time."""

    count: int
    round_trips_ns: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class SubmitRequest:
    """Admit ``stream``'s request to the scheduler."""

    stream: RequestStream


@dataclass(frozen=True)
class CancelRequest:
    """Stop ``stream``'s request; its stream ends "cancelled"."""

    stream: RequestStream


@dataclass(frozen=True)
class PublishOutput:
    """``stream``'s output through ``fence`` became visible at ``at_ns``."""

    stream: RequestStream
    fence: int
    at_ns: int


@dataclass(frozen=True)
class FailEngine:
    """Fail the engine with ``error`` (raised on the engine thread)."""

    error: BaseException


@dataclass(frozen=True)
class RankLost:
    """Rank ``rank`` is gone (its process exited, its heartbeats stopped)."""

    rank: int
    reason: str


@dataclass(frozen=True)
class StartProbe:
    """Measure round trips with empty frames (planning pauses meanwhile)."""

    probe: Probe


@dataclass(frozen=True)
class AskRanks:
    """Send ``ask`` (inspect, profile) to every rank."""

    ask: RankAsk


Command = (
    SubmitRequest | CancelRequest | PublishOutput | FailEngine | RankLost | StartProbe | AskRanks
)
