"""Vision and window rows at commit and completion (docs/vision.md,
"Scheduling"): commit's checks of a vision frame or a window transition plan,
what committing one reserves (window slots, the private snapshot row), and
what a completed image row changes.  Pure Python."""

from __future__ import annotations

from runtime.catalog import GraphKind
from runtime.coordinator.errors import CommitError
from runtime.coordinator.plan import LanePhase, LaneWork, ScheduledPlan, VisionImage
from runtime.coordinator.requests import Request
from runtime.coordinator.resources import SlotPool
from runtime.coordinator.vision import Stage, WindowStore, check_vision_lane, check_window_lane

WINDOW_PHASES = frozenset({LanePhase.WINDOW_SNAPSHOT, LanePhase.WINDOW_RESTORE})
IMAGE_PHASES = WINDOW_PHASES | {LanePhase.VISION}
_WINDOW_KINDS = {
    LanePhase.WINDOW_SNAPSHOT: GraphKind.SNAPSHOT,
    LanePhase.WINDOW_RESTORE: GraphKind.RESTORE,
}


def check_image_plan(
    plan: ScheduledPlan, requests: dict[int, Request], store: WindowStore | None
) -> list[Request]:
    """A vision frame's or a window transition's lanes (each raises CommitError
    naming the request); returns the lanes' requests."""
    if store is None:
        raise CommitError("the scheduler has no image windows")
    kind = plan.graph.kind
    if kind is GraphKind.VISION:
        return _check_vision(plan, requests, store)
    phases = {lane.phase for lane in plan.lanes}
    if len(phases) != 1 or _WINDOW_KINDS.get(next(iter(phases))) is not kind:
        raise CommitError(f"window rows of one stage only, on its program (got {kind.value})")
    rows_free = len(store.free_rows)
    out: list[Request] = []
    for lane in _distinct(plan.lanes):
        r = requests.get(lane.handle.id)
        holds = r is not None and r.vision is not None and r.vision.snapshot_row >= 0
        if lane.phase is LanePhase.WINDOW_SNAPSHOT and not holds:
            rows_free -= 1
        out.append(check_window_lane(lane, r, holds or rows_free >= 0))
    return out


def _distinct(lanes: tuple[LaneWork, ...]) -> tuple[LaneWork, ...]:
    seen: set[int] = set()
    for lane in lanes:
        if lane.handle.id in seen:
            raise CommitError(f"request {lane.handle.id} appears twice in the plan")
        seen.add(lane.handle.id)
    return lanes


def _check_vision(
    plan: ScheduledPlan, requests: dict[int, Request], store: WindowStore
) -> list[Request]:
    images = plan.vision_images
    if not images or len(images) > plan.graph.batch_capacity:
        raise CommitError(
            f"a vision plan encodes 1..{plan.graph.batch_capacity} images, got {len(images)}"
        )
    by_handle: dict[int, list[VisionImage]] = {}
    for image in images:
        by_handle.setdefault(image.handle.id, []).append(image)
    if set(by_handle) != {lane.handle.id for lane in plan.lanes}:
        raise CommitError("a vision plan's images and lanes name different requests")
    claimed: set[int] = set()
    out: list[Request] = []
    for lane in _distinct(plan.lanes):
        if lane.phase is not LanePhase.VISION:
            raise CommitError(
                f"request {lane.handle.id}: a {lane.phase.value} row in a vision plan"
            )
        own = by_handle[lane.handle.id]
        r = check_vision_lane(lane, requests.get(lane.handle.id), own, store.free_windows)
        assert r.vision is not None
        slot = own[0].window_slot
        if slot != r.vision.window_slot:
            if slot in claimed:
                raise CommitError(f"window slot {slot} given to two requests")
            claimed.add(slot)
        out.append(r)
    return out


def commit_windows(plan: ScheduledPlan, requests: list[Request], store: WindowStore) -> None:
    """What a committed image plan reserves: each vision request's window slot
    and the images in flight; each window snapshot's private row."""
    if plan.graph.kind is GraphKind.VISION:
        for r in requests:
            state = r.vision
            assert state is not None
            own = [im for im in plan.vision_images if im.handle == r.handle]
            if state.window_slot < 0:
                store.take_window(own[0].window_slot)
                state.window_slot = own[0].window_slot
            state.encoding = len(own)
        return
    for lane, r in zip(plan.lanes, requests):
        if lane.phase is LanePhase.WINDOW_SNAPSHOT and r.vision is not None:
            store.reserve_row(r.vision)


def complete_image_lane(lane: LaneWork, r: Request, slots: SlotPool) -> None:
    """A completed vision or window row: images encoded; the window snapshot
    taken (no publication: it is private); the restore binding that state to a
    fresh request generation whose next window writes from offset zero."""
    state = r.vision
    if state is None:
        return
    if lane.phase is LanePhase.VISION:
        state.encoded += state.encoding
        state.encoding = 0
    elif r.cancelled or r.finished or r.preempted:
        return
    elif lane.phase is LanePhase.WINDOW_SNAPSHOT:
        state.stage = Stage.RESTORE
    elif lane.phase is LanePhase.WINDOW_RESTORE:
        r.generation = slots.renew(r.slot)
        state.reset(r.consumed_prompt)


def after_prefill(r: Request, store: WindowStore | None) -> None:
    """A completed prefill chunk of a request with images: a consumed window
    frees its slot; at the following window's first span the transition is due."""
    state = r.vision
    if state is None or store is None:
        return
    pos = r.consumed_prompt
    if state.consumed(pos):
        store.release_window(state)
    if state.at_boundary(pos):
        state.stage = Stage.SNAPSHOT
        store.reserve_row(state)  # (held since residency, or one free now)
