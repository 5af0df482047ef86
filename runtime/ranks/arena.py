"""Device-resident state for the rank's lifetime: per-slot rows and per-frame inputs.

:class:`SlotArena` holds, per slot (row ``slots`` is scratch), everything a
frame needs that does not change from frame to frame: the page table, the
pending token (written by the program that samples it, read by the next
decode frame), and the sampling settings (temperature, top-p, top-k, seed,
``min_tokens``, penalties, logit bias).  Rows are written by difference: a
page-table row when pages are appended, the settings when a new generation
arrives.  Programs gather the rows of their lanes by slot inside the body.

:class:`FrameInputs` is one frame's per-lane and per-token integers: one int64
host tensor (pinned on CUDA, double-buffered so the host can pack frame N+1
while frame N's copy may still be in flight) packed with numpy slice
assignments, then moved to the device with one copy of the used slice.

Layout of the integer arena for L lanes and N tokens::

    state_row[L] query_lens[L] start_pos[L] step[L] count_row[L] from_pending[L]
    reset_row[L]  prefill_row  input_ids[N]

``state_row``: the lane's slot (padding: scratch); ``count_row``: where its
sampled token is committed (its slot when it commits one, else scratch);
``from_pending``: 1 for a decode lane, whose token is the slot's pending one
(0 for a prompt lane, whose tokens are in ``input_ids`` at its packed offset,
and for padding); ``reset_row``: the penalty-state row the lane resets before
sampling (its slot when it is a prompt lane that starts a new generation not
restored by the rank, else scratch); ``prefill_row``: a mixed program's prompt
row (-1: none; unused by other programs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from runtime.ranks.sampling import bias_table
from runtime.transport.sampling import MAX_LOGIT_BIAS, SamplingParams

LANE_FIELDS = (
    "state_row",
    "query_lens",
    "start_pos",
    "step",
    "count_row",
    "from_pending",
    "reset_row",
)
SCALARS = ("prefill_row",)
SLOT_FLOATS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
SLOT_INTS = ("top_k", "seed", "min_tokens")
_FLOAT_DEFAULTS = (0.0, 1.0, 0.0, 0.0, 1.0)
_INT_DEFAULTS = (-1, 0, 0)


class SlotArena:
    """Per-slot device rows (``slots + 1`` rows; the last is scratch)."""

    def __init__(
        self,
        slots: int,
        max_pages: int,
        device: torch.device,
        bias_width: int = MAX_LOGIT_BIAS,
        history: int = 0,
    ) -> None:
        self.slots = slots
        self.scratch = slots
        self.max_pages = max_pages
        self.device = device
        rows = slots + 1
        self.page_tables = torch.full((rows, max_pages), -1, dtype=torch.int64, device=device)
        self.pending = torch.zeros(rows, dtype=torch.int64, device=device)
        # The pending token's KV position and the slot's sampling step, written by
        # every program that commits (a speculative round advances them by the
        # tokens it accepted, which the host learns only later): decode lanes
        # read them here, so a frame queued behind a round continues from the
        # round's actual end.
        self.next_pos = torch.zeros(rows, dtype=torch.int64, device=device)
        self.steps = torch.zeros(rows, dtype=torch.int64, device=device)
        # With speculation: each slot's tokens by position (prompt, committed
        # output, the pending token), ``history`` columns; copy proposals and the
        # draft model's context read it.  None without speculation.
        self.history_width = history
        self.history = (
            torch.zeros(rows, history, dtype=torch.int64, device=device) if history else None
        )
        self.floats = torch.tensor([_FLOAT_DEFAULTS] * rows, dtype=torch.float32).to(device)
        self.ints = torch.tensor([_INT_DEFAULTS] * rows, dtype=torch.int64).to(device)
        ids, values = bias_table((), rows, bias_width)
        self.bias_ids, self.bias_values = ids.to(device), values.to(device)
        self.bias_width = bias_width
        self._biased: set[int] = set()  # rows holding bias entries
        self._held: list[SamplingParams | None] = [None] * rows  # settings in each row

    def append_pages(self, slot: np.ndarray, base: np.ndarray, counts: np.ndarray, pages) -> None:
        """Append ``pages`` (flat, in lane order) to each lane's slot row at ``base``."""
        if not pages.size:
            return
        if counts.size == 1:  # one lane (a single prefill frame): one slice write
            row, first = int(slot[0]), int(base[0])
            values = torch.from_numpy(np.ascontiguousarray(pages))
            self.page_tables[row, first : first + pages.size].copy_(values)
            return
        lanes = np.nonzero(counts)[0]
        rows = np.repeat(slot[lanes], counts[lanes])
        # Column of each appended page: its lane's base plus its index in the lane's run.
        first = np.repeat(np.cumsum(counts[lanes]) - counts[lanes], counts[lanes])
        cols = np.repeat(base[lanes], counts[lanes]) + np.arange(pages.size) - first
        index = torch.from_numpy(rows * self.max_pages + cols)
        values = torch.from_numpy(np.ascontiguousarray(pages))
        if self.device.type != "cpu":
            index, values = index.to(self.device), values.to(self.device)
        self.page_tables.view(-1).index_copy_(0, index, values)

    def set_history(self, slot: int, tokens: Sequence[int]) -> None:
        """``tokens`` at positions 0..len-1 of the slot's history (a restored
        generation's known prefix); nothing without speculation."""
        if self.history is None or not tokens:
            return
        n = min(len(tokens), self.history_width)
        self.history[slot, :n].copy_(torch.tensor(tokens[:n], dtype=torch.int64))

    def set_sampling(self, slot: int, params: SamplingParams) -> None:
        """A new generation's settings into the slot's rows (nothing to write when
        the slot's last settings were equal)."""
        if self._held[slot] == params:
            return
        self._held[slot] = params
        floats, ints = _settings_rows(params)
        self.floats[slot : slot + 1].copy_(floats)
        self.ints[slot : slot + 1].copy_(ints)
        if params.logit_bias or slot in self._biased:
            ids, values = bias_table((params,), 1, self.bias_width)
            self.bias_ids[slot : slot + 1].copy_(ids)
            self.bias_values[slot : slot + 1].copy_(values)
            if params.logit_bias:
                self._biased.add(slot)
            else:
                self._biased.discard(slot)

    def settings(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each lane's settings gathered by slot (``rows`` (L,) int64): name -> (L,)
        tensor, and ``bias_ids``/``bias_values`` (L, B)."""
        floats = self.floats.index_select(0, rows)  # (L, 5)
        ints = self.ints.index_select(0, rows)  # (L, 3)
        out = {name: floats[:, i] for i, name in enumerate(SLOT_FLOATS)}
        out.update({name: ints[:, i] for i, name in enumerate(SLOT_INTS)})
        out["bias_ids"] = self.bias_ids.index_select(0, rows)
        out["bias_values"] = self.bias_values.index_select(0, rows)
        return out


@lru_cache(maxsize=1024)
def _settings_rows(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 5) float32 and (1, 3) int64 host rows of ``params`` (few distinct ones)."""
    floats = torch.tensor([[getattr(params, name) for name in SLOT_FLOATS]], dtype=torch.float32)
    ints = torch.tensor([[getattr(params, name) for name in SLOT_INTS]], dtype=torch.int64)
    return floats, ints


def int_size(tokens: int, lanes: int) -> int:
    return len(LANE_FIELDS) * lanes + len(SCALARS) + tokens


@dataclass(frozen=True)
class FrameInputs:
    """Views of one program's integer arena (see the module docstring)."""

    state_row: torch.Tensor  # (L,)
    query_lens: torch.Tensor  # (L,)
    start_pos: torch.Tensor  # (L,)
    step: torch.Tensor  # (L,)
    count_row: torch.Tensor  # (L,)
    from_pending: torch.Tensor  # (L,)
    reset_row: torch.Tensor  # (L,)
    prefill_row: torch.Tensor  # (1,)
    input_ids: torch.Tensor  # (N,)

    @classmethod
    def over(cls, ints: torch.Tensor, tokens: int, lanes: int) -> FrameInputs:
        sizes = [lanes] * len(LANE_FIELDS) + [1] * len(SCALARS) + [tokens]
        parts = ints[: sum(sizes)].split_with_sizes(sizes)
        return cls(**dict(zip(LANE_FIELDS + SCALARS + ("input_ids",), parts)))


class HostStaging:
    """Host int64 buffers for packing frames: pinned on CUDA, two of them, used in
    turn, so packing frame N+1 never overwrites memory frame N's copy still reads.

    Each buffer keeps a memo of what it was last packed with (see
    :meth:`~runtime.ranks.programs.PreparedProgram.pack`), so a steady decode
    frame rewrites only the fields that changed since.
    """

    def __init__(self, size: int, device: torch.device, buffers: int = 2) -> None:
        pin = device.type == "cuda"
        self.tensors = [
            torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(buffers)
        ]
        self.arrays = [t.numpy() for t in self.tensors]
        self.memos: list[list] = [[None] for _ in range(buffers)]
        self._next = 0
        self.current = 0

    def take(self) -> tuple[torch.Tensor, np.ndarray]:
        i = self.current = self._next
        self._next = (i + 1) % len(self.tensors)
        return self.tensors[i], self.arrays[i]

    @property
    def memo(self) -> list:
        """The memo of the buffer :meth:`take` returned last (a one-item list)."""
        return self.memos[self.current]
