"""A rank's completions: the lane columns, sidecars and timings of a finished
frame, as the wire's :class:`~runtime.transport.completion.Completion`.

Rank 0 reports the lanes (slot, generation, committed token count, tokens and
whether each lane finished on an EOS); when a lane of the frame asks for log
probabilities, it adds the ``logprobs`` and ``logprob_token_ids`` sidecars;
otherwise only the sampled tokens are read back.  A scored prefill's rank 0
adds ``prompt_logprobs`` and ``prompt_logprob_token_ids``, one row per packed
prompt token.  A speculative round's
confidence and survival sidecars come from every rank.
"""

from __future__ import annotations

import time
from array import array

import numpy as np
import torch

from runtime.ranks.checked_frame import CheckedFrame
from runtime.ranks.launch import Launch
from runtime.ranks.speculative import RoundOutputs
from runtime.transport.completion import Completion
from runtime.transport.tensor import Tensor, tensor_from_torch


def ints(values: np.ndarray) -> array:
    """A numpy column as the wire's ``array('q')``."""
    return array("q", values.astype(np.int64, copy=False).tobytes())


def state_columns(checked: CheckedFrame) -> dict[str, array]:
    """A state frame's lanes: one per row, nothing committed."""
    zeros = np.zeros(checked.lanes, np.int64)
    return {
        "slot": ints(checked.slot),
        "generation": ints(checked.generation),
        "token_count": ints(zeros),
        "tokens": array("q"),
        "finished": ints(zeros),
    }


def forward_columns(checked: CheckedFrame, tokens: np.ndarray, is_eos: np.ndarray) -> dict:
    """A forward frame's lanes: each committing lane's sampled token."""
    commits = checked.commits
    committed = commits > 0
    return {
        "slot": ints(checked.slot),
        "generation": ints(checked.generation),
        "token_count": ints(commits),
        "tokens": ints(tokens[committed]),
        "finished": ints(committed & is_eos[tokens]),
    }


def logprob_sidecars(values: torch.Tensor, ids: torch.Tensor) -> dict[str, Tensor]:
    """The log-probability sidecars: (R, 1 + k) float32 values, (R, k) int32 ids."""
    return {
        "logprobs": tensor_from_torch(values),
        "logprob_token_ids": tensor_from_torch(ids),
    }


def prompt_logprob_sidecars(values: torch.Tensor, ids: torch.Tensor) -> dict[str, Tensor]:
    """A scored prefill's sidecars: (T, 1 + k) float32 (per packed prompt token the
    next prompt token's log probability, then the top k), (T, k) int32 ids."""
    return {
        "prompt_logprobs": tensor_from_torch(values),
        "prompt_logprob_token_ids": tensor_from_torch(ids),
    }


def round_columns(
    checked: CheckedFrame, counts: np.ndarray, tokens: np.ndarray, is_eos: np.ndarray
) -> dict[str, array]:
    """A speculative round's lanes: ``counts`` (R,) emitted tokens of ``tokens``
    (R, K + 1), in lane order."""
    kept = np.arange(tokens.shape[1])[None, :] < counts[:, None]  # (R, K + 1)
    last = tokens[np.arange(len(counts)), np.maximum(counts - 1, 0)]
    return {
        "slot": ints(checked.slot),
        "generation": ints(checked.generation),
        "token_count": ints(counts),
        "tokens": ints(tokens[kept]),
        "finished": ints((counts > 0) & is_eos[np.maximum(last, 0)]),
    }


def round_logprob_sidecars(out: RoundOutputs, kept: np.ndarray, k: int) -> dict[str, Tensor]:
    """One row of log probabilities per emitted token (``kept`` (R, K + 1)), in
    lane order: the token's own and the top ``k``."""
    mask = torch.from_numpy(kept)
    values = torch.cat(
        [out.logprob[mask][:, None], out.top_logprobs[mask][:, :k]], dim=1
    )  # (T, 1 + k), T = emitted tokens
    ids = out.top_ids[mask][:, :k].to(torch.int32).contiguous()
    return logprob_sidecars(values.contiguous(), ids)


def frame_completion(
    launch: Launch,
    rank: int,
    world_size: int,
    device_ns: int,
    ended_at: int,
    last_publish_ns: int,
    crc: int,
    columns: dict[str, array],
    sidecars: dict[str, Tensor],
) -> Completion:
    """The completion of a finished launch: its device time, host times and
    stages (the previous frame's publish stage last), the lanes and sidecars."""
    stages = launch.stages
    return Completion(
        fence=launch.checked.frame.fence,
        rank=rank,
        world_size=world_size,
        device_ns=device_ns,
        readiness_delay_ns=0,
        sidecars=sidecars,
        launch_wait_ns=min(launch.launch_wait_ns, device_ns),
        host_times=(*launch.times[:2], ended_at, time.monotonic_ns())
        if len(launch.times) >= 2
        else (),
        stage_ns=(
            stages.get("receive", 0),
            stages.get("validate", 0),
            stages.get("pack", 0),
            stages.get("launch", 0),
            stages["wait"],
            last_publish_ns,
        ),
        token_crc=crc,
        **columns,
    )


def error_completion(fence: int, rank: int, world_size: int, reason: str) -> Completion:
    """A frame this rank refused or failed: the reason, cut to 4,096 characters."""
    return Completion(
        fence=fence,
        rank=rank,
        world_size=world_size,
        device_ns=0,
        error=reason[:4096],
    )
