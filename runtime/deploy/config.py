"""What a deployment is: :class:`DeploymentConfig`, one frozen value that says
which model runs on how many ranks, where, with which limits, and the rank
command-line flags it implies (:meth:`DeploymentConfig.rank_args`).  ``flare run``
builds one from its flags (runtime/cli/commands/run.py); the Python API builds
one directly (``LocalDeployment(tensor_parallel_size=2)``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from runtime.coordinator.config import PolicyConfig
from runtime.coordinator.engine.config import (
    DEFAULT_WATCHDOG_FLOOR_S,
    DEFAULT_WATCHDOG_MARGIN_S,
    DEFAULT_WATCHDOG_MULTIPLE,
)
from runtime.deploy.devices import is_device
from runtime.deploy.external import ExternalRanks
from runtime.ranks.capacity import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_VISION_IMAGES,
    DEFAULT_VISION_WINDOWS,
    CapacityConfig,
    CapacityError,
)
from runtime.ranks.memory import DEFAULT_GPU_MEMORY_UTILIZATION
from runtime.speculation import SpeculationConfig
from runtime.transport.liveness import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S, LivenessConfig
from runtime.transport.security import ServerKeys

DEFAULT_SPIN_US = 200
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on CUDA, float32 on CPU


def spin_budget_us(local_ranks: int) -> int:
    """Busy-poll budget for a coordinator and ``local_ranks`` ranks on this machine.

    Spinning turns each ZeroMQ hop's wake-up (tens of microseconds) into a
    few microseconds, but holds a core.  CPU ranks split all cores but one
    among themselves and leave that one to the coordinator, so spinning pays
    when every process has a core of its own; otherwise (two CPU ranks on two
    cores) it would steal time from the ranks' collectives, and it is off.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return DEFAULT_SPIN_US if (cores or 1) >= local_ranks + 1 else 0


@dataclass(frozen=True)
class DeploymentConfig:
    model: str | None = None  # None: the embedded default model
    tensor_parallel_size: int = 1
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_prefill_tokens: int = 512
    page_size: int = 16
    # The KV pool per rank (runtime/ranks/memory.py): num_pages when given, else
    # as many pages as kv_cache_memory_bytes hold, else on CPU 512 MiB's worth,
    # on CUDA what gpu_memory_utilization of the device leaves (measured).
    num_pages: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    device: str = "auto"  # auto | cpu | cuda | cuda:N (rank r on cuda:N+r; deploy/devices.py)
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cuda_graphs: bool = True
    mixed_prefill: bool = False  # also capture mixed prefill/decode programs
    packed_prefill: bool = True  # capture packed prefill programs (capacity.packed_prefill_shapes)
    # Capture scored prefill programs (prompt log probabilities; the prefill
    # shapes again, capacity.scored_prefill_shapes; docs/scored-prefill.md).
    scored_prefill: bool = True
    startup_timeout_s: float = 600.0
    # A rank reports a hung frame after multiple x its expected duration + margin.
    frame_timeout_multiple: float = 20.0
    frame_timeout_margin_s: float = 60.0
    # Liveness (runtime/transport/liveness.py) and the coordinator's per-frame
    # watchdog (EngineConfig.frame_watchdog_*), looser than the ranks' own.
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    frame_watchdog_multiple: float = DEFAULT_WATCHDOG_MULTIPLE
    frame_watchdog_margin_s: float = DEFAULT_WATCHDOG_MARGIN_S
    frame_watchdog_floor_s: float = DEFAULT_WATCHDOG_FLOOR_S
    check_ranks: bool = False  # every rank reports a CRC of its sampled tokens; mismatch fails
    log_level: str = "warning"  # the ranks' log level (flare run --log-level)
    log_dir: str | None = None  # also one log file per rank there
    record_frames: str | None = None  # record every frame from start-up there (flare replay)
    profile_dir: str | None = None  # Control("profile") traces there (POST /debug/profile)
    poll_spin_us: int | None = None  # None: spin_budget_us(tensor_parallel_size)
    external_publication: bool = False  # a frontend reports publications
    direct: bool = False  # the diagnostic direct-mode scheduler (runtime/direct)
    speculation: SpeculationConfig | None = None  # speculative decoding (runtime/speculation.py)
    enable_prefix_caching: bool = True  # share KV pages of equal prompt prefixes (salted)
    debug_page_accounting: bool = False  # check KV page accounting after every completion
    # flare run --ranks external: ranks started elsewhere connect over TCP (docs/deploy.md).
    external: ExternalRanks | None = None
    # Start-up agreement (runtime/identity.py): also hash every weight byte; a rank
    # running other code than the coordinator only warns.
    verify_weights: bool = False
    allow_code_mismatch: bool = False
    # The rank transport (runtime/transport/security.py, docs/security.md): local
    # ranks over "ipc" (sockets in a 0700 directory) or "tcp" (loopback, CURVE
    # keys made for this run and handed to the ranks in their environment);
    # external ranks need the coordinator's keys (`flare keys`) or, explicitly,
    # insecure_transport.
    transport: str = "ipc"
    transport_keys: ServerKeys | None = None
    insecure_transport: bool = False
    # A vision model's feature store and vision programs (the ranks' CapacityConfig;
    # text-only models ignore them, docs/vision.md "Rank programs"): windows, feature
    # rows per window (0: four images' tokens), the most images one vision frame encodes.
    vision_windows: int = DEFAULT_VISION_WINDOWS
    vision_window_rows: int = 0
    max_vision_images: int = DEFAULT_MAX_VISION_IMAGES

    def __post_init__(self) -> None:
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(
                f"tensor_parallel_size must be in 1..64, got {self.tensor_parallel_size}"
            )
        if not is_device(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(
                f"log_level must be debug, info, warning or error, got {self.log_level!r}"
            )
        for name in (
            "mixed_prefill",
            "packed_prefill",
            "scored_prefill",
            "enable_prefix_caching",
            "debug_page_accounting",
            "verify_weights",
            "allow_code_mismatch",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("num_pages", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        utilization = self.gpu_memory_utilization
        if not (isinstance(utilization, (int, float)) and 0 < utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {utilization!r}")
        LivenessConfig(self.heartbeat_interval_s, self.heartbeat_timeout_s)  # validates
        for name in (
            "frame_timeout_multiple",
            "frame_timeout_margin_s",
            "frame_watchdog_multiple",
            "frame_watchdog_margin_s",
            "frame_watchdog_floor_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.speculation is not None:
            if not isinstance(self.speculation, SpeculationConfig):
                raise ValueError(
                    f"speculation must be a SpeculationConfig, got {self.speculation!r}"
                )
            if self.direct:
                raise ValueError("direct mode schedules no speculative rounds: drop speculation")
        if self.external is not None:
            if not isinstance(self.external, ExternalRanks):
                raise ValueError(f"external must be ExternalRanks or None, got {self.external!r}")
            if self.external.world_size != self.tensor_parallel_size:
                raise ValueError(
                    f"external.world_size {self.external.world_size} must equal "
                    f"tensor_parallel_size {self.tensor_parallel_size}"
                )
        spin = self.poll_spin_us
        if spin is not None and (not isinstance(spin, int) or not 0 <= spin <= 100_000):
            raise ValueError(f"poll_spin_us must be None or in 0..100000, got {spin!r}")
        self._check_transport()
        self.vision_capacity()  # validates the vision fields

    def vision_capacity(self) -> CapacityConfig:
        """The ranks' vision capacity (the other CapacityConfig fields at their
        defaults); ValueError naming the DeploymentConfig field."""
        try:
            return CapacityConfig(
                vision_windows=self.vision_windows,
                window_rows=self.vision_window_rows,
                max_vision_images=self.max_vision_images,
            )
        except CapacityError as exc:
            text = str(exc)
            if text.startswith("window_rows"):
                text = "vision_" + text
            raise ValueError(text) from None

    def _check_transport(self) -> None:
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be ipc or tcp, got {self.transport!r}")
        keys = self.transport_keys
        if keys is not None and not isinstance(keys, ServerKeys):
            raise ValueError(f"transport_keys must be ServerKeys or None, got {type(keys)}")
        if not isinstance(self.insecure_transport, bool):
            raise ValueError(f"insecure_transport must be a bool, got {self.insecure_transport!r}")
        if self.external is None:
            if keys is not None:
                raise ValueError(
                    "transport_keys apply to external ranks: local ranks use ipc, or tcp "
                    "with keys made for the run"
                )
            if self.insecure_transport and self.transport != "tcp":
                raise ValueError("insecure_transport applies to tcp (local or external ranks)")
            return
        if self.transport != "ipc":
            raise ValueError("transport applies to local ranks: external ranks always use tcp")
        if (keys is None) == (not self.insecure_transport):
            raise ValueError(
                "external ranks need transport_keys (written by `flare keys`) or, to run "
                "without authentication, insecure_transport=True (exactly one of them)"
            )

    @property
    def spin_us(self) -> int:
        """The busy-poll budget of the coordinator and the ranks (see ``spin_budget_us``)."""
        if self.poll_spin_us is not None:
            return self.poll_spin_us
        return spin_budget_us(self.tensor_parallel_size)

    def rank_args(self) -> list[str]:
        args = [
            "--max-concurrency", str(self.max_concurrency),
            "--max-prefill-tokens", str(self.max_prefill_tokens),
            "--page-size", str(self.page_size),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--device", self.device,
            "--poll-spin-us", str(self.spin_us),
            "--frame-timeout-multiple", str(self.frame_timeout_multiple),
            "--frame-timeout-margin", str(self.frame_timeout_margin_s),
            "--heartbeat-interval", repr(self.heartbeat_interval_s),
            "--heartbeat-timeout", repr(self.heartbeat_timeout_s),
        ]  # fmt: skip
        if self.num_pages is not None:
            args += ["--num-pages", str(self.num_pages)]
        if self.kv_cache_memory_bytes is not None:
            args += ["--kv-cache-memory", str(self.kv_cache_memory_bytes)]
        if self.model:
            args += ["--model", os.fspath(self.model)]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.dtype != "auto":
            args += ["--dtype", self.dtype]
        if not self.cuda_graphs:
            args.append("--no-cuda-graphs")
        if self.mixed_prefill:
            args.append("--mixed-prefill")
        if self.packed_prefill:
            args.append("--packed-prefill")
        if self.scored_prefill:
            args.append("--scored-prefill")
        if self.check_ranks:
            args.append("--check-ranks")
        if self.verify_weights:
            args.append("--verify-weights")
        if self.insecure_transport:
            args.append("--insecure-transport")
        args += ["--log-level", self.log_level]
        if self.log_dir:
            args += ["--log-dir", os.fspath(self.log_dir)]
        if self.profile_dir:
            args += ["--profile-dir", os.path.abspath(self.profile_dir)]
        if self.speculation is not None:
            args += self.speculation.rank_args()
        args += [
            "--vision-windows", str(self.vision_windows),
            "--vision-window-rows", str(self.vision_window_rows),
            "--max-vision-images", str(self.max_vision_images),
        ]  # fmt: skip
        return args
