"""The page cache: reference counts, prefix matching, publication, eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.coordinator.kvcache import Match, PageAccountingError, PageCache, Role

PS = 4


def publish_and_release(cache: PageCache, tokens, salt="", anchors=()) -> list[int]:
    pages = cache.allocate(-(-len(tokens) // PS))
    cache.publish(salt, tokens, pages, anchors)
    cache.release(pages)
    return pages


def test_match_attaches_full_pages_and_copies_a_partial_one():
    cache = PageCache(16, PS)
    tokens = list(range(10))  # pages: [0..3] [4..7] [8, 9]
    pages = publish_and_release(cache, tokens)
    assert cache.idle_count == 3 and cache.free_count == 13
    # The same prefix then divergence inside the second page.
    m = cache.match("", [0, 1, 2, 3, 4, 5, 99, 7, 8], limit=8)
    assert m.pages == (pages[0],) and m.partial == (pages[1], 2)
    assert m.tokens(PS) == 6
    held = cache.attach(m)
    assert held == [pages[0]] and cache.refcount[pages[0]] == 1 and cache.refcount[pages[1]] == 1
    assert cache.idle_count == 1
    cache.check([held, [pages[1]]])
    cache.release([*held, pages[1]])
    cache.check([])


def test_the_limit_leaves_tokens_to_compute():
    cache = PageCache(16, PS)
    pages = publish_and_release(cache, list(range(8)))
    # The whole prompt is cached: a limit of len - 1 reuses 7 of its 8 tokens.
    m = cache.match("", list(range(8)), limit=7)
    assert m.pages == (pages[0],) and m.partial == (pages[1], 3)


def test_salts_never_share_pages():
    cache = PageCache(16, PS)
    publish_and_release(cache, list(range(8)), salt="tenant-a")
    assert cache.match("tenant-b", list(range(8)), 8) == Match()
    assert cache.match("tenant-a", list(range(8)), 8).tokens(PS) == 8


def test_disabled_cache_matches_nothing_and_publishes_nothing():
    cache = PageCache(16, PS, enabled=False)
    publish_and_release(cache, list(range(8)))
    assert cache.free_count == 16 and cache.idle_count == 0
    assert cache.match("", list(range(8)), 8) == Match()


def test_duplicate_content_stays_private():
    cache = PageCache(16, PS)
    first = publish_and_release(cache, list(range(8)))
    second = publish_and_release(cache, list(range(8)))
    assert not set(first) & set(second)
    assert cache.idle_count == 2 and cache.free_count == 14  # the copies went back
    cache.check([])


def test_eviction_order_plain_before_anchor_then_recency_then_shorter_endpoint():
    cache = PageCache(6, PS)
    a = publish_and_release(cache, [1, 1, 1, 1, 2, 2], anchors=[6])  # 2 pages, leaf anchor
    b = publish_and_release(cache, [3, 3, 3, 3, 4])  # 2 pages, plain
    c = publish_and_release(cache, [5, 5])  # 1 page, plain, most recent
    assert cache._node[a[1]].role is Role.ANCHOR
    # Leaves: a[1] (anchor), b[1] (plain, older), c[0] (plain, newer).
    assert cache.eviction_order() == [b[1], c[0], a[1]]
    assert cache.free_count == 1
    free = set(range(6)) - set(a) - set(b) - set(c)
    got = cache.allocate(3)  # the free page, then b[1], then b[0] (now a leaf, older than c)
    assert got is not None and set(got) == {b[0], b[1]} | free
    assert cache.eviction_order() == [c[0], a[1]]
    assert cache.allocate(2) is not None  # c, then the anchor's leaf
    assert cache.eviction_order() == [a[0]]
    cache.check([got, [p for p in range(6) if p not in got and p != a[0]]])


def test_held_pages_are_never_evicted():
    cache = PageCache(4, PS)
    pages = publish_and_release(cache, list(range(8)))
    held = cache.attach(cache.match("", list(range(8)), 8))
    assert held == pages
    assert cache.allocate(3) is None  # 2 free, the 2 cached pages are held
    assert cache.allocate(2) is not None
    assert cache.refcount[pages[0]] == cache.refcount[pages[1]] == 1


def test_release_more_than_held_is_refused():
    cache = PageCache(4, PS)
    pages = cache.allocate(1)
    cache.release(pages)
    with pytest.raises(PageAccountingError):
        cache.release(pages)


def test_check_finds_a_leak_and_a_wrong_refcount():
    cache = PageCache(4, PS)
    pages = cache.allocate(2)
    with pytest.raises(PageAccountingError, match="refcount"):
        cache.check([pages[:1]])
    cache.check([pages])
    with pytest.raises(PageAccountingError, match="twice"):
        cache.check([pages + pages[:1]])


# --------------------------------------------------------------- properties
# Requests are page lists plus their token sequences; operations mirror the
# scheduler's: admit (match + attach + allocate the rest), grow, complete
# (publish + release), cancel (release), preempt (publish + release), evict.
OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "complete", "cancel", "preempt", "evict"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 2), min_size=1, max_size=14),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS, st.booleans())
def test_random_operations_keep_page_accounting_exact(ops, enabled):
    cache = PageCache(12, PS, enabled=enabled)
    live: dict[int, tuple[list[int], list[int], list[int]]] = {}  # id -> pages, tokens, sources
    scratch: list[int] = []  # pages the "evict" steps took (held by the test)
    next_id = 0
    for op, pick, tokens in ops:
        ids = sorted(live)
        target = ids[pick % len(ids)] if ids else None
        held_pages = {p for pages, _, _ in live.values() for p in pages}
        if op == "admit":
            m = cache.match("s", tokens, len(tokens) - 1)
            held = cache.attach(m)
            sources = [m.partial[0]] if m.partial else []
            fresh = cache.allocate(-(-len(tokens) // PS) - len(held))
            if fresh is None:
                cache.release(held + sources)
            else:
                assert not set(fresh) & held_pages  # never a page someone holds
                live[next_id] = (held + fresh, list(tokens), sources)
                next_id += 1
        elif op == "grow" and target is not None:
            pages, toks, sources = live[target]
            cache.release(sources)  # the copy ran with the first frame
            sources.clear()
            toks += [pick % 3] * (len(pages) * PS - len(toks))  # fill the last page
            fresh = cache.allocate(1)
            if fresh is not None:
                assert not set(fresh) & held_pages
                pages += fresh
                toks += [pick % 3]
        elif op in ("complete", "preempt") and target is not None:
            pages, toks, sources = live.pop(target)
            cache.publish("s", toks, pages, anchors=[len(toks)] if op == "preempt" else ())
            cache.release(pages + sources)
        elif op == "cancel" and target is not None:
            pages, _, sources = live.pop(target)
            cache.release(pages + sources)
        elif op == "evict":
            fresh = cache.allocate(pick % 3 + 1)
            if fresh is not None:
                assert not set(fresh) & held_pages
                scratch += fresh
            elif scratch:
                cache.release(scratch)
                scratch.clear()
        holders = [pages for pages, _, _ in live.values()]
        holders += [sources for _, _, sources in live.values() if sources]
        cache.check([*holders, scratch])
    for pages, _, sources in live.values():
        cache.release(pages + sources)
    cache.release(scratch)
    cache.check([])
    cache.clear()
    assert cache.free_count == cache.num_pages and cache.idle_count == 0
