"""Fair admission across HTTP requests: residency goes round-robin across
``RequestSpec.group``s (first come, first served within a group), so a later
small request is not queued behind another request's many choices.  Counted in
frames, not wall time."""

from __future__ import annotations

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import AdmissionError, RequestSpec
from tests.support.coordinator_rig import BaseRig

MS = 1_000_000
CATALOG = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    *(GraphDescriptor(GraphKind.DECODE, b) for b in (1, 2, 4, 8)),
)
TIMING = ExecutionTiming((2 * MS,), host_wall_ns=2_500_000)


class Rig(BaseRig):
    def __init__(self, max_slots: int = 8) -> None:
        super().__init__(CATALOG, None, max_slots, num_pages=4096)
        self.frames = 0
        self.first_token: dict[int, int] = {}  # handle id -> frame of its first token

    def step(self) -> None:
        self.tick(3 * MS)
        plan = self.plan()
        fence = self.commit(plan)
        self.tick(2 * MS)
        records = [
            CompletionRecord(lane.slot, lane.generation, (7,) * lane.max_tokens)
            for lane in plan.lanes
        ]
        self.frames += 1
        for g in self.s.complete(fence, records, TIMING):
            self.first_token.setdefault(g.handle.id, self.frames)
            self.s.published_output(g.handle, g.fence)


def frames_to_first_token(grouped: bool, small_prompt: int = 16) -> tuple[int, int]:
    """A request of 256 short choices (16-token prompts) is running and waiting
    when a one-choice request of ``small_prompt`` tokens arrives: frames from its
    arrival to its first token, and the waiting count then."""
    rig = Rig()
    big = 1 if grouped else None
    for _ in range(256):
        rig.s.admit(RequestSpec(prompt_len=16, max_output_tokens=4, group=big))
    for _ in range(30):  # the big request's choices are running (and finishing)
        rig.step()
    waiting = rig.s.waiting
    assert rig.s.running == 8 and waiting > 200
    arrival = rig.frames
    small = rig.s.admit(
        RequestSpec(prompt_len=small_prompt, max_output_tokens=4, group=2 if grouped else None)
    )
    while small.id not in rig.first_token:
        rig.step()
        assert rig.frames < arrival + 2000
    return rig.first_token[small.id] - arrival, waiting


def test_a_small_request_starts_within_a_few_frames_of_a_big_ones_choices():
    frames, waiting = frames_to_first_token(grouped=True)
    # One turn of the rotation: the next slot release or two, then its prefill.
    assert frames <= 12, frames
    # Without groups it is first come, first served: behind every waiting choice.
    fcfs, _ = frames_to_first_token(grouped=False)
    assert fcfs > 10 * frames and fcfs > waiting // 8


@pytest.mark.xfail(
    strict=True,
    reason="issue 26 (the price flow, occupancy): resident at the next turn, but a "
    "1-token prompt's prefill is worth 1/16 of a 16-token one at the same frame cost "
    "and waits 322 frames, until 19 of the 256 choices remain",
)
def test_a_one_token_prompt_starts_within_a_few_frames_of_a_big_ones_choices():
    """As above with a one-token prompt (was the HTTP test
    tests/frontend/test_server.py::test_a_small_request_completes_while_a_big_one_runs,
    which failed or passed by timing)."""
    frames, _ = frames_to_first_token(grouped=True, small_prompt=1)
    assert frames <= 12, frames


def test_residency_rotates_across_groups_fcfs_within_each():
    rig = Rig(max_slots=1)
    specs = [("a", 1), ("a", 1), ("a", 1), ("b", 2), ("c", 3), ("c", 3)]
    handles = {}
    for i, (name, group) in enumerate(specs):
        handles[rig.s.admit(RequestSpec(prompt_len=16, max_output_tokens=1, group=group)).id] = (
            f"{name}{i}"
        )
    order = []
    while rig.s.active_requests():
        resident = [r for r in rig.s.active_requests() if r.resident]
        assert len(resident) == 1
        if not order or order[-1] != handles[resident[0].handle.id]:
            order.append(handles[resident[0].handle.id])
        rig.step()
    # a0 took the free slot at once; then a, b, c in turn, a's requests in order.
    assert order == ["a0", "a1", "b3", "c4", "a2", "c5"]


def test_ungrouped_requests_stay_first_come_first_served():
    rig = Rig(max_slots=1)
    handles = [rig.s.admit(RequestSpec(prompt_len=16, max_output_tokens=1)) for _ in range(4)]
    order = []
    while rig.s.active_requests():
        (resident,) = [r for r in rig.s.active_requests() if r.resident]
        if not order or order[-1] != resident.handle.id:
            order.append(resident.handle.id)
        rig.step()
    assert order == [h.id for h in handles]


def test_cancelling_a_waiting_choice_leaves_its_group_and_the_count_right():
    rig = Rig(max_slots=1)
    rig.s.admit(RequestSpec(prompt_len=16, max_output_tokens=1, group=1))
    a = rig.s.admit(RequestSpec(prompt_len=16, max_output_tokens=1, group=1))
    b = rig.s.admit(RequestSpec(prompt_len=16, max_output_tokens=1, group=2))
    assert rig.s.waiting == 2
    assert rig.s.cancel(a) and rig.s.waiting == 1
    assert rig.s.cancel(b) and rig.s.waiting == 0
    while rig.s.active_requests():
        rig.step()
    c = rig.s.admit(RequestSpec(prompt_len=16, max_output_tokens=1, group=2))
    assert rig.s.request(c).resident  # the group's old entry is gone


@pytest.mark.parametrize("group", [True, 1.5, "x"])
def test_a_group_is_an_integer_or_none(group):
    with pytest.raises(AdmissionError, match="group"):
        RequestSpec(prompt_len=1, max_output_tokens=1, group=group)
