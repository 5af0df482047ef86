"""Request slots and KV pages owned by the coordinator.

Slots carry a generation that increments on every reuse, so a frame that names
(slot, generation) can never be confused with the slot's next tenant.  Pages
are reserved whole at residency (prompt + output limit) and released only after
the request's last submitted fence completes.
"""

from __future__ import annotations


class ResourceError(RuntimeError):
    """A resource invariant would be broken."""


class SlotPool:
    """The request slots: free ones, and each slot's generation (bumped on every reuse)."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self.generations = [0] * num_slots

    @property
    def free_count(self) -> int:
        return len(self._free)

    def acquire(self) -> tuple[int, int]:
        if not self._free:
            raise ResourceError("no free request slot")
        slot = self._free.pop()
        self.generations[slot] += 1
        return slot, self.generations[slot]

    def renew(self, slot: int) -> int:
        """A fresh generation of a held slot (an image window's restore)."""
        if slot in self._free:
            raise ResourceError(f"slot {slot} is free: it has no tenant to renew")
        self.generations[slot] += 1
        return self.generations[slot]

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ResourceError(f"slot {slot} released twice")
        self._free.append(slot)


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_pages - len(self._free)

    def reserve(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ResourceError(f"need {count} pages, {len(self._free)} free")
        pages = self._free[-count:][::-1] if count else []
        del self._free[len(self._free) - count :]
        return pages

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
