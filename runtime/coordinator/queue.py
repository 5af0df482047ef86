"""The two-slot execution queue (spec, "Planning and the execution queue").

Only ordinary decode and complete speculative generation may occupy both slots,
and only with a known, fresh cost; everything else drains the window.  There is
no millisecond cap on a frame or on the queue: expected finish times only give
the planning start of an appended frame.  An overrun of the head frame suspends
further queueing until its completion supplies feedback.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from runtime.coordinator.plan import ScheduledPlan, SelectionReason
from runtime.coordinator.requests import Participant, Request
from runtime.coordinator.service import Normalizers

FRAME_SLOTS = 2


@dataclass(slots=True)
class QueuedFrame:
    """A committed frame in the execution queue, awaiting its completion (the
    scheduler's record of it; the ranks receive a :class:`runtime.transport.frame.Frame`)."""

    fence: int
    plan: ScheduledPlan
    reason: SelectionReason
    dispatch_ns: int
    expected_end_ns: int
    exclusive: bool  # needs an empty window and blocks queueing behind it
    participants: list[Participant]
    lane_requests: list[Request]
    normalizers: Normalizers  # of the measured catalog at commit


class ExecutionQueue:
    def __init__(self) -> None:
        self.frames: deque[QueuedFrame] = deque()

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def empty(self) -> bool:
        return not self.frames

    @property
    def head(self) -> QueuedFrame | None:
        return self.frames[0] if self.frames else None

    def expected_end_ns(self, now_ns: int) -> int:
        return max(now_ns, self.frames[-1].expected_end_ns) if self.frames else now_ns

    def accepts_queued(self, now_ns: int) -> bool:
        """Whether a queueable frame may be appended now."""
        if not self.frames:
            return True
        if len(self.frames) >= FRAME_SLOTS:
            return False
        if any(f.exclusive for f in self.frames):
            return False
        return now_ns <= self.frames[0].expected_end_ns  # an overrun suspends queueing

    def push(self, frame: QueuedFrame) -> None:
        self.frames.append(frame)

    def pop_head(self, now_ns: int) -> QueuedFrame:
        """Remove the completed head; the frames behind it now start from ``now_ns``.

        Expected ends are rebased on the observed completion, so early or late
        frames neither accumulate drift nor make the next frame look overrun.
        """
        head = self.frames.popleft()
        end = now_ns
        for frame in self.frames:
            end += frame.plan.estimated_duration_ns
            frame.expected_end_ns = end
        return head
