"""The reference copy of ``runtime/coordinator/refresh.py`` (issue 25): see
``tests/support/reference/__init__.py``.

Funded timing refresh (spec, "Funded timing refresh").

Ordinary valid completions earn 0.002 / 0.998 of their credited duration, capped
at 5 ms; 2,495 ms of credited ordinary execution fund the first refresh.  At full
credit, with no refresh episode open, one stale alternative may displace the
ordinary measured winner.  Alternatives are ordered by the later of their last
valid observation and last attempted dispatch (oldest first), then by ordinary
ranking.  The refresh spends its actual duration once, into debt if need be.
"""

from __future__ import annotations

from fractions import Fraction

from runtime.coordinator.credit import CreditLedger
from tests.support.reference.policy import Candidate

TIMING_REFRESH_RATE = Fraction(2, 998)  # 0.002 / 0.998


def timing_ledger() -> CreditLedger:
    return CreditLedger(TIMING_REFRESH_RATE)


def _last_touch(candidate: Candidate) -> int:
    entry = candidate.entry
    return max(entry.last_valid_ns or 0, entry.last_attempt_ns or 0)


def choose_refresh(
    cands: list[Candidate], winner: Candidate, ledger: CreditLedger
) -> Candidate | None:
    """The stale alternative a full ledger funds instead of ``winner``, if any."""
    if winner.unknown or not ledger.can_open():
        return None
    best_per_graph: dict[tuple, Candidate] = {}
    for cand in cands:
        if not cand.stale or cand is winner or cand.entry is winner.entry:
            continue
        key = cand.entry.descriptor.key
        held = best_per_graph.get(key)
        if held is None or cand.rank_key() > held.rank_key():
            best_per_graph[key] = cand
    if not best_per_graph:
        return None
    # Oldest last touch first; among equals, the better ordinary ranking.
    return max(best_per_graph.values(), key=lambda c: (-_last_touch(c), c.rank_key()))
