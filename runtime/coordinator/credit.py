"""Exploration credit ledgers (spec, "Funded timing refresh", "Funded acceptance learning").

A ledger earns ``rate`` times each credited ordinary duration, up to ``cap_ns``
("full credit").  An episode may open only at full credit and while no other
episode of the ledger is open; it spends its actual duration, possibly into
debt.  Idle (nothing runnable, nothing in flight) zeroes a positive balance and
keeps debt.  Together these give: spent <= rate * earned_basis + one episode.
"""

from __future__ import annotations

from fractions import Fraction

CAP_NS = 5_000_000  # 5 ms


class CreditLedger:
    __slots__ = ("_balance", "cap_ns", "earned_basis_ns", "episode_open", "rate", "spent_ns")

    def __init__(self, rate: Fraction, cap_ns: int = CAP_NS) -> None:
        # Exact arithmetic: 2,495 ms of credited time must reach the cap however
        # it is split into frames, which binary floating point does not give.
        self.rate = Fraction(rate)
        self.cap_ns = cap_ns
        self._balance = Fraction(0)
        self.episode_open = False
        self.spent_ns = 0
        self.earned_basis_ns = 0

    @property
    def balance_ns(self) -> float:
        return float(self._balance)

    @property
    def full(self) -> bool:
        return self._balance >= self.cap_ns

    def can_open(self) -> bool:
        return self.full and not self.episode_open

    def earn(self, credited_ns: int) -> None:
        if credited_ns <= 0:
            return
        self.earned_basis_ns += credited_ns
        self._balance = min(Fraction(self.cap_ns), self._balance + self.rate * credited_ns)

    def open_episode(self) -> None:
        if not self.can_open():
            raise RuntimeError("credit episode opened without full credit or while one is open")
        self.episode_open = True

    def close_episode(self, spent_ns: int) -> None:
        spent_ns = max(0, spent_ns)
        self._balance -= spent_ns
        self.spent_ns += spent_ns
        self.episode_open = False

    def idle(self) -> None:
        if self._balance > 0:
            self._balance = Fraction(0)
