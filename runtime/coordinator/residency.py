"""Residency: slots and KV pages of admitted requests, admission, pages on
demand, preemption and the prefix cache's publication (docs/checkpoints.md).

* **Admission.**  A waiting request becomes resident when a slot is free and
  its first prompt chunk fits: the pages its uncached prefix's first chunk
  needs (after attaching what the prefix cache holds) plus one page of
  headroom for each resident request (each may cross a page boundary on its
  next frame).  Preempted requests resume before any new request is admitted,
  in the order they were preempted; new ones go round-robin across admission
  groups, first come first served within one (``RequestSpec.group``).
* **Pages on demand.**  :meth:`Residency.provision` gives each runnable
  request, oldest resident first, the pages its largest possible next frame
  writes (a whole prompt chunk, or the widest decode round, within its output
  limit); when pages are short it gets what is there, and selection caps its
  chunk or width by the pages it holds.  Pages stay owned through the
  request's last submitted fence and are released only at retirement.
* **Preemption.**  A runnable request with nothing in flight that cannot get a
  page for its next token *lacks pages*; the scheduler then preempts the
  resident request with the lowest lane value per held page (ties: the most
  recently admitted).  Its pages are published to the prefix cache and
  released once its in-flight work completes; it resumes later with a new
  generation, restoring its prefix from the cache and recomputing the rest.

Pure Python: no torch, sockets or clocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from runtime.coordinator.kvcache import Match, PageAccountingError, PageCache
from runtime.coordinator.requests import GenerationStart, Request
from runtime.coordinator.resources import SlotPool


class Residency:
    def __init__(
        self,
        max_slots: int,
        num_pages: int,
        page_size: int,
        *,
        prefix_caching: bool = True,
        max_chunk: int = 1,
        max_width: int = 1,
        restore_programs: bool = False,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.slots = SlotPool(max_slots)
        self.cache = PageCache(num_pages, page_size, enabled=prefix_caching)
        self.max_chunk = max(1, max_chunk)  # the largest prompt chunk a program takes
        self.max_width = max(1, max_width)  # the widest decode row a program runs
        # With RESTORE programs a resumed request's restore is its own row
        # (state_ops); without, it rides on its first prefill frame.
        self.restore_programs = restore_programs
        # Waiting requests by admission group, in rotation order; preempted ones
        # wait in their own queue, ahead of every group.
        self.waiting: OrderedDict[object, deque[Request]] = OrderedDict()
        self.resuming: deque[Request] = deque()
        self.num_waiting = 0
        self.resident: dict[int, Request] = {}
        # Mid-flight publication and late attach: how far each resident request's
        # full computed pages were published; the cache version each request with
        # nothing submitted yet was last matched against.
        self._published: dict[int, int] = {}
        self._unstarted: dict[int, int] = {}
        self._seq = 0
        self.preemptions = 0

    # ------------------------------------------------------------ waiting
    def enqueue(self, request: Request) -> None:
        key = group_key(request)
        if key not in self.waiting:
            self.waiting[key] = deque()  # a group with nothing waiting joins at the end
        self.waiting[key].append(request)
        self.num_waiting += 1

    def dequeue(self, request: Request) -> None:
        """A waiting request leaves (cancelled)."""
        if request.preempted:
            self.resuming.remove(request)
        else:
            key = group_key(request)
            queue = self.waiting[key]
            queue.remove(request)
            if not queue:
                del self.waiting[key]
        self.num_waiting -= 1

    def admit_waiting(self) -> list[Request]:
        """Make waiting requests resident while they fit (module docstring);
        returns those that became resident."""
        out: list[Request] = []
        while self.slots.free_count and self.num_waiting:
            if self.resuming:
                request, key = self.resuming[0], None
            else:
                key, queue = next(iter(self.waiting.items()))
                request = queue[0]
            if not self._reside(request):
                break  # no skipping: the head waits, and everyone behind it
            self.num_waiting -= 1
            if key is None:
                self.resuming.popleft()
            else:
                queue = self.waiting[key]
                queue.popleft()
                if queue:
                    self.waiting.move_to_end(key)
                else:
                    del self.waiting[key]
            out.append(request)
        return out

    @staticmethod
    def _limit(r: Request) -> int:
        """The most tokens ``r`` may attach from the cache: all but its last to
        fill; a scored prompt only what it has scored already (the cache holds
        no scores: at first residency nothing, so it recomputes and rescores its
        prompt; resumed after a preemption, the prompt it consumed before)."""
        if r.spec.score_prompt:
            return min(r.prefill_target - 1, r.scored_through)
        return r.prefill_target - 1

    def _match(self, r: Request) -> Match:
        """What the cache holds of ``r``'s content key (image positions keyed by
        their digests), never ending inside an image span: a prefix that would
        is cut back to the span's start (its image is encoded again)."""
        found = self.cache.match(r.spec.cache_salt, r.cache_tokens(), self._limit(r))
        if not r.spec.images:
            return found
        size = self.page_size
        end = found.tokens(size)
        cut = next((s.start for s in r.spec.images if s.start < end < s.end), end)
        if cut == end:
            return found
        pages = found.pages + ((found.partial[0],) if found.partial else ())
        whole, rest = divmod(cut, size)
        return Match(pages[:whole], (pages[whole], rest) if rest else None)

    def _reside(self, r: Request) -> bool:
        """Attach ``r``'s cached prefix and its first chunk's pages, or nothing."""
        size = self.page_size
        cache = self.cache
        tokens = r.known_tokens()
        target = r.prefill_target
        found = self._match(r) if tokens else Match()
        # The cached chain's idle pages count as available but stop being so once
        # attached: when the whole match does not fit, try it without its partial
        # page, then without any (a chain that fills the pool must not block it).
        for match in dict.fromkeys((found, Match(found.pages), Match())):
            cached = match.tokens(size)
            if not tokens:  # not preemptible (no tokens to recompute): its worst case now
                first = r.spec.prompt_len + r.spec.max_output_tokens
            else:
                first = min(self.max_chunk, r.prefill_reach(cached))
            need = -(-(cached + first) // size) - len(match.pages)
            if need + len(self.resident) > cache.available - cache.idle_among(match):
                continue
            held = cache.attach(match)
            fresh = cache.allocate(need)
            if fresh is None:  # eviction could not free enough (pages held for copies)
                cache.release(held + ([match.partial[0]] if match.partial else []))
                continue
            break
        else:
            return False
        cache.record(max(0, min(target - 1, len(tokens))), cached)
        copies: tuple[tuple[int, int], ...] = ()
        if match.partial is not None:
            r.copy_sources = [match.partial[0]]
            copies = ((match.partial[0], fresh[0]),)
        r.copy_fence = None
        r.pages = held + fresh
        r.slot, r.generation = self.slots.acquire()
        r.resident = True
        # A restore row binds cached pages (a state program, state_ops): a request
        # whose prompt is cached but for its last token is then decode-ready and
        # joins a decode batch instead of running a padded prefill for one token.
        # With nothing cached there is nothing to bind: the restore record, if
        # any, rides on the first prefill frame.
        r.restore_pending = self.restore_programs and cached > 0
        r.preempted = False
        r.terminal_since_ns = None
        r.consumed_prompt = cached
        r.accounted_prompt = max(r.accounted_prompt, cached)
        if r.cached_tokens is None:
            r.cached_tokens = min(cached, r.spec.prompt_len)
        output_start = min(r.spec.prompt_len, len(tokens))
        r.start = GenerationStart(tokens, output_start, cached, copies)
        self._seq += 1
        r.admitted_seq = self._seq
        self.resident[r.handle.id] = r
        self._unstarted[r.handle.id] = cache.version
        return True

    # ---------------------------------------------------------- sharing
    def started(self, r: Request) -> None:
        """``r``'s generation has a submitted frame: its start is fixed."""
        self._unstarted.pop(r.handle.id, None)

    def unstarted(self, r: Request) -> bool:
        """Nothing was ever submitted for ``r``'s current generation: the ranks hold
        no state of it, and its copies never ran."""
        return r.handle.id in self._unstarted

    def publish_computed(self, r: Request) -> None:
        """Enter ``r``'s full pages computed so far (after a prefill chunk), so a
        request sharing the prefix attaches them while ``r`` still runs.  Partial
        pages wait for retirement: ``r`` still writes them."""
        if not self.cache.enabled or not r.spec.prompt_tokens:
            return
        size = self.page_size
        full = min(r.consumed_prompt, r.kv_filled) // size * size
        if full <= self._published.get(r.handle.id, 0):
            return
        ends = [e for e in r.spec.message_endpoints if e <= full]
        self.cache.publish(r.spec.cache_salt, r.cache_tokens()[:full], r.pages, ends)
        self._published[r.handle.id] = full

    def refresh_unstarted(self) -> None:
        """Requests with nothing submitted yet attach a longer cached prefix
        published since they became resident (a sibling's computed pages)."""
        version = self.cache.version
        for hid, seen in list(self._unstarted.items()):
            r = self.resident.get(hid)
            if r is None or seen == version or r.inflight_fences or r.preempted:
                continue
            self._unstarted[hid] = version
            self._rematch(r)

    def _rematch(self, r: Request) -> None:
        size, cache = self.page_size, self.cache
        tokens = r.known_tokens()
        if not tokens or not cache.enabled:
            return
        match = self._match(r)
        cached = match.tokens(size)
        if cached <= r.consumed_prompt:
            return
        held = cache.attach(match)
        first = min(self.max_chunk, r.prefill_reach(cached))
        fresh = cache.allocate(-(-(cached + first) // size) - len(match.pages))
        if fresh is None:  # no room for both while swapping: keep what it has
            cache.release(held + ([match.partial[0]] if match.partial else []))
            return
        cache.record(0, cached - r.consumed_prompt)
        cache.release(r.pages + r.copy_sources)
        copies: tuple[tuple[int, int], ...] = ()
        r.copy_sources = []
        if match.partial is not None:
            r.copy_sources = [match.partial[0]]
            copies = ((match.partial[0], fresh[0]),)
        r.pages = held + fresh
        r.consumed_prompt = cached
        r.accounted_prompt = max(r.accounted_prompt, cached)
        r.restore_pending = self.restore_programs
        if not r.preemptions:
            r.cached_tokens = min(cached, r.spec.prompt_len)
        assert r.start is not None
        r.start = GenerationStart(tokens, r.start.output_start, cached, copies)

    # ---------------------------------------------------------- provision
    def want_tokens(self, r: Request) -> tuple[int, int]:
        """(context its largest next frame writes to, the least it needs to run)."""
        if r.consumed_prompt < r.prefill_target:
            pos = r.consumed_prompt
            chunk = min(self.max_chunk, r.prefill_reach(pos))
            least = 1 if r.vision is None else r.vision.least_chunk(pos)  # spans are atomic
            return pos + chunk, pos + least
        start = r.spec.prompt_len + r.committed_output + r.inflight_output - 1
        rows = min(self.max_width, r.remaining_output - r.inflight_output)
        return start + max(rows, 1), start + 1

    def provision(self) -> list[Request]:
        """Pages for every runnable request's next frame (module docstring);
        returns the runnable requests with nothing in flight that lack a page for
        their next token (the preemption trigger)."""
        size = self.page_size
        lacking: list[Request] = []
        for r in sorted(self.resident.values(), key=lambda q: q.admitted_seq):
            if not r.runnable:
                continue
            want, least = self.want_tokens(r)
            short = -(-want // size) - len(r.pages)
            if short > 0:
                got = self.cache.allocate(min(short, self.cache.available))
                if got:
                    r.pages += got
            if len(r.pages) * size < least and not r.inflight_fences:
                lacking.append(r)
        return lacking

    def capacity(self, r: Request) -> int:
        """Tokens of context ``r``'s pages hold."""
        return len(r.pages) * self.page_size

    # --------------------------------------------------------- retirement
    def preempt(self, r: Request) -> None:
        """Stop selecting ``r``; its pages go at :meth:`retire` (after its fences)."""
        r.preempted = True
        r.preemptions += 1
        self.preemptions += 1

    def retire(self, r: Request) -> None:
        """Publish ``r``'s computed pages and release them and its slot.  A
        preempted request goes back to wait (first in line); any other leaves."""
        filled = r.kv_filled
        # An unstarted generation computed nothing (its copies never ran either):
        # what it attached is in the cache already, and nothing else is valid.
        tokens = () if self.unstarted(r) else r.cache_tokens()[:filled]
        if tokens:
            anchors = [e for e in r.spec.message_endpoints if e <= filled] + [filled]
            self.cache.publish(r.spec.cache_salt, tokens, r.pages, anchors)
        self.cache.release(r.pages + r.copy_sources)
        self._published.pop(r.handle.id, None)
        self._unstarted.pop(r.handle.id, None)
        r.pages, r.copy_sources, r.copy_fence, r.start = [], [], None, None
        self.slots.release(r.slot)
        r.resident = False
        self.resident.pop(r.handle.id, None)
        if r.preempted and not (r.cancelled or r.finished):
            # Resume: recompute (or restore from the cache) the prompt and every
            # emitted token; the final chunk samples the next one.  What was filled
            # before is restored history: no value, no service.
            r.history_end = max(r.history_end, filled, r.consumed_prompt)
            if r.committed_output:
                r.prefill_target = r.spec.prompt_len + r.committed_output
                r.history_end = r.prefill_target
            r.accounted_prompt = max(r.accounted_prompt, r.history_end)
            r.consumed_prompt = 0
            self.resuming.append(r)
            self.num_waiting += 1

    def copied(self, r: Request, fence: int) -> None:
        """``fence`` completed: a copy-on-write source its generation's first frame
        read is no longer needed."""
        if r.copy_sources and r.copy_fence is not None and fence >= r.copy_fence:
            self.cache.release(r.copy_sources)
            r.copy_sources = []

    # ----------------------------------------------------------- checking
    def check(self) -> None:
        """The page-accounting invariant (debug mode: after every completion)."""
        holders: list[list[int]] = []
        for r in self.resident.values():
            holders.append(r.pages)
            if r.copy_sources:
                holders.append(r.copy_sources)
        try:
            self.cache.check(holders)
        except PageAccountingError as exc:
            raise PageAccountingError(f"page accounting broken: {exc}") from None


def group_key(request: Request) -> object:
    """The admission group of ``request``: its spec's group, or its own."""
    group = request.spec.group
    return ("request", request.handle.id) if group is None else group
