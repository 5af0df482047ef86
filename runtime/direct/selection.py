"""Direct mode's selection: which program runs next, and for whom.

Two pure functions over the residents and the cost catalog, written for direct
mode alone (nothing here comes from the coordinator's policy, utility, service
or projection modules):

* :func:`choose_prefill`: the oldest resident request still in its prompt gets
  the next chunk, on the smallest prefill program whose prompt capacity holds
  the rest of its prompt (up to a hard boundary), else on the largest prefill
  program, a full chunk.
* :func:`choose_decode`: the spec's value-per-time selection for decode rounds.
  Every decode program of batch capacity B serves min(B, n) of the n decoders,
  least recently served first; its value is the lanes it serves (one token
  each).  Programs of B >= n all serve every decoder, so only the smallest of
  them competes (padding never wins, whatever the estimates say).  An
  unmeasured competitor is discovery and goes first: the one serving the most
  decoders (the smallest program fitting every decoder when that one is
  unmeasured, else the largest unmeasured one below n).  With every competitor
  measured, the highest value per estimated time wins; equal rates prefer more
  lanes.

Mixed, speculative and every other program kind are never chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.direct.cost import CostEstimate, DirectCatalog
from runtime.direct.residency import DirectRequest


@dataclass(frozen=True)
class Choice:
    """A selected program and its lanes.

    ``requests``: the lanes' requests, in lane order.  ``prompt_tokens``: the
    chunk of a prefill (0 for decode).  ``estimate_ns``: the program's estimate
    at selection (0: unmeasured, so ``discovery``).  ``value``: prompt tokens of
    a prefill chunk, lanes of a decode round.
    """

    graph: GraphDescriptor
    requests: tuple[DirectRequest, ...]
    prompt_tokens: int
    estimate_ns: int
    value: float

    @property
    def discovery(self) -> bool:
        return self.estimate_ns <= 0

    @property
    def rate(self) -> float:
        """Value per estimated millisecond; the bare value when unmeasured."""
        return self.value if self.discovery else self.value / (self.estimate_ns / 1e6)


def oldest_prompt(residents: Sequence[DirectRequest]) -> DirectRequest | None:
    """The resident request still in its prompt that was admitted first."""
    prompts = [r for r in residents if r.runnable and r.consumed_prompt < r.spec.prompt_len]
    return min(prompts, key=lambda r: r.arrival, default=None)


def choose_prefill(request: DirectRequest, catalog: DirectCatalog) -> Choice | None:
    """The next prompt chunk of ``request``; None without a prefill program."""
    programs = catalog.programs(GraphKind.PREFILL)  # by prompt capacity, smallest first
    if not programs:
        return None
    left = request.prompt_left()
    entry = next((e for e in programs if e.descriptor.prompt_capacity >= left), programs[-1])
    tokens = min(left, entry.descriptor.prompt_capacity)
    return Choice(entry.descriptor, (request,), tokens, entry.estimate_ns, float(tokens))


def decoders_by_service(residents: Sequence[DirectRequest]) -> list[DirectRequest]:
    """Decoders free to run (resident, past their prompt, no frame in flight),
    least recently served first, then oldest first."""
    ready = [
        r
        for r in residents
        if r.runnable
        and not r.in_flight
        and r.consumed_prompt >= r.spec.prompt_len
        and r.remaining_output > 0
    ]
    return sorted(ready, key=lambda r: (r.last_served, r.arrival))


def choose_decode(decoders: Sequence[DirectRequest], catalog: DirectCatalog) -> Choice | None:
    """The decode round for ``decoders`` (in service order); None if none or no program."""
    n = len(decoders)
    programs = catalog.programs(GraphKind.DECODE)  # by batch capacity, smallest first
    if not n or not programs:
        return None

    def served(entry: CostEstimate) -> int:
        return min(entry.descriptor.batch_capacity, n)

    # Programs fitting every decoder serve the same lanes: only the smallest competes.
    fitting = [e for e in programs if e.descriptor.batch_capacity >= n]
    competing = [e for e in programs if e.descriptor.batch_capacity < n] + fitting[:1]
    unmeasured = [e for e in competing if not e.measured]
    if unmeasured:  # discovery first: the most decoders served
        entry = max(unmeasured, key=served)
    else:
        entry = max(competing, key=lambda e: (served(e) / e.mean_ns, served(e)))
    k = served(entry)
    return Choice(entry.descriptor, tuple(decoders[:k]), 0, entry.estimate_ns, float(k))
