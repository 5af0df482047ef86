"""KV pages with reference counts, and the prefix cache over them.

Every page is in exactly one state:

* **free**: on the free list, holding nothing anyone will read;
* **held**: referenced by one or more resident requests' page tables
  (``refcount > 0``); a held page may also be a cache entry (shared pages);
* **idle**: a cache entry nobody holds (``refcount == 0``), kept for a later
  request with the same content and evicted when pages run short.

The cache is a trie of pages per salt (tenants with different salts never
share a page).  A node is one published page: its token ids (a full page, or
the partial last page of a published sequence), its parent (the page before
it), so a node's *content key* is the chain of token ids from the root, never
a hash alone.  Children are found by their token tuple: a full page by exact
lookup, a partial match (the request diverges inside a cached page, or the
cached page is a partial one) by the longest common prefix among the
children.  A partial match is used by copy-on-write: the cached page is copied
into a fresh private page, whose first ``count`` positions then hold the
request's KV (the rest is overwritten before anything reads it).

Eviction (see docs/checkpoints.md) takes only idle *leaves* (a page whose
chain continues in a cached child stays until the child goes), in this order:
plain cache pages before checkpoint anchors, then least recent demand, then
the shorter endpoint first.  Held pages are never evicted.

Pure Python: no torch, sockets or clocks; demand recency is a counter.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum


class PageAccountingError(RuntimeError):
    """A page-accounting invariant would be (or was) broken."""


class Role(IntEnum):
    """A cache page's retention role; lower values are evicted first."""

    PLAIN = 0
    ANCHOR = 1  # the page holding a checkpoint anchor's endpoint (a message end)


class Node:
    """One published page of the trie."""

    __slots__ = ("children", "demand", "endpoint", "page", "parent", "role", "tokens", "version")

    def __init__(self, page: int, tokens: tuple[int, ...], parent: Node | None) -> None:
        self.page = page
        self.tokens = tokens
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.endpoint: int = (parent.endpoint if parent is not None else 0) + len(tokens)
        self.role = Role.PLAIN
        self.demand = 0
        self.version = 0  # bumped whenever its eviction key or eligibility changes


@dataclass(frozen=True)
class Match:
    """What a prompt shares with the cache.

    ``pages``: cached full pages to attach, in order (``len(pages) * page_size``
    tokens).  ``partial``: (cached page, tokens) to copy into a fresh page and
    reuse the first ``tokens`` positions of, or None.  ``tokens``: every
    reused token, full pages and partial together.
    """

    pages: tuple[int, ...] = ()
    partial: tuple[int, int] | None = None

    def tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size + (self.partial[1] if self.partial else 0)


class PageCache:
    """``num_pages`` pages of ``page_size`` tokens; the cache is on when ``enabled``."""

    def __init__(self, num_pages: int, page_size: int, enabled: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enabled = enabled
        self._free = list(range(num_pages - 1, -1, -1))
        self.refcount = [0] * num_pages
        self._node: list[Node | None] = [None] * num_pages  # page -> its cache node
        self._roots: dict[str, Node] = {}
        self._idle = 0  # cache nodes nobody holds
        self._heap: list[tuple[int, int, int, int, int]] = []  # eviction candidates (lazy)
        self._clock = 0
        # Counters (reported as metrics).
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0
        self.version = 0  # bumped by every publication that entered a page

    # ------------------------------------------------------------ counts
    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def idle_count(self) -> int:
        """Cached pages nobody holds (evictable, leaves first)."""
        return self._idle

    @property
    def available(self) -> int:
        """Pages an allocation may obtain: free ones plus idle cached ones."""
        return len(self._free) + self._idle

    @property
    def cached_count(self) -> int:
        """Pages that are cache entries, held or idle."""
        return sum(1 for node in self._node if node is not None)

    @property
    def held_count(self) -> int:
        return sum(1 for count in self.refcount if count)

    # ------------------------------------------------------- allocation
    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh private pages (refcount 1), evicting idle cache pages when
        the free list is short; None (nothing changed) when they cannot be had."""
        if count <= 0:
            return []
        if count > self.available:
            return None
        while len(self._free) < count:
            if not self._evict_one():
                return None
        pages = self._free[-count:][::-1]
        del self._free[len(self._free) - count :]
        for page in pages:
            self.refcount[page] = 1
        return pages

    def hold(self, page: int) -> None:
        """One more reference to a held or cached page."""
        node = self._node[page]
        if self.refcount[page] == 0:
            if node is None:
                raise PageAccountingError(f"page {page} is free: it cannot be held")
            self._idle -= 1
            node.version += 1  # no longer an eviction candidate
        self.refcount[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; an unreferenced page returns to the free
        list, or stays as an idle cache entry when it is one."""
        for page in pages:
            if self.refcount[page] <= 0:
                raise PageAccountingError(f"page {page} released more often than held")
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                node = self._node[page]
                if node is None:
                    self._free.append(page)
                else:
                    self._idle += 1
                    self._push(node)

    # ------------------------------------------------------------ lookup
    def match(self, salt: str, tokens: Sequence[int], limit: int) -> Match:
        """The longest cached prefix of ``tokens`` of at most ``limit`` tokens
        (nothing is held yet: :meth:`attach`; nothing is counted: :meth:`record`)."""
        limit = min(limit, len(tokens))
        root = self._roots.get(salt)
        if not self.enabled or root is None or limit <= 0:
            return Match()
        size = self.page_size
        node = root
        pages: list[int] = []
        at = 0
        while at + size <= limit:
            child = node.children.get(tuple(tokens[at : at + size]))
            if child is None:
                break
            pages.append(child.page)
            node, at = child, at + size
        partial = None
        want = tokens[at : min(at + size, limit)]
        if want:
            best, best_len = None, 0
            for child in node.children.values():
                n = _common(child.tokens, want)
                if n > best_len:
                    best, best_len = child, n
            if best is not None:
                partial = (best.page, best_len)
        return Match(tuple(pages), partial)

    def attach(self, match: Match) -> list[int]:
        """Hold ``match``'s full pages and its copy source; mark the chain demanded.
        Returns the pages to hold in the request's table (the full pages); the copy
        source is held too and must be released once the copy has run."""
        self._clock += 1
        for page in match.pages:
            self.hold(page)
            self._touch(page)
        if match.partial is not None:
            self.hold(match.partial[0])
            self._touch(match.partial[0])
        return list(match.pages)

    def record(self, queried: int, hit: int) -> None:
        """A lookup of ``queried`` tokens found ``hit`` of them (metrics)."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def idle_among(self, match: Match) -> int:
        """How many of ``match``'s pages are idle (attaching takes them off the
        evictable pool)."""
        pages = list(match.pages) + ([match.partial[0]] if match.partial else [])
        return sum(1 for page in pages if not self.refcount[page])

    def _touch(self, page: int) -> None:
        node = self._node[page]
        if node is not None:
            node.demand = self._clock

    # ------------------------------------------------------- publication
    def publish(
        self,
        salt: str,
        tokens: Sequence[int],
        pages: Sequence[int],
        anchors: Iterable[int] = (),
    ) -> None:
        """Enter ``pages`` (a request's table, holding ``tokens`` by position) into
        the cache under ``salt``.  A page whose content is already cached stays
        private (its holder's release frees it); the page holding an anchor
        endpoint (a token count in ``anchors``) gets the anchor role.  Nothing is
        released here: the publisher still holds its pages."""
        if not self.enabled or not tokens:
            return
        size = self.page_size
        if len(pages) * size < len(tokens):
            raise PageAccountingError(
                f"{len(tokens)} tokens published over {len(pages)} pages of {size}"
            )
        self._clock += 1
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = Node(-1, (), None)
        anchor_pages = {(end - 1) // size for end in anchors if 0 < end <= len(tokens)}
        for index in range(-(-len(tokens) // size)):
            chunk = tuple(tokens[index * size : (index + 1) * size])
            page = pages[index]
            child = node.children.get(chunk)
            if child is None:
                if self._node[page] is not None:
                    # The request attached this page from another chain position
                    # (never happens: attached pages are matched by content): stop.
                    return
                child = Node(page, chunk, node)
                node.children[chunk] = child
                self._node[page] = child
                self.version += 1
            child.demand = self._clock
            if index in anchor_pages and child.role is not Role.ANCHOR:
                child.role = Role.ANCHOR
                child.version += 1
                if self.refcount[child.page] == 0:
                    self._push(child)
            if len(chunk) < size:
                break  # a partial page is a leaf
            node = child

    # ---------------------------------------------------------- eviction
    def _push(self, node: Node) -> None:
        if node.children:
            return  # not a leaf: its last child's eviction pushes it
        node.version += 1
        heapq.heappush(
            self._heap, (int(node.role), node.demand, node.endpoint, node.version, node.page)
        )

    def _evict_one(self) -> bool:
        while self._heap:
            role, demand, endpoint, version, page = heapq.heappop(self._heap)
            node = self._node[page]
            if node is None or node.version != version or self.refcount[page] or node.children:
                continue  # a stale entry: a later push (or none) stands for the node
            if (int(node.role), node.demand, node.endpoint) != (role, demand, endpoint):
                self._push(node)  # demanded since: a candidate under its current key
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens]
            self._node[page] = None
            self._idle -= 1
            self._free.append(page)
            self.evicted_pages += 1
            if parent.page >= 0 and not parent.children and not self.refcount[parent.page]:
                self._push(parent)
            return True
        return False

    def eviction_order(self) -> list[int]:
        """Idle leaf pages in the order they would be evicted now (inspection, tests)."""
        leaves = [
            node
            for node in self._node
            if node is not None and not self.refcount[node.page] and not node.children
        ]
        leaves.sort(key=lambda n: (int(n.role), n.demand, n.endpoint, n.version))
        return [n.page for n in leaves]

    def clear(self) -> int:
        """Evict every idle page (a cache reset); returns how many went."""
        count = 0
        while self._evict_one():
            count += 1
        return count

    # --------------------------------------------------------- invariant
    def check(self, holders: Iterable[Sequence[int]]) -> None:
        """Raise :class:`PageAccountingError` unless the accounting is exact:
        every page is free, held or idle-cached, exactly once; each refcount is
        the number of times ``holders`` (every page list that holds references:
        request tables, copy sources) name the page; no request names a page
        twice; the idle count is right."""
        counts = [0] * self.num_pages
        for held in holders:
            if len(set(held)) != len(held):
                raise PageAccountingError(f"a holder names a page twice: {list(held)}")
            for page in held:
                counts[page] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise PageAccountingError("a page is on the free list twice")
        idle = 0
        for page in range(self.num_pages):
            if counts[page] != self.refcount[page]:
                raise PageAccountingError(
                    f"page {page}: refcount {self.refcount[page]}, held {counts[page]} times"
                )
            node = self._node[page]
            if page in free and (counts[page] or node is not None):
                raise PageAccountingError(f"page {page} is free and in use")
            if page not in free and not counts[page] and node is None:
                raise PageAccountingError(f"page {page} leaked: not free, held or cached")
            if node is not None:
                if node.page != page or node.parent is None:
                    raise PageAccountingError(f"page {page}: its cache node is inconsistent")
                if node.parent.children.get(node.tokens) is not node:
                    raise PageAccountingError(f"page {page}: its node is not in the trie")
                if not counts[page]:
                    idle += 1
        if idle != self._idle:
            raise PageAccountingError(f"idle count {self._idle}, counted {idle}")


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
