"""Direct mode's requests and their residency: first come, first served.

A request waits until a request slot and its worst-case KV pages (prompt plus
output limit) are free, then holds both until it is finished or cancelled and
has no frame in flight.  The oldest waiting request is always next: a head
that does not fit holds back everyone behind it (no skipping, so nobody
starves).  Admission groups (``RequestSpec.group``) play no part here.
"""

from __future__ import annotations

from collections import deque

from runtime.coordinator.errors import SchedulerError
from runtime.coordinator.requests import Phase, RequestHandle, RequestSpec
from runtime.coordinator.resources import PagePool, SlotPool


class DirectRequest:
    """One admitted request: its counters, its residency, its frame in flight.

    ``consumed_prompt`` and ``committed_output`` change only through validated
    completions.  ``fence`` is the frame it is in (at most one), or None.
    ``last_served``: the sequence number of its lane in the last frame it was
    in (lanes are numbered across commits, in lane order; -1: none yet), which
    orders decoders least recently served first: a strict rotation.
    """

    __slots__ = (
        "arrival",
        "cancelled",
        "committed_output",
        "consumed_prompt",
        "fence",
        "finish_reason",
        "generation",
        "handle",
        "last_served",
        "pages",
        "resident",
        "slot",
        "spec",
    )

    def __init__(self, handle: RequestHandle, spec: RequestSpec, arrival: int) -> None:
        self.handle = handle
        self.spec = spec
        self.arrival = arrival  # admission order
        self.slot = -1
        self.generation = 0
        self.pages: list[int] = []
        self.resident = False
        self.consumed_prompt = 0
        self.committed_output = 0
        self.fence: int | None = None
        self.last_served = -1
        self.cancelled = False
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def runnable(self) -> bool:
        return self.resident and not self.finished and not self.cancelled

    @property
    def in_flight(self) -> bool:
        return self.fence is not None

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
    def remaining_output(self) -> int:
        return self.spec.max_output_tokens - self.committed_output

    def prompt_left(self) -> int:
        """Prompt tokens the next chunk may consume: up to the next hard boundary
        (``RequestSpec.boundaries``) or the prompt end."""
        position = self.consumed_prompt
        end = next((p for p in self.spec.boundaries if p > position), self.spec.prompt_len)
        return end - position

    def pages_needed(self, page_size: int) -> int:
        return -(-(self.spec.prompt_len + self.spec.max_output_tokens) // page_size)


class DirectResidency:
    """Admitted requests: the FCFS waiting line and the residents."""

    def __init__(self, max_slots: int, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.slots = SlotPool(max_slots)
        self.pages = PagePool(num_pages, page_size)
        self.requests: dict[int, DirectRequest] = {}  # admitted, not yet retired
        self.waiting: deque[DirectRequest] = deque()
        self.resident: dict[int, DirectRequest] = {}  # by handle id, in residency order
        self._next_handle = 0

    def admit(self, spec: RequestSpec) -> DirectRequest:
        """Queue ``spec``; refuse one that could never fit the page pool."""
        if not isinstance(spec, RequestSpec):
            raise TypeError("admit takes a RequestSpec")
        needed = -(-(spec.prompt_len + spec.max_output_tokens) // self.page_size)
        if needed > self.num_pages:
            raise SchedulerError(
                f"request needs {needed} KV pages (prompt_len + max_output_tokens), "
                f"the pool has {self.num_pages}"
            )
        handle = RequestHandle(self._next_handle)
        request = DirectRequest(handle, spec, self._next_handle)
        self._next_handle += 1
        self.requests[handle.id] = request
        self.waiting.append(request)
        self.fill()
        return request

    def fill(self) -> None:
        """Make the oldest waiting requests resident while a slot and their pages are free."""
        while self.waiting and self.slots.free_count:
            head = self.waiting[0]
            needed = head.pages_needed(self.page_size)
            if needed > self.pages.free_count:
                return
            self.waiting.popleft()
            head.slot, head.generation = self.slots.acquire()
            head.pages = self.pages.reserve(needed)
            head.resident = True
            self.resident[head.handle.id] = head

    def forget_waiting(self, request: DirectRequest) -> None:
        """Drop a request that never became resident."""
        self.waiting.remove(request)
        del self.requests[request.handle.id]

    def retire_if_done(self, request: DirectRequest) -> bool:
        """Free the slot and pages of a finished or cancelled request with no frame
        in flight, then admit whoever now fits; True if it retired."""
        if not request.resident or request.runnable or request.in_flight:
            return False
        self.slots.release(request.slot)
        self.pages.release(request.pages)
        request.pages = []
        request.resident = False
        del self.resident[request.handle.id]
        del self.requests[request.handle.id]
        self.fill()
        return True
