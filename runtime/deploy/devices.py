"""``--device``: where the ranks run, checked before any process starts.

``auto`` (CUDA when this machine has it, else CPU), ``cpu``, ``cuda`` (rank r
on ``cuda:r``) or ``cuda:N`` (rank r on ``cuda:N+r``: the ranks of one machine
take consecutive devices from N).  :func:`device_problem` says, in one line
naming the flag, why a setting cannot run here (a CPU build of torch, no
visible device, fewer devices than ranks); ``flare run``, the coordinator
process and every rank (``python -m runtime.ranks``) refuse with it instead
of failing inside torch with a traceback.
"""

from __future__ import annotations

import os
import re

_CUDA = re.compile(r"cuda(?::(\d+))?")


def is_device(text: object) -> bool:
    """Whether ``text`` is a ``--device`` value (lower case, no spaces)."""
    return isinstance(text, str) and (text in ("auto", "cpu") or bool(_CUDA.fullmatch(text)))


def first_cuda_index(device: str) -> int:
    """The device of rank 0 on a machine: N of ``cuda:N``, else 0."""
    match = _CUDA.fullmatch(device)
    return int(match.group(1)) if match and match.group(1) else 0


def wants_cuda(device: str) -> bool:
    """``cuda`` or ``cuda:N`` (``auto`` depends on the machine: :func:`uses_cuda`)."""
    return bool(_CUDA.fullmatch(device))


def uses_cuda(device: str) -> bool:
    """Whether the ranks will run on CUDA (``auto``: when this machine has it)."""
    if device != "auto":
        return wants_cuda(device)
    import torch

    return torch.cuda.is_available()


def _visible() -> str:
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if shown is None else f", CUDA_VISIBLE_DEVICES={shown!r}"


def _devices(count: int) -> str:
    return f"{count} CUDA device{'s' if count != 1 else ''} visible{_visible()}"


def cuda_missing(device: str) -> str | None:
    """Why CUDA cannot run at all here (None: it can), naming ``--device``."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (
            f"--device {device}: this torch build has no CUDA support (torch "
            f"{torch.__version__}); use --device cpu, or install a CUDA build of torch"
        )
    if not torch.cuda.is_available():
        return (
            f"--device {device}: no CUDA device is visible (torch {torch.__version__}, built "
            f"for CUDA {torch.version.cuda}{_visible()}); check the driver (nvidia-smi), or "
            "use --device cpu"
        )
    return None


def _cuda_devices(device: str) -> int | str | None:
    """The visible CUDA device count when ``device`` runs on CUDA; None when it runs
    on the CPU; why CUDA cannot run at all (a line naming the flag) otherwise."""
    if device == "cpu" or (device == "auto" and not uses_cuda(device)):
        return None
    if device != "auto":
        missing = cuda_missing(device)
        if missing is not None:
            return missing
    import torch

    return torch.cuda.device_count()


def device_problem(device: str, ranks: int) -> str | None:
    """Why ``ranks`` ranks on this machine cannot run on ``device`` (one line naming
    the flags), or None.  ``auto`` on a machine without CUDA is the CPU: no problem."""
    count = _cuda_devices(device)
    if isinstance(count, str) or count is None:
        return count
    first = first_cuda_index(device)
    if first + ranks <= count:
        return None
    if device != "auto" and first >= count:
        return f"--device {device}: no such device ({_devices(count)}: cuda:0..cuda:{count - 1})"
    if ranks > count:
        picked = " (--device auto picks CUDA here)" if device == "auto" else ""
        return (
            f"--tensor-parallel-size {ranks}: one rank per CUDA device needs {ranks} devices, "
            f"this machine has {_devices(count)}{picked}; lower --tensor-parallel-size, or use "
            "--device cpu"
        )
    return (
        f"--device {device}: {ranks} ranks (--tensor-parallel-size {ranks}) take cuda:{first}.."
        f"cuda:{first + ranks - 1}, past the {_devices(count)}; start from a lower device"
    )


def rank_device_problem(device: str, local_rank: int) -> str | None:
    """Why this rank (``LOCAL_RANK`` ``local_rank``) cannot run on ``device``, or None:
    the rank entry point's check (it may run under torchrun, without ``flare run``)."""
    count = _cuda_devices(device)
    if isinstance(count, str) or count is None:
        return count
    index = first_cuda_index(device) + local_rank
    if index < count:
        return None
    return (
        f"--device {device}: LOCAL_RANK {local_rank} would run on cuda:{index}, but this "
        f"machine has {_devices(count)}; start at most {max(count - first_cuda_index(device), 0)} "
        "ranks per machine (torchrun --nproc-per-node)"
    )
