"""The engine with pages on demand, the prefix cache and preemption, against fake
ranks that model each page's KV (tests/support/fake_rank.py): an attached
prefix and a copy-on-write page must hold exactly the tokens the coordinator
claims, or the fake refuses the frame."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from runtime.catalog import GraphDescriptor, GraphKind
from tests.support import fake_rank
from tests.support.engine_rig import check, prompts, rig_factory  # noqa: F401
from tests.support.fake_rank import FakeSpec


def test_a_shared_prefix_is_attached_on_the_ranks_and_tokens_are_unchanged(
    rig_factory: Any,  # noqa: F811
) -> None:
    rig = rig_factory(2, max_slots=4, debug_page_accounting=True).start()
    system = prompts(1, seed=3, lo=90, hi=90)[0]
    first = rig.engine.submit([*system, 5, 6, 7], 6, ignore_eos=True)
    rig.drive([first])
    later = [[*system, *tail] for tail in prompts(3, seed=4, lo=5, hi=30)]
    streams = [rig.engine.submit(p, 6, ignore_eos=True) for p in later]
    rig.drive(streams)
    check(first, [*system, 5, 6, 7], 6, ignore_eos=True)
    for stream, p in zip(streams, later):
        check(stream, p, 6, ignore_eos=True)
        assert stream.cached_tokens >= 80  # 5 full pages of the 90 shared, at least
    assert first.cached_tokens == 0
    for fake in rig.ranks.fakes:  # both ranks restored and copied the same way
        assert len(fake.restored) >= 3
        assert fake.copied >= 1
    metrics = rig.engine.metrics()
    assert metrics["prefix_cache_hit_tokens"] >= 3 * 80
    assert metrics["kv_pages_held"] == 0


def test_a_pool_too_small_for_everyone_preempts_and_every_request_is_exact(
    rig_factory: Any,  # noqa: F811
) -> None:
    spec = FakeSpec(num_pages=12)
    rig = rig_factory(1, spec, max_slots=4, debug_page_accounting=True).start()
    cases = [(p, 50) for p in prompts(4, seed=11, lo=30, hi=45)]
    streams = [rig.engine.submit(p, n, ignore_eos=True) for p, n in cases]
    rig.drive(streams, limit_s=60)
    for stream, (p, n) in zip(streams, cases):
        check(stream, p, n, ignore_eos=True)
    metrics = rig.engine.metrics()
    assert metrics["preemptions"] >= 1
    assert metrics["kv_pages_held"] == 0
    assert rig.ranks.fakes[0].restored  # a resumed request started from its restore


def test_without_prefix_caching_nothing_is_attached(rig_factory: Any) -> None:  # noqa: F811
    rig = rig_factory(1, max_slots=2, enable_prefix_caching=False).start()
    text = prompts(1, seed=5, lo=70, hi=70)[0]
    streams = []
    for _ in range(2):
        streams.append(rig.engine.submit(text, 4, ignore_eos=True))
        rig.drive(streams)
    for stream in streams:
        check(stream, text, 4, ignore_eos=True)
        assert stream.cached_tokens == 0
    assert not rig.ranks.fakes[0].restored
    assert rig.engine.metrics()["prefix_cache_hit_tokens"] == 0


def test_cache_salts_are_respected_by_the_engine(rig_factory: Any) -> None:  # noqa: F811
    rig = rig_factory(1, max_slots=2).start()
    text = prompts(1, seed=6, lo=70, hi=70)[0]
    a = rig.engine.submit(text, 3, ignore_eos=True, cache_salt="a")
    rig.drive([a])
    b = rig.engine.submit(text, 3, ignore_eos=True, cache_salt="b")
    rig.drive([b])
    a2 = rig.engine.submit(text, 3, ignore_eos=True, cache_salt="a")
    rig.drive([a2])
    assert (a.cached_tokens, b.cached_tokens, a2.cached_tokens) == (0, 0, 69)
    for stream in (a, b, a2):
        check(stream, text, 3, ignore_eos=True)
    assert fake_rank.PAGE_SIZE < 69


STATE_PROGRAMS = (
    *fake_rank.DESCRIPTORS,
    *(GraphDescriptor(kind, b) for kind in (GraphKind.SNAPSHOT, GraphKind.RESTORE) for b in (1, 4)),
)


def test_state_programs_retire_and_restore_on_the_ranks(rig_factory: Any) -> None:  # noqa: F811
    """With snapshot and restore programs in the catalog: every finished response
    completes through a terminal row on the ranks; preempted requests resume
    through restore rows; every request still gets exactly its tokens."""
    spec = FakeSpec(num_pages=12, descriptors=STATE_PROGRAMS)
    rig = rig_factory(1, spec, max_slots=4, debug_page_accounting=True).start()
    cases = [(p, 50) for p in prompts(4, seed=11, lo=30, hi=45)]
    streams = [rig.engine.submit(p, n, ignore_eos=True) for p, n in cases]
    rig.drive(streams, limit_s=60)
    for stream, (p, n) in zip(streams, cases):
        check(stream, p, n, ignore_eos=True)
    fake = rig.ranks.fakes[0]
    metrics = rig.engine.metrics()
    assert metrics["preemptions"] >= 1
    # Each request's generation ends with a terminal row: the finished ones and
    # every preempted one (before it resumed).
    assert len(fake.terminal) == len(cases) + metrics["preemptions"]
    assert fake.restored  # resumed requests restored their pages first
    assert metrics["kv_pages_held"] == 0
    # The rows ran in state programs' frames (how many rows share a frame depends
    # on timing: the rows are counted above).
    assert metrics["frames_total:snapshot"] >= 1


def test_a_restore_row_makes_a_resumed_decoder_ready_on_the_ranks(
    rig_factory: Any,  # noqa: F811
) -> None:
    """A decoder preempted while its pages stay cached resumes through a restore
    row that binds them and leaves its last token pending (decode-ready), then
    decodes on: its tokens are exactly the unpreempted ones."""
    spec = FakeSpec(descriptors=STATE_PROGRAMS)
    rig = rig_factory(1, spec, max_slots=4, debug_page_accounting=True).start()
    cases = [(p, 40) for p in prompts(2, seed=12, lo=30, hi=45)]
    streams = [rig.engine.submit(p, n, ignore_eos=True) for p, n in cases]
    scheduler = rig.engine.scheduler
    victim = None
    # Drive until the second request has decoded a few tokens (a deadline, not a
    # step count: on a loaded machine a step may find no completion yet).  Its
    # next frame may be in flight then, as when the memory rule preempts: its
    # pages come back when that frame completes.
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        rig.engine.step(0)
        rig.ranks.serve(timeout_ms=1)
        r = next((q for q in scheduler.active_requests() if q.handle.id == 1), None)
        if r is not None and r.committed_output >= 5:
            victim = r
    assert victim is not None
    assert victim.committed_output < 40  # caught while still decoding
    scheduler._res.preempt(victim)  # the preemption rule itself is tested in the scheduler
    victim.terminal_since_ns = scheduler.now_ns
    rig.drive(streams, limit_s=60)
    for stream, (p, n) in zip(streams, cases):
        check(stream, p, n, ignore_eos=True)
    fake = rig.ranks.fakes[0]
    metrics = rig.engine.metrics()
    assert metrics["frames_total:restore"] >= 1
    assert any(position > 0 for _, _, position in fake.restored)
    assert metrics["kv_pages_held"] == 0


@pytest.mark.parametrize("seed", range(16))
def test_random_workloads_on_fake_ranks_give_exact_tokens(rig_factory: Any, seed: int) -> None:  # noqa: F811
    """Random small pools and prompts sharing a system prefix (or not), with the
    state programs: preemptions, restores (decode-ready and prompt-ready), copies
    and snapshots on ranks that check page contents; every request's tokens
    exact, every page back."""
    rng = random.Random(seed)
    spec = FakeSpec(num_pages=rng.randint(8, 14), descriptors=STATE_PROGRAMS)
    rig = rig_factory(1, spec, max_slots=4, debug_page_accounting=True).start()
    system = [rng.randrange(1, 100) for _ in range(48)]
    cases = []
    for _ in range(rng.randint(3, 7)):
        own = [rng.randrange(1, 100) for _ in range(rng.randint(1, 50))]
        cases.append((system[: rng.choice([0, 16, 40])] + own, rng.randint(1, 30)))
    streams = [rig.engine.submit(p, n, ignore_eos=True) for p, n in cases]
    rig.drive(streams, limit_s=30)
    for stream, (p, n) in zip(streams, cases):
        check(stream, p, n, ignore_eos=True)
    assert rig.engine.metrics()["kv_pages_held"] == 0


def test_a_prompt_cached_but_for_its_last_token_restores_decode_ready(
    rig_factory: Any,  # noqa: F811
) -> None:
    """The same prompt twice: the second attaches all but its last token, its
    restore row leaves that token pending, and its first output comes from a
    decode row: the tokens are the first's."""
    rig = rig_factory(1, FakeSpec(descriptors=STATE_PROGRAMS), max_slots=2).start()
    text = prompts(1, seed=8, lo=40, hi=40)[0]
    first = rig.engine.submit(text, 5, ignore_eos=True)
    rig.drive([first])
    second = rig.engine.submit(text, 5, ignore_eos=True)
    rig.drive([second])
    check(first, text, 5, ignore_eos=True)
    check(second, text, 5, ignore_eos=True)
    assert second.cached_tokens == 39
    assert (second.slot is not None) and rig.ranks.fakes[0].restored[-1][2] == 39
