"""Prefix reuse on the ranks (protocol version 6): page copies and restored rows.

Two optional fields of :class:`~runtime.transport.frame.Frame`, checked here:

* ``copies``: (source page, destination page) pairs.  Before the frame's
  program runs (an empty frame's too), every rank copies each source page's
  full contents into its destination page in every KV cache it holds (the
  target's and the draft's; every layer, K and V), in order.  This is how a
  request gets a private copy of a shared page it will write into
  (copy-on-write).  Pages lie in [0, INT32_MAX] (and inside the rank's pool);
  a pair never copies a page onto itself, destinations are distinct, and no
  page is both a source and a destination in one frame.
* ``restores``: (lane index, :class:`Restore`) for prefill lanes that start a
  new generation of their slot from a known token sequence: with KV already
  in the pages it appends (an attached prefix, ``position`` > 0) or with none
  (a preempted request recomputing from position 0).  At most one per lane.
  Protocol version 7: also for the state lanes of a RESTORE program (a
  *restore row*, which runs no forward): ``position == prompt_start <=
  len(tokens) - 1`` leading positions are held by its pages; at
  ``len(tokens) - 1`` the slot becomes decode-ready (its pending token is
  ``tokens[-1]`` at that position, as if a prefill had just committed it),
  below it prefill-ready at ``position`` (the next lane is a prefill lane
  continuing ``tokens``).

No torch here: the ranks apply both (``runtime/ranks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.transport.fields import (
    INT32_MAX,
    MAX_SEQUENCE,
    ProtocolError,
    check_fields,
    check_int,
    check_ints,
    check_seq,
    parse_nested,
    set_field,
)

MAX_COPIES = MAX_SEQUENCE  # page pairs in one frame


@dataclass(frozen=True)
class Restore:
    """A new generation's known token sequence, for a prefill lane that resumes it.

    ``tokens``: the request's whole sequence before this generation, by
    position (0..len-1): its prompt, then the output tokens already emitted to
    the user.  ``output_start``: the index in ``tokens`` where the output
    begins (``len(tokens)`` when nothing was emitted yet).

    For the lane's slot the rank then holds what it would hold had it computed
    ``tokens`` itself: the sampling step is ``len(tokens) - output_start`` (so
    seeded sampling and ``min_tokens`` go on where they were), the penalty
    state marks ``tokens[:output_start]`` as the prompt and counts
    ``tokens[output_start:]`` as output, and (with speculation) the slot's
    history holds ``tokens[:position]``.  The lane may start at any
    ``position`` <= ``len(tokens)`` with ``prompt_start == position``:
    positions before it must already hold valid KV in the pages the lane
    appends; its chunk must equal ``tokens[position : position + query_len]``
    where the two overlap, and may run past ``len(tokens)`` only when
    ``output_start == len(tokens)`` (a plain prompt, nothing emitted).
    """

    tokens: tuple[int, ...]
    output_start: int

    def __post_init__(self) -> None:
        tokens = check_ints("tokens", self.tokens, 0, INT32_MAX)
        check_int("output_start", self.output_start, 0, len(tokens))
        set_field(self, "tokens", tokens)

    @property
    def step(self) -> int:
        """Output tokens already emitted: the sampling step the generation resumes at."""
        return len(self.tokens) - self.output_start

    def to_wire(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "output_start": self.output_start}

    @classmethod
    def from_wire(cls, data: Any) -> Restore:
        return cls(**check_fields(cls, data))


def check_copies(value: Any) -> tuple[tuple[int, int], ...]:
    """``copies`` validated (see the module docstring); ProtocolError names ``copies``."""
    pairs = value if type(value) is tuple and not value else check_seq("copies", value, MAX_COPIES)
    if not pairs:
        return ()
    out: list[tuple[int, int]] = []
    for k, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ProtocolError(f"copies[{k}]", "must be a (source page, destination page) pair")
        src = check_int(f"copies[{k}][0]", pair[0], 0, INT32_MAX)
        dst = check_int(f"copies[{k}][1]", pair[1], 0, INT32_MAX)
        if src == dst:
            raise ProtocolError(f"copies[{k}]", f"copies page {src} onto itself")
        out.append((src, dst))
    destinations = [dst for _, dst in out]
    if len(set(destinations)) != len(destinations):
        dup = next(d for i, d in enumerate(destinations) if d in destinations[:i])
        raise ProtocolError("copies", f"page {dup} is a destination twice")
    both = set(destinations).intersection(src for src, _ in out)
    if both:
        raise ProtocolError("copies", f"page {min(both)} is both a source and a destination")
    return tuple(out)


def check_restores(
    value: Any, prefill: tuple[int, ...], role: str = "prefill"
) -> tuple[tuple[int, Restore], ...]:
    """``restores`` validated against the lanes that may carry one (``prefill``: the
    frame's prefill lanes, or a RESTORE program's state lanes, ``role`` "state");
    ProtocolError names ``restores``."""
    entries = (
        value if type(value) is tuple and not value else check_seq("restores", value, MAX_COPIES)
    )
    if not entries:
        return ()
    out: list[tuple[int, Restore]] = []
    seen: set[int] = set()
    for k, entry in enumerate(entries):
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ProtocolError(f"restores[{k}]", "must be a (lane index, Restore) pair")
        lane, restore = entry
        check_int(f"restores[{k}][0]", lane, 0, INT32_MAX)
        if lane not in prefill:
            where = "a state lane of a restore program" if role == "state" else "a prefill lane"
            raise ProtocolError("restores", f"lane {lane} is not {where} of the frame")
        if lane in seen:
            raise ProtocolError("restores", f"lane {lane} has two restore records")
        if not isinstance(restore, Restore):
            raise ProtocolError(f"restores[{k}][1]", "must be a Restore")
        seen.add(lane)
        out.append((lane, restore))
    return tuple(out)


def copies_from_wire(value: Any) -> tuple[tuple[int, int], ...]:
    """The wire's ``[[src, dst], ...]`` as pairs (checked by the frame)."""
    pairs = check_seq("copies", value, MAX_COPIES)
    return tuple(tuple(p) if isinstance(p, list) else p for p in pairs)


def restores_from_wire(value: Any) -> tuple[tuple[int, Restore], ...]:
    """The wire's ``[[lane, restore map], ...]`` as pairs (checked by the frame)."""
    entries = check_seq("restores", value, MAX_COPIES)
    out = []
    for k, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != 2:
            raise ProtocolError(f"restores[{k}]", "must be a (lane index, Restore) pair")
        out.append((entry[0], parse_nested(f"restores[{k}]", Restore.from_wire, entry[1])))
    return tuple(out)


__all__ = [
    "MAX_COPIES",
    "Restore",
    "check_copies",
    "check_restores",
    "copies_from_wire",
    "restores_from_wire",
]
