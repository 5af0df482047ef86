"""A rank's whole state, host and device, so tests can say a frame changed nothing.

The host side is the slot table's columns and settings; the device side is
every slot's arena rows (page table, pending token, its position and step,
sampling settings, logit bias, and with speculation the token history), its
penalty state and the KV caches (the target's, a draft's).  Scratch rows
(padding writes there) are left out.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from runtime.ranks.worker import RankWorker
from runtime.transport.sampling import SamplingParams

# Every per-slot sampling state at once (penalties, min_tokens, a seed): what a
# restore or a snapshot must carry over exactly.
PENALIZED = SamplingParams(
    temperature=0.9,
    top_p=0.95,
    seed=123,
    min_tokens=8,
    presence_penalty=0.5,
    frequency_penalty=0.4,
    repetition_penalty=1.3,
)

SLOT_COLUMNS = ("generation", "next_position", "pending", "page_count", "full", "logprobs", "step")


def snapshot(worker: RankWorker) -> dict[str, object]:
    """Copies of everything a frame may change (scratch rows excluded)."""
    slots, arena, penalties = worker.slots, worker.arena, worker.outputs.penalties
    n = arena.slots
    kv = worker.model.kv_cache
    state: dict[str, object] = {name: getattr(slots, name).copy() for name in SLOT_COLUMNS}
    state["settings"] = list(slots.settings)
    rows = ("page_tables", "pending", "next_pos", "steps", "floats", "ints", "bias_ids",
            "bias_values")  # fmt: skip
    for name in rows:
        state[f"arena.{name}"] = getattr(arena, name)[:n].clone()
    if arena.history is not None:
        state["arena.history"] = arena.history[:n].clone()
    state["penalties.counts"] = penalties.counts[:n].clone()
    state["penalties.prompt_mask"] = penalties.prompt_mask[:n].clone()
    state["kv"] = kv._storage[:, :, : kv.num_slots].clone()
    if worker.draft_model is not None:
        draft = worker.draft_model.kv_cache
        state["draft_kv"] = draft._storage[:, :, : draft.num_slots].clone()
    state["frames"] = worker.frames
    return state


def changed(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """The names whose values differ."""
    out = []
    for name, old in before.items():
        new = after[name]
        if isinstance(old, torch.Tensor):
            same = torch.equal(old, new)
        elif isinstance(old, np.ndarray):
            same = np.array_equal(old, new)
        else:
            same = old == new
        if not same:
            out.append(name)
    return out


def slot_row(worker: RankWorker, slot: int) -> dict[str, object]:
    """One slot's host state: the table's columns and its settings."""
    row: dict[str, object] = {name: int(getattr(worker.slots, name)[slot]) for name in SLOT_COLUMNS}
    row["settings"] = worker.slots.settings[slot]
    return row


def record_forwards(worker: RankWorker) -> list[dict[str, torch.Tensor]]:
    """Every forward's inputs from now on (the programs share one model): the
    packed input ids, positions, attention metadata and logits rows."""
    model = worker.model
    calls: list[dict[str, torch.Tensor]] = []

    def forward(input_ids, positions, meta, last):
        # Clones: some metadata fields are views of the program's input arena.
        tensors = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
        copied = {k: v.clone() for k, v in tensors.items() if isinstance(v, torch.Tensor)}
        calls.append(
            {"input_ids": input_ids.clone(), "positions": positions.clone(),
             "meta": dataclasses.replace(meta, **copied), "last": last.clone()}
        )  # fmt: skip
        return model(input_ids, positions, meta, last)

    for program in worker.programs.values():
        program.model = forward
    return calls
