"""The reference copy of ``runtime/coordinator/learning.py`` (issue 25): see
``tests/support/reference/__init__.py``.

Funded acceptance learning: the ledger that pays for acceptance probes.

Ordinary completions earn 0.01 / 0.99 of their raw execution time, capped at
5 ms (495 ms of ordinary execution funds the first probe).  At full credit,
with no probe episode open and no timing refresh chosen, one probe may displace
the ordinary winner (:func:`choose_probe`).  A probe is a speculative round,
built by :mod:`runtime.coordinator.rounds` with the optimistic survival
estimates, that

* offers some request at least one depth beyond the ordinary choice (its query
  length exceeds what the ordinary winner gives it: 1 when it is not served or
  served by a width-one program),
* can beat the ordinary choice under the optimistic estimates (its optimistic
  score is higher than the winner's ordinary score),
* leaves future output in which to use the observation (that request has more
  output left than the probe can commit), and runs a measured program (an
  unmeasured one is discovery, accounted apart).

Probes rank by optimistic score improvement per physical time; equal gains
prefer the least-informed added prefix (the smallest aged weight among the
added depths), then the shorter execution, then the smaller geometry
(B, W, P).  Fixed-width execution never probes.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

from runtime.catalog import GraphKind
from runtime.coordinator.credit import CreditLedger
from tests.support.reference.policy import Candidate

ACCEPTANCE_LEARNING_RATE = Fraction(1, 99)  # 0.01 / 0.99


def acceptance_ledger() -> CreditLedger:
    return CreditLedger(ACCEPTANCE_LEARNING_RATE)


def _ordinary_depths(winner: Candidate) -> dict[int, int]:
    """Query length the ordinary winner gives each request it serves."""
    if winner.queries is None:
        return {lane.request.handle.id: 1 for lane in winner.lanes}
    return {lane.request.handle.id: q for lane, q in zip(winner.lanes, winner.queries)}


def choose_probe(
    optimistic: list[Candidate],
    winner: Candidate,
    ledger: CreditLedger,
    weight: Callable[[Candidate, int, int], float],
) -> Candidate | None:
    """The acceptance probe a full ledger funds instead of ``winner``, if any.

    ``optimistic``: speculative candidates scored with the optimistic survival
    estimates; ``weight(candidate, lane index, depth)``: the aged weight of that
    lane's estimate at ``depth`` (the least-informed added prefix wins ties).
    """
    if winner.unknown or not ledger.can_open():
        return None
    ordinary = _ordinary_depths(winner)
    best: tuple | None = None
    chosen: Candidate | None = None
    for cand in optimistic:
        desc = cand.entry.descriptor
        if cand.unknown or cand.queries is None or desc.kind is not GraphKind.SPECULATIVE:
            continue
        if cand.score <= winner.score:
            continue  # cannot beat the ordinary choice even optimistically
        informed = None
        for i, (lane, q) in enumerate(zip(cand.lanes, cand.queries)):
            r = lane.request
            base = ordinary.get(r.handle.id, 1)
            if q <= base or r.remaining_output - r.inflight_output <= q:
                continue  # no added depth, or no future output to use it in
            added = min(weight(cand, i, d) for d in range(base, q))
            informed = added if informed is None else min(informed, added)
        if informed is None:
            continue
        gain = (cand.score - winner.score) / cand.t_ms
        key = (gain, -informed, -cand.t_ms, -desc.batch_capacity, -desc.token_capacity,
               -desc.target_capacity)  # fmt: skip
        if best is None or key > best:
            best, chosen = key, cand
    return chosen
