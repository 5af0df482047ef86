"""A rank's writes into the device rows outside its programs, at a frame's launch.

Appended pages and new generations' settings go into the slot arena
(:meth:`DeviceRows.update`); a restored generation's penalty row and history are
written as if the slot had consumed its record (:meth:`DeviceRows.restore`);
a state frame's restore rows get their next position and step, and a
decode-ready row its pending token and history (:meth:`DeviceRows.ready`).
"""

from __future__ import annotations

import torch

from runtime.ranks.arena import SlotArena
from runtime.ranks.checked_frame import CheckedFrame
from runtime.ranks.sampling import PenaltyState
from runtime.transport.restore import Restore


class DeviceRows:
    """The slot arena's rows and the penalty state of one rank, on ``device``."""

    def __init__(self, arena: SlotArena, penalties: PenaltyState, device: torch.device) -> None:
        self.arena = arena
        self.penalties = penalties
        self.device = device

    def ready(self, checked: CheckedFrame) -> None:
        """A state frame's restore rows on the device: each slot's next position
        and step (what a lane continuing from its pending token reads), and for
        a decode-ready row (``position == len(tokens) - 1``) the pending token
        ``tokens[-1]`` and the whole record in its history, as a prefill that
        committed ``tokens[-1]`` at ``position`` would have left them."""
        if not checked.restores:
            return
        lanes = sorted(checked.restores)
        rows = [int(checked.slot[i]) for i in lanes]
        position = [int(checked.position[i]) for i in lanes]
        values = torch.tensor(
            [
                position,
                [checked.restores[i].step for i in lanes],
                [checked.restores[i].tokens[-1] for i in lanes],
            ],
            dtype=torch.int64,
        ).to(self.device)
        index = torch.tensor(rows, dtype=torch.int64).to(self.device)
        arena = self.arena
        arena.next_pos.index_copy_(0, index, values[0])
        arena.steps.index_copy_(0, index, values[1])
        ready = [
            k for k, i in enumerate(lanes) if position[k] == len(checked.restores[i].tokens) - 1
        ]
        if ready:
            at = torch.tensor(ready, dtype=torch.int64).to(self.device)
            arena.pending.index_copy_(0, index.index_select(0, at), values[2].index_select(0, at))
            for k in ready:
                arena.set_history(rows[k], checked.restores[lanes[k]].tokens)

    def update(self, checked: CheckedFrame) -> None:
        """Appended pages and new generations' settings into the device rows; a new
        generation's page-table row starts empty (a round's draft extent past
        the pages a slot holds must find no page there)."""
        if checked.starts.any():
            fresh = torch.from_numpy(checked.slot[checked.starts]).to(self.device)
            self.arena.page_tables.index_fill_(0, fresh, -1)
        self.arena.append_pages(checked.slot, checked.page_base, checked.page_count, checked.pages)
        for i, params in checked.sampling.items():
            if checked.starts[i]:
                self.arena.set_sampling(int(checked.slot[i]), params)
        for i, restore in checked.restores.items():
            self.restore(int(checked.slot[i]), restore, int(checked.position[i]))

    def restore(self, slot: int, restore: Restore, position: int) -> None:
        """A restored generation's device rows: the penalty row as if the slot had
        consumed ``restore.tokens[:output_start]`` and committed the rest (the
        program does not reset it, see ``PreparedProgram.pack``), and the known
        prefix ``tokens[:position]`` in the slot's history (speculation); the
        sampling step travels in the frame's packed step."""
        tokens, start = restore.tokens, restore.output_start
        self.penalties.restore(slot, tokens[:start], tokens[start:])
        self.arena.set_history(slot, tokens[:position])
