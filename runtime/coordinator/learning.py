"""Funded acceptance learning: the ledger that pays for acceptance probes.

Ordinary completions earn 0.01 / 0.99 of their raw execution time, capped at
5 ms (495 ms of ordinary execution funds the first probe).  The probes
themselves (offering a request one depth beyond the ordinary choice, ranked by
optimistic score improvement per physical time) belong to speculative
scheduling and are built with the speculative rounds; the ledger is kept from
the start so its balance and the execution classes are already accounted.
"""

from __future__ import annotations

from fractions import Fraction

from runtime.coordinator.credit import CreditLedger

ACCEPTANCE_LEARNING_RATE = Fraction(1, 99)  # 0.01 / 0.99


def acceptance_ledger() -> CreditLedger:
    return CreditLedger(ACCEPTANCE_LEARNING_RATE)
