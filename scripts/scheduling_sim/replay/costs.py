"""Per-graph costs measured by a recorded deployment, and the rule for graphs it never ran.

A measured graph costs the median of its frames' device intervals (a frame
line's ``device_ns``: the largest rank interval).  A graph the trace never ran
(the replayed scheduler chose it, or a baseline synthesized it) is priced from
measured graphs, and :attr:`MeasuredCosts.priced` says how, graph by graph.

The rule.  A graph's *size* is what its cost grows with: prompt capacity C for
a prefill, C + P (every token it processes) for a mixed program, the target
rows P for a speculative one, the batch B for decode, snapshot and restore.
Its *family* is the measured graphs of its kind and class (a prefill: the same
batch, one row or packed; a mixed program: the same width; a speculative one:
the same width and depth; the rest: the whole kind); with none there, the
measured graphs of its kind.  Within the family:

* ``interpolated``: linearly in size between the nearest measured graphs
  below and above;
* ``extrapolated``: beyond the measured sizes, along the line through the two
  nearest, kept between the nearest's cost and that cost scaled by the size
  ratio (a cost neither shrinks as the size grows nor grows faster than it);
* ``scaled``: one measured graph: a prompt kind's cost scaled by the size
  ratio, another kind's taken as it is.

With no measured graph of its kind, a mixed program is priced as a prefill of
its C + P tokens, a speculative one as the decode of its batch (both by the
rule above, over that kind's graphs), and anything else at the cheapest
measured graph (``cheapest``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from runtime.catalog import PROMPT_KINDS, GraphDescriptor, GraphKind

FIELDS = ("kind", "batch_capacity", "token_capacity", "proposal_depth", "target_capacity",
          "prompt_capacity")  # fmt: skip


class CostError(ValueError):
    """The trace cannot price graphs (no frame with a device interval)."""


def parse_program(name: str) -> GraphDescriptor:
    """A descriptor from its :meth:`GraphDescriptor.describe` name (the start line's
    ``programs``), e.g. ``mixed B=4 D=0 W=1 P=4 C=64``."""
    words = name.split()
    if not words:
        raise ValueError(f"not a program name: {name!r}")
    extents = {}
    for word in words[1:]:
        key, _, value = word.partition("=")
        if word == "device-allocated":
            continue
        if key not in ("B", "D", "W", "P", "C") or not value.isdigit():
            raise ValueError(f"not a program name: {name!r} ({word!r})")
        extents[key] = int(value)
    if "B" not in extents:
        raise ValueError(f"not a program name: {name!r} (no B=)")
    return GraphDescriptor(
        GraphKind(words[0]), extents["B"], token_capacity=extents.get("W", 1),
        proposal_depth=extents.get("D", 0), target_capacity=extents.get("P", 0),
        prompt_capacity=extents.get("C", 0), device_allocated="device-allocated" in words[1:],
    )  # fmt: skip


def frame_descriptor(frame: dict) -> GraphDescriptor:
    """The graph a frame line ran (its fields; its name for ``device-allocated``)."""
    if all(name in frame for name in FIELDS):
        return GraphDescriptor(
            GraphKind(frame["kind"]), frame["batch_capacity"], frame["token_capacity"],
            frame["proposal_depth"], frame["target_capacity"], frame["prompt_capacity"],
            device_allocated="device-allocated" in frame.get("graph", ""),
        )  # fmt: skip
    return parse_program(frame["graph"])


def size(desc: GraphDescriptor) -> int:
    kind = desc.kind
    if kind is GraphKind.MIXED:
        return desc.prompt_capacity + desc.target_capacity
    if kind in PROMPT_KINDS:
        return desc.prompt_capacity
    if kind is GraphKind.SPECULATIVE:
        return desc.target_capacity
    return desc.batch_capacity


def family(desc: GraphDescriptor) -> tuple:
    kind = desc.kind
    if kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        return (kind, desc.batch_capacity)
    if kind is GraphKind.MIXED:
        return (kind, desc.token_capacity)
    if kind is GraphKind.SPECULATIVE:
        return (kind, desc.token_capacity, desc.proposal_depth, desc.device_allocated)
    return (kind,)


@dataclass(frozen=True)
class Priced:
    """How an unmeasured graph was priced: ``rule`` and the measured graphs it used."""

    graph: str
    cost_ns: int
    rule: str
    sources: tuple[str, ...]

    def to_json(self) -> dict:
        return {"graph": self.graph, "cost_ns": self.cost_ns, "rule": self.rule,
                "from": list(self.sources)}  # fmt: skip


class MeasuredCosts:
    """``duration_ns(desc)``: the measured median, or the rule's price (remembered)."""

    def __init__(self, frames: Iterable[dict]) -> None:
        intervals: dict[GraphDescriptor, list[int]] = {}
        for frame in frames:
            if frame.get("device_ns", 0) > 0:
                intervals.setdefault(frame_descriptor(frame), []).append(frame["device_ns"])
        if not intervals:
            raise CostError("the trace has no frame with a device interval to price graphs from")
        self.samples = {d: len(v) for d, v in intervals.items()}
        self.measured = {d: int(statistics.median(v)) for d, v in intervals.items()}
        self.priced: dict[GraphDescriptor, Priced] = {}

    def duration_ns(self, desc: GraphDescriptor) -> int:
        cost = self.measured.get(desc)
        if cost is not None:
            return cost
        priced = self.priced.get(desc)
        if priced is None:
            priced = self.priced[desc] = self._price(desc)
        return priced.cost_ns

    def median_ns(self, desc: GraphDescriptor) -> int | None:
        return self.measured.get(desc)

    def _price(self, desc: GraphDescriptor) -> Priced:
        name = desc.describe()
        points = [d for d in self.measured if family(d) == family(desc)]
        if not points:
            points = [d for d in self.measured if d.kind is desc.kind]
        if points:
            cost, rule, sources = self._along(points, size(desc), desc.kind in PROMPT_KINDS)
            return Priced(name, cost, rule, sources)
        stand_in = self._stand_in(desc)
        if stand_in is not None:
            kind, at, points = stand_in
            cost, rule, sources = self._along(points, at, kind in PROMPT_KINDS)
            return Priced(name, cost, f"as {kind.value}, {rule}", sources)
        cheapest = min(self.measured, key=lambda d: (self.measured[d], d.describe()))
        return Priced(name, self.measured[cheapest], "cheapest", (cheapest.describe(),))

    def _stand_in(
        self, desc: GraphDescriptor
    ) -> tuple[GraphKind, int, list[GraphDescriptor]] | None:
        """A mixed program as a one-row prefill of its C + P tokens, a speculative
        one as the decode of its batch, when that kind was measured."""
        if desc.kind is GraphKind.MIXED:
            kind, at = GraphKind.PREFILL, size(desc)
        elif desc.kind is GraphKind.SPECULATIVE:
            kind, at = GraphKind.DECODE, desc.batch_capacity
        else:
            return None
        points = [d for d in self.measured if d.kind is kind]
        single = [d for d in points if d.batch_capacity == 1 or kind is GraphKind.DECODE]
        return (kind, at, single or points) if points else None

    def _along(
        self, points: list[GraphDescriptor], at: int, proportional: bool
    ) -> tuple[int, str, tuple[str, ...]]:
        """The price at size ``at`` from the measured ``points`` (the module's rule)."""
        by_size: dict[int, GraphDescriptor] = {}
        for d in sorted(points, key=lambda d: (size(d), self.measured[d], d.describe())):
            by_size.setdefault(size(d), d)  # one graph per size: the cheapest
        sizes = sorted(by_size)
        below = [s for s in sizes if s <= at]
        above = [s for s in sizes if s >= at]
        if below and above:
            lo, hi = below[-1], above[0]
            c_lo, c_hi = self.measured[by_size[lo]], self.measured[by_size[hi]]
            cost = c_lo if hi == lo else c_lo + (c_hi - c_lo) * (at - lo) / (hi - lo)
            return round(cost), "interpolated", (by_size[lo].describe(), by_size[hi].describe())
        near = sorted(sizes, key=lambda s: abs(s - at))
        nearest = by_size[near[0]]
        c_near = self.measured[nearest]
        ratio = at / max(1, near[0])
        bounds = sorted((c_near, c_near * ratio))
        if len(near) == 1:
            cost = c_near * ratio if proportional else c_near
            return round(cost), "scaled", (nearest.describe(),)
        second = by_size[near[1]]
        slope = (c_near - self.measured[second]) / (near[0] - near[1])
        cost = min(max(c_near + slope * (at - near[0]), bounds[0]), bounds[1])
        return round(cost), "extrapolated", (nearest.describe(), second.describe())
