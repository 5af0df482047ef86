"""Pages on demand, preemption and the prefix cache through the public Scheduler API
(runtime.coordinator.residency, runtime.coordinator.kvcache; docs/checkpoints.md)."""

from __future__ import annotations

import random

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import SchedulerConfig
from runtime.coordinator.errors import SchedulerError
from runtime.coordinator.plan import LanePhase
from runtime.coordinator.records import CompletionRecord, ExecutionTiming
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from runtime.coordinator.utility import prompt_chunk_value

MS = 1_000_000
PAGE = 16
CATALOG = (
    GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=64),
    GraphDescriptor(GraphKind.DECODE, 1),
    GraphDescriptor(GraphKind.DECODE, 4),
)
TIMING = ExecutionTiming((2 * MS,), host_wall_ns=2_500_000)


class Sim:
    """A scheduler driven to completion; output token k of request h is 1000 h + k
    (what a deterministic model would give however the KV was rebuilt)."""

    def __init__(self, num_pages: int, max_slots: int = 8, caching: bool = True) -> None:
        config = SchedulerConfig(
            max_slots=max_slots,
            page_size=PAGE,
            num_pages=num_pages,
            enable_prefix_caching=caching,
            debug_page_accounting=True,
        )
        self.s = Scheduler(list(CATALOG), config)
        self.now = 0
        self.fence = 0
        self.out: dict[int, list[int]] = {}
        self.prefill_tokens: dict[int, int] = {}  # prompt tokens computed per request
        self.starts: dict[int, list] = {}

    def admit(self, prompt: list[int], max_tokens: int, salt: str = "") -> int:
        spec = RequestSpec(len(prompt), max_tokens, prompt_tokens=tuple(prompt), cache_salt=salt)
        handle = self.s.admit(spec)
        self.out[handle.id] = []
        return handle.id

    def step(self) -> bool:
        s = self.s
        self.now += 3 * MS
        s.advance_to(self.now)
        plan = s.plan()
        if plan is None:
            return False
        self.fence += 1
        for lane in plan.lanes:
            if (
                lane.phase is LanePhase.PREFILL
                and lane.prompt_start == s.request(lane.handle).consumed_prompt
            ):
                start = s.generation_start(lane.handle)
                if start is not None and lane.prompt_start == start.position:
                    self.starts.setdefault(lane.handle.id, []).append(start)
        s.commit(plan, self.fence)
        records = []
        for lane in plan.lanes:
            h = lane.handle.id
            self.prefill_tokens[h] = self.prefill_tokens.get(h, 0) + lane.prompt_tokens
            k = len(self.out[h])
            tokens = tuple(1000 * h + k + j for j in range(lane.max_tokens))
            records.append(CompletionRecord(lane.slot, lane.generation, tokens))
        self.now += 2 * MS
        s.advance_to(self.now)
        for g in s.complete(self.fence, records, TIMING):
            self.out[g.handle.id] += g.tokens
            s.published_output(g.handle, g.fence)
        return True

    def run(self, limit: int = 5000) -> None:
        for _ in range(limit):
            if not self.step() and not self.s.waiting and not self.s.running:
                return
        raise AssertionError("the run did not finish")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def test_sixteen_requests_without_output_limits_are_all_resident():
    """The defaults (1,024 pages of 16, 4,096-token context): 16 chat requests whose
    max_tokens is the rest of the context all become resident at once (worst-case
    reservation let 4 in)."""
    s = Scheduler(list(CATALOG), SchedulerConfig(max_slots=16, page_size=16, num_pages=1024))
    for i in range(16):
        s.admit(RequestSpec(50, 4096 - 50, prompt_tokens=tuple(prompt(i, 50))))
    assert s.running == 16 and s.waiting == 0
    # Each holds its first chunk's pages, not its worst case.
    assert all(len(r.pages) <= 4 for r in s.active_requests())


def test_a_request_that_can_never_fit_is_refused_naming_the_limit():
    s = Scheduler(list(CATALOG), SchedulerConfig(max_slots=4, page_size=16, num_pages=8))
    with pytest.raises(SchedulerError, match=r"needs 9 KV pages.*pool has 8"):
        s.admit(RequestSpec(100, 40))


def test_preemption_completes_every_request_with_its_exact_tokens():
    """A pool too small for all requests at once: every request still gets exactly
    its tokens (no gap, no repeat), someone was preempted, and every page comes
    back (the accounting is checked after every completion)."""
    sim = Sim(num_pages=14, max_slots=4)
    handles = [sim.admit(prompt(i, 40), 60) for i in range(4)]
    sim.run()
    for h in handles:
        assert sim.out[h] == [1000 * h + k for k in range(60)]
    stats = sim.s.memory_stats()
    assert stats["preemptions"] > 0
    assert stats["kv_pages_held"] == 0
    sim.s.check_page_accounting()
    # A resumed request restored its output (the start names it) and, recomputing,
    # earned no prompt service for it: its prompt service is its prompt alone.
    resumed = [h for h, starts in sim.starts.items() if any(not st.plain for st in starts)]
    assert resumed
    for h in resumed:
        st = [st for st in sim.starts[h] if st.output_start < len(st.tokens)]
        if st:
            assert st[0].tokens[: st[0].output_start] == tuple(prompt(h, 40))
            assert st[0].tokens[st[0].output_start :] == tuple(
                1000 * h + k for k in range(len(st[0].tokens) - st[0].output_start)
            )


def test_preemption_without_caching_recomputes_and_still_completes():
    sim = Sim(num_pages=14, max_slots=4, caching=False)
    handles = [sim.admit(prompt(i, 40), 60) for i in range(4)]
    sim.run()
    assert all(sim.out[h] == [1000 * h + k for k in range(60)] for h in handles)
    assert sim.s.memory_stats()["preemptions"] > 0
    assert sim.s.memory_stats()["prefix_cache_hit_tokens"] == 0


def test_a_shared_prefix_is_attached_and_only_the_suffix_is_computed():
    sim = Sim(num_pages=64)
    system = prompt(7, 100)
    first = sim.admit(system + prompt(8, 10), 5)
    sim.run()
    second = sim.admit(system + prompt(9, 30), 5)
    r = sim.s.request(sim.s._res.resident[second].handle)
    assert r is not None and r.cached_tokens == 96 + 4  # 6 full pages + 4 of the 7th
    start = sim.s.generation_start(r.handle)
    assert start is not None and start.position == 100 and len(start.copies) == 1
    sim.run()
    assert sim.prefill_tokens[second] == 30  # only the uncached suffix
    assert sim.prefill_tokens[first] == 110
    assert sim.out[second] == [1000 * second + k for k in range(5)]
    stats = sim.s.memory_stats()
    assert stats["kv_pages_held"] == 0 and stats["kv_pages_cached"] > 0
    assert stats["prefix_cache_hit_tokens"] == 100


def test_a_whole_cached_prompt_still_computes_its_last_token():
    sim = Sim(num_pages=64)
    text = prompt(3, 64)  # 4 full pages
    sim.admit(text, 3)
    sim.run()
    again = sim.admit(text, 3)
    sim.run()
    assert sim.prefill_tokens[again] == 1  # 63 cached: 3 pages + 15 tokens copied
    assert sim.out[again] == [1000 * again + k for k in range(3)]


def test_salts_keep_tenants_apart():
    sim = Sim(num_pages=64)
    text = prompt(5, 80)
    sim.admit(text, 2, salt="tenant-a")
    sim.run()
    other = sim.admit(text, 2, salt="tenant-b")
    sim.run()
    same = sim.admit(text, 2, salt="tenant-a")
    sim.run()
    assert sim.prefill_tokens[other] == 80
    assert sim.prefill_tokens[same] == 1


def test_the_victim_has_the_lowest_value_per_held_page():
    """Two decoders: the one holding many pages (a long context) is the victim when
    a third request lacks a page, not the short one."""
    sim = Sim(num_pages=13, max_slots=3)
    long = sim.admit(prompt(1, 150), 40)  # 10 pages of context
    short = sim.admit(prompt(2, 10), 40)  # 1 page
    for _ in range(80):
        sim.step()
        if sim.s.memory_stats()["preemptions"]:
            break
    assert sim.s.memory_stats()["preemptions"] == 1
    by_id = {r.handle.id: r for r in sim.s.active_requests()}
    assert by_id[long].preemptions == 1 and by_id[short].preemptions == 0
    sim.run()
    assert sim.out[long] == [1000 * long + k for k in range(40)]


def test_restored_history_is_valued_by_the_continuation_index():
    # A chunk of 30 restored tokens of 90 left, finishing value 64: 64 * 30 / 90.
    assert prompt_chunk_value(0, 30, 90, 90, 0.5, 64.0) == pytest.approx(64 * 30 / 90)
    # The finishing chunk: its output token's value only (no prompt value).
    assert prompt_chunk_value(60, 30, 90, 90, 0.5, 64.0) == pytest.approx(64.0)
    # Past the restored history, uncached prompt tokens are worth 1 + f/x each.
    assert prompt_chunk_value(80, 20, 200, 90, 0.5, 64.0) == pytest.approx(10 * 1.5 + 64 * 10 / 120)
    # A plain prompt chunk: tokens only; the finishing one adds its first token.
    assert prompt_chunk_value(0, 32, 64, 0, 0.5, 64.5) == pytest.approx(48.0)
    assert prompt_chunk_value(32, 32, 64, 0, 0.5, 64.5) == pytest.approx(48.0 + 64.5)


def test_requests_arriving_together_share_pages_computed_meanwhile():
    """Both arrive before either prefills: the first's full pages are published
    as its chunks complete, and the second, with nothing submitted yet, attaches
    them instead of computing them again."""
    sim = Sim(num_pages=64)
    system = prompt(21, 130)
    a = sim.admit(system + prompt(22, 6), 3)
    b = sim.admit(system + prompt(23, 9), 3)
    sim.run()
    computed = sorted((sim.prefill_tokens[a], sim.prefill_tokens[b]))
    assert computed[1] == 136 or computed[1] == 139  # the first computed everything
    assert computed[0] <= 139 - 64  # the other reused at least a chunk's pages
    assert sim.out[a] == [1000 * a + k for k in range(3)]
    assert sim.out[b] == [1000 * b + k for k in range(3)]
    assert sim.s.memory_stats()["kv_pages_held"] == 0


def test_a_cancelled_unstarted_request_publishes_no_page_its_copy_never_filled():
    sim = Sim(num_pages=6, max_slots=4)
    text = prompt(1, 32)
    sim.admit(text, 2)
    sim.run()
    b = sim.admit(text[:24] + prompt(2, 6), 1)  # page 0 attached, 8 tokens copied
    handle = sim.s._res.resident[b].handle
    start = sim.s.generation_start(handle)
    assert start is not None and len(start.copies) == 1
    destination = start.copies[0][1]
    sim.s.cancel(handle)  # before any frame: the copy never ran
    assert sim.s._res.cache._node[destination] is None  # not published
    sim.s.check_page_accounting()


def test_a_cached_chain_filling_the_pool_does_not_block_its_own_repeat():
    """4 pages: a 63-token prompt fills the pool and is cached; the same prompt
    again cannot hold the whole chain and a fresh copy page at once, so it
    attaches less and still runs (it used to wait forever)."""
    sim = Sim(num_pages=4, max_slots=2)
    text = prompt(5, 63)
    first = sim.admit(text, 1)
    sim.run()
    again = sim.admit(text, 1)
    sim.run()
    assert sim.out[first] == [1000 * first] and sim.out[again] == [1000 * again]
    assert sim.prefill_tokens[again] < 63  # it still reused part of the chain


def test_requests_without_prompt_tokens_hold_their_worst_case_and_never_deadlock():
    """Requests that cannot be preempted (they name no tokens to recompute) are
    admitted with their worst-case pages, so two that fit only one at a time
    run one after the other instead of both starving for pages."""
    s = Scheduler(list(CATALOG), SchedulerConfig(max_slots=4, page_size=16, num_pages=8))
    handles = [s.admit(RequestSpec(16, 100)) for _ in range(2)]
    assert s.running == 1 and s.waiting == 1
    now = 0
    done: dict[int, int] = {h.id: 0 for h in handles}
    for fence in range(1, 1000):
        now += 3 * MS
        s.advance_to(now)
        plan = s.plan()
        if plan is None:
            break
        s.commit(plan, fence)
        records = [
            CompletionRecord(lane.slot, lane.generation, (1,) * lane.max_tokens)
            for lane in plan.lanes
        ]
        for g in s.complete(fence, records, TIMING):
            done[g.handle.id] += len(g.tokens)
    assert done == {h.id: 100 for h in handles}
