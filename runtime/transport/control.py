"""Out-of-band commands both ways: :class:`Control` (handshake, inspection,
profiling, shutdown, heartbeats and a rank's decode errors)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from runtime.transport.fields import (
    MAX_ERROR_CHARS,
    MAX_WORLD_SIZE,
    ProtocolError,
    check_choice,
    check_fields,
    check_int,
    set_field,
)

CONTROL_COMMANDS = (
    "shutdown", "ping", "ready", "inspect", "profile", "profiled", "heartbeat", "error",
)  # fmt: skip
RANK_COMMANDS = ("ready", "profiled", "error")  # sent by a rank
MAX_PROFILE_FRAMES = 1 << 16
COORDINATOR_RANK = -1


def profile_path(directory: str, nonce: int, rank: int) -> str:
    """Where rank ``rank`` writes the trace of profile ``nonce`` (``profile``
    below): both sides of the profiling exchange name the file here."""
    return os.path.join(directory, f"profile-{nonce}", f"rank{rank}.json")


@dataclass(frozen=True)
class Control:
    """Out-of-band commands.  ``rank`` is -1 from the coordinator.

    ``ping`` (coordinator, nonce) is answered by ``ready`` (rank, same nonce);
    ``inspect`` (coordinator, nonce) by a
    :class:`~runtime.transport.inspection.RankStatus` with the same nonce;
    ``profile`` (coordinator, nonce, ``count`` frames) asks every rank to run
    ``torch.profiler`` over its next ``count`` frames and write the trace
    (:mod:`runtime.ranks.profiling`); each answers ``profiled`` (rank, same
    nonce, ``count``: the frames profiled, 0 if the trace could not be written);
    ``shutdown`` asks the ranks to leave their loop.

    Liveness (protocol version 8, :mod:`runtime.transport.liveness`):
    ``heartbeat`` travels both ways on the heartbeat sockets only (coordinator:
    rank -1; a rank: its rank; ``nonce``: the sender's sequence number);
    ``error`` (rank, ``reason``) tells the coordinator that this rank received
    a message it could not even decode (malformed, wrong version, wrong type),
    so a frame may be lost: the coordinator fails the frames in flight naming
    the rank.  ``reason``: at most :data:`MAX_ERROR_CHARS` characters, required
    for ``error``, empty for every other command.
    """

    command: str
    rank: int = COORDINATOR_RANK
    nonce: int = 0
    count: int = 0  # profile: frames to profile; profiled: frames profiled
    reason: str = ""  # error: why the rank could not decode a message

    def __post_init__(self) -> None:
        command = check_choice("command", self.command, CONTROL_COMMANDS)
        rank = check_int("rank", self.rank, COORDINATOR_RANK, MAX_WORLD_SIZE - 1)
        if command in RANK_COMMANDS and rank < 0:
            raise ProtocolError("rank", f"{command!r} comes from a rank (>= 0)")
        check_int("nonce", self.nonce)
        low = 1 if command == "profile" else 0
        check_int("count", self.count, low, MAX_PROFILE_FRAMES)
        reason = self.reason
        if not isinstance(reason, str):
            raise ProtocolError("reason", f"must be a string, got {type(reason).__name__}")
        if len(reason) > MAX_ERROR_CHARS:
            raise ProtocolError(
                "reason", f"at most {MAX_ERROR_CHARS} characters, got {len(reason)}"
            )
        reason = str.__str__(reason)
        if command == "error" and not reason:
            raise ProtocolError("reason", "an error control says why")
        if command != "error" and reason:
            raise ProtocolError("reason", f"only an error control carries one, not {command!r}")
        set_field(self, "command", command)
        set_field(self, "reason", reason)

    def to_wire(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "rank": self.rank,
            "nonce": self.nonce,
            "count": self.count,
            "reason": self.reason,
        }

    @classmethod
    def from_wire(cls, data: Any) -> Control:
        return cls(**check_fields(cls, data))
