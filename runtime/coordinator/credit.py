"""Exploration credit ledgers (spec, "Funded timing refresh", "Funded acceptance learning").

A ledger earns ``rate`` times each credited ordinary duration, up to ``cap_ns``
("full credit").  An episode may open only at full credit and while no other
episode of the ledger is open; it spends its actual duration, possibly into
debt.  Idle (nothing runnable, nothing in flight) zeroes a positive balance and
keeps debt.  Together these give: spent <= rate * earned_basis + one episode.
"""

from __future__ import annotations

CAP_NS = 5_000_000  # 5 ms


class CreditLedger:
    __slots__ = ("balance_ns", "cap_ns", "earned_basis_ns", "episode_open", "rate", "spent_ns")

    def __init__(self, rate: float, cap_ns: int = CAP_NS) -> None:
        self.rate = rate
        self.cap_ns = cap_ns
        self.balance_ns = 0.0
        self.episode_open = False
        self.spent_ns = 0
        self.earned_basis_ns = 0

    @property
    def full(self) -> bool:
        return self.balance_ns >= self.cap_ns

    def can_open(self) -> bool:
        return self.full and not self.episode_open

    def earn(self, credited_ns: int) -> None:
        if credited_ns <= 0:
            return
        self.earned_basis_ns += credited_ns
        self.balance_ns = min(float(self.cap_ns), self.balance_ns + self.rate * credited_ns)

    def open_episode(self) -> None:
        if not self.can_open():
            raise RuntimeError("credit episode opened without full credit or while one is open")
        self.episode_open = True

    def close_episode(self, spent_ns: int) -> None:
        spent_ns = max(0, spent_ns)
        self.balance_ns -= spent_ns
        self.spent_ns += spent_ns
        self.episode_open = False

    def idle(self) -> None:
        if self.balance_ns > 0:
            self.balance_ns = 0.0
