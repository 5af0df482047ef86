"""Property test of the scheduler's KV memory: random arrivals (some sharing
prefixes), cancellations and pool sizes, with and without state programs and
the prefix cache.  After every completion the page accounting is exact (the
debug check), every request that is not cancelled gets exactly its tokens
(no gap, no repeat, across preemptions and restores), and at the end every
page is free or idle in the cache."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler

MS = 1_000_000
BASE = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.DECODE, 1),
    GraphDescriptor(GraphKind.DECODE, 4),
)
STATE = (
    GraphDescriptor(GraphKind.SNAPSHOT, 1),
    GraphDescriptor(GraphKind.SNAPSHOT, 4),
    GraphDescriptor(GraphKind.RESTORE, 1),
    GraphDescriptor(GraphKind.RESTORE, 4),
)

REQUEST = st.tuples(
    st.integers(0, 2),  # which shared prefix (or none: 2)
    st.integers(1, 40),  # own prompt tokens
    st.integers(1, 80),  # max tokens
    st.integers(0, 6),  # arrives after this many steps
    st.one_of(st.none(), st.integers(1, 40)),  # cancelled this many steps after arrival
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(REQUEST, min_size=1, max_size=8),
    st.integers(6, 16),
    st.booleans(),
    st.booleans(),
)
def test_random_workloads_keep_pages_exact_and_tokens_whole(requests, pages, state, caching):
    longest = max(p + n for _, p, n, _, _ in requests) + 40
    pages = max(pages, -(-longest // 16) + 1)  # every request fits the pool alone
    config = SchedulerConfig(
        max_slots=4, page_size=16, num_pages=pages,
        enable_prefix_caching=caching, debug_page_accounting=True,
    )  # fmt: skip
    s = Scheduler(list(BASE + (STATE if state else ())), config)
    prefixes = [tuple(range(100, 140)), tuple(range(200, 224)), ()]
    pending = sorted(enumerate(requests), key=lambda item: item[1][3])
    handles: dict[int, object] = {}
    cancel_at: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    cancelled: set[int] = set()
    now = fence = step = 0
    for _ in range(4000):
        while pending and pending[0][1][3] <= step:
            i, (which, own, limit, _, cancel) = pending.pop(0)
            tokens = prefixes[which][:40] + tuple(1000 + 50 * i + k for k in range(own))
            h = s.admit(RequestSpec(len(tokens), limit, prompt_tokens=tokens))
            handles[h.id] = (i, limit)
            out[h.id] = []
            if cancel is not None:
                cancel_at[h.id] = step + cancel
        for hid, at in list(cancel_at.items()):
            if at <= step:
                handle = _handle(s, hid)
                if handle is not None and s.cancel(handle):
                    cancelled.add(hid)
                del cancel_at[hid]
        step += 1
        now += MS
        s.advance_to(now)
        plan = s.plan()
        if plan is None:
            if not pending and not s.running and not s.waiting and not s._res.resident:
                break
            continue
        fence += 1
        s.commit(plan, fence)
        records = []
        for lane in plan.lanes:
            k = len(out[lane.handle.id])
            tokens = tuple(10_000 * lane.handle.id + k + j for j in range(lane.max_tokens))
            records.append(CompletionRecord(lane.slot, lane.generation, tokens))
        now += 2 * MS
        s.advance_to(now)
        for g in s.complete(fence, records, ExecutionTiming((2 * MS,))):
            out[g.handle.id] += g.tokens
            if g.tokens:
                s.published_output(g.handle, g.fence)
    else:
        raise AssertionError("the workload did not drain")
    s.check_page_accounting()
    stats = s.memory_stats()
    event(f"preempted: {stats['preemptions'] > 0}")
    event(f"cache hits: {stats['prefix_cache_hit_tokens'] > 0}")
    event(f"cancelled: {bool(cancelled)}")
    assert stats["kv_pages_held"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached_idle"] == pages
    for hid, tokens in out.items():
        # A prefix of the exact sequence: whole when not cancelled.
        assert tokens == [10_000 * hid + k for k in range(len(tokens))]
        assert len(tokens) <= handles[hid][1]
        if hid not in cancelled:
            assert len(tokens) == handles[hid][1]


def _handle(s: Scheduler, hid: int):
    for r in s.active_requests():
        if r.handle.id == hid:
            return r.handle
    return None
