"""A whole deployment on one machine: the coordinator engine in this process and
N rank processes, as ``flare run`` and the Python API use it.

    with LocalDeployment(tensor_parallel_size=2) as deployment:
        stream = deployment.engine.submit(prompt_ids, max_tokens=32)
        print(stream.result(timeout=60).token_ids)
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

from runtime.cli_deploy import ExternalRanks
from runtime.cli_liveness import heartbeat_rank_args
from runtime.coordinator.config import PolicyConfig
from runtime.coordinator.engine import Engine, EngineConfig
from runtime.coordinator.engine.config import (
    DEFAULT_WATCHDOG_FLOOR_S,
    DEFAULT_WATCHDOG_MARGIN_S,
    DEFAULT_WATCHDOG_MULTIPLE,
)
from runtime.devices import is_device
from runtime.identity import expected_identity
from runtime.launch import spawn_ranks, stop_ranks
from runtime.ranks.capacity import DEFAULT_MAX_CONCURRENCY
from runtime.ranks.memory import DEFAULT_GPU_MEMORY_UTILIZATION
from runtime.ranks.model.default import default_model_dir
from runtime.speculation import SpeculationConfig
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.liveness import DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S, LivenessConfig
from runtime.transport.recording import model_digest, write_meta
from runtime.transport.schema import PROTOCOL_VERSION
from runtime.transport.security import ServerKeys

log = logging.getLogger("runtime.local")

DEFAULT_SPIN_US = 200
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on CUDA, float32 on CPU
RANK_EXIT_GRACE_S = 1.0  # the engine takes a dying rank's last completion first
RANK_WATCH_S = 0.1  # a rank process that exits stops the serving within this
STOP_RANKS_S = 30.0  # a stop: the ranks end their frame and leave (all in parallel)
# After a failure the ranks were told to shut down at once; one still there this
# long after the failure (at least STOP_FAILED_MIN_S after the stop began) is stuck
# (in a collective with a dead or hung peer) and is killed.
STOP_FAILED_RANKS_S = 2.0
STOP_FAILED_MIN_S = 0.5
START_ABORT_JOIN_S = 5.0  # the start-up waits look at their abort every 0.2 s at most


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
    device: str = "auto"  # auto | cpu | cuda | cuda:N (rank r on cuda:N+r; runtime/devices.py)
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cuda_graphs: bool = True
    mixed_prefill: bool = False  # also capture mixed prefill/decode programs
    startup_timeout_s: float = 600.0
    # A rank reports a hung frame after multiple x its expected duration + margin.
    frame_timeout_multiple: float = 20.0
    frame_timeout_margin_s: float = 60.0
    # Liveness (runtime/transport/liveness.py) and the coordinator's per-frame
    # watchdog (EngineConfig.frame_watchdog_*), looser than the ranks' own.
    heartbeat_interval_s: float = DEFAULT_INTERVAL_S
    heartbeat_timeout_s: float = DEFAULT_TIMEOUT_S
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
            *heartbeat_rank_args(self.heartbeat_interval_s, self.heartbeat_timeout_s),
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
        return args


def speculation_settings(speculation: SpeculationConfig | None) -> dict:
    """The engine's (scheduler's) speculation fields for ``speculation``."""
    if speculation is None:
        return {}
    return {
        "fixed_speculative_width": speculation.fixed_width,
        "proposer": speculation.proposer,
        "speculative_token_capacity": speculation.token_capacity,
        "acceptance_prior": speculation.acceptance_prior,
    }


def external_channel(external: ExternalRanks | None) -> dict:
    """The EngineConfig fields that bind TCP for external ranks (none for local ranks)."""
    if external is None:
        return {}
    return {
        "endpoints": ChannelEndpoints(
            frames=external.endpoint(external.frames_port),
            completions=external.endpoint(external.completions_port),
            heartbeat=external.endpoint(external.heartbeat_port),
        ),
        "allow_remote": external.allow_remote,
    }


def transport_settings(cfg: DeploymentConfig) -> dict:
    """The EngineConfig fields of the rank transport (docs/security.md)."""
    security = {"transport_keys": cfg.transport_keys, "insecure_transport": cfg.insecure_transport}
    if cfg.external is not None:
        return security
    if cfg.transport == "tcp":  # without keys the engine makes them (Engine.rank_keys)
        any_port = "tcp://127.0.0.1:0"
        return {"endpoints": ChannelEndpoints(any_port, any_port, any_port), **security}
    return {}


def external_rank_command(endpoints: ChannelEndpoints, config: DeploymentConfig) -> list[str]:
    """The command every node runs for ``--ranks external`` (docs/deploy.md), with
    the rank flags this deployment's catalog expects.  A wildcard bind address is
    shown as HOST: the ranks need an address of this machine they can reach."""
    external = config.external
    assert external is not None

    def reachable(endpoint: str) -> str:
        for wildcard in ("0.0.0.0", "[::]"):
            endpoint = endpoint.replace(f"//{wildcard}:", "//HOST:")
        return endpoint

    return [
        "torchrun", "--nnodes", "NODES", "--node-rank", "NODE_RANK",
        "--nproc-per-node", "RANKS_PER_NODE", "--master-addr", "NODE0_ADDR",
        "--master-port", "29500", "-m", "runtime.ranks",
        "--frames-endpoint", reachable(endpoints.frames),
        "--completions-endpoint", reachable(endpoints.completions),
        "--heartbeat-endpoint", reachable(endpoints.heartbeat),
        *([] if config.insecure_transport else ["--transport-keys", "KEYS_DIR/ranks-K"]),
        *config.rank_args(),
    ]  # fmt: skip


class LocalDeployment:
    def __init__(self, config: DeploymentConfig | None = None, **kwargs) -> None:
        self.config = config or DeploymentConfig(**kwargs)
        cfg = self.config
        self.engine = Engine(
            EngineConfig(
                world_size=cfg.tensor_parallel_size,
                max_slots=cfg.max_concurrency,
                policy=cfg.policy,
                catalog_timeout_s=cfg.startup_timeout_s,
                handshake_timeout_s=(
                    cfg.external.handshake_timeout_s if cfg.external else cfg.startup_timeout_s
                ),
                **external_channel(cfg.external),
                **transport_settings(cfg),
                poll_spin_us=cfg.spin_us,
                external_publication=cfg.external_publication,
                record_dir=cfg.record_frames,
                direct=cfg.direct,
                enable_prefix_caching=cfg.enable_prefix_caching,
                debug_page_accounting=cfg.debug_page_accounting,
                heartbeat_interval_s=cfg.heartbeat_interval_s,
                heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                require_heartbeats=True,  # real ranks heartbeat from their handshake on
                frame_watchdog_multiple=cfg.frame_watchdog_multiple,
                frame_watchdog_margin_s=cfg.frame_watchdog_margin_s,
                frame_watchdog_floor_s=cfg.frame_watchdog_floor_s,
                expected_identity=expected_identity(
                    cfg.model or default_model_dir(),
                    PROTOCOL_VERSION,
                    verify_weights=cfg.verify_weights,
                    # Local ranks run this checkout by construction: a difference
                    # there is a file edited during start-up, only worth a warning.
                    allow_code_mismatch=cfg.allow_code_mismatch or cfg.external is None,
                    unreadable_ok=True,  # the ranks fail on it, naming the file
                ),
                **speculation_settings(cfg.speculation),
            )
        )
        self.ranks: list = []
        self._stopping = threading.Event()

    def start(self) -> LocalDeployment:
        if self.config.record_frames:
            write_meta(self.config.record_frames, self.recording_meta())
        if self.config.external is not None:
            return self._start_external()
        endpoints = self.engine.bind()
        keys = self.engine.rank_keys()  # tcp: CURVE keys, through the environment only
        self.ranks = spawn_ranks(
            endpoints,
            self.config.tensor_parallel_size,
            self.config.rank_args(),
            env=None if keys is None else dict(os.environ, **keys.environment()),
        )
        failure: list[BaseException] = []

        def start_engine() -> None:
            try:
                self.engine.start()
            except BaseException as exc:
                failure.append(exc)

        starter = threading.Thread(target=start_engine, name="flare-start", daemon=True)
        starter.start()
        # Wait for the handshake and catalogs, but fail at once if a rank dies
        # (a bad model directory, out of memory) instead of at the timeout.
        while starter.is_alive():
            starter.join(0.1)
            dead = [(r, p.returncode) for r, p in enumerate(self.ranks) if p.poll() is not None]
            if dead and starter.is_alive():
                rank, code = dead[0]
                reason = f"rank {rank} exited with code {code} during start-up"
                # The start thread owns the channel until it returns: end its wait
                # and let it go before anything closes the channel's sockets.
                self.engine.abort_start(reason)
                starter.join(START_ABORT_JOIN_S)
                stop_ranks(self.ranks, timeout_s=0)
                raise RuntimeError(reason)
        if failure:
            self.stop()
            raise failure[0]
        try:
            self.engine.run_in_thread()
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._watch_ranks, name="flare-rank-watch", daemon=True).start()
        return self

    def _start_external(self) -> LocalDeployment:
        """Bind TCP, say what the ranks must run, wait for them (``--ranks external``).

        No rank is a child of this process: the heartbeats are the only way to
        learn that one is gone (runtime/transport/liveness.py)."""
        external = self.config.external
        assert external is not None
        endpoints = self.engine.bind()
        log.warning(  # an instruction: shown at the default --log-level too
            "waiting up to %.0f s for %d rank(s); start them with:\n  %s",
            external.handshake_timeout_s,
            external.world_size,
            " ".join(external_rank_command(endpoints, self.config)),
        )
        try:
            self.engine.start()
            self.engine.run_in_thread()
        except BaseException:
            self.stop()
            raise
        return self

    def recording_meta(self) -> dict:
        """What a frame recording needs to start the same ranks again."""
        cfg = self.config
        model = cfg.model or str(default_model_dir())
        return {
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "rank_args": cfg.rank_args(),
            "model": os.fspath(model),
            "model_digest": model_digest(model),
            "protocol_version": PROTOCOL_VERSION,
        }

    def _dead_rank(self) -> tuple[int, str] | None:
        """The first rank process that exited, and how (None: all run)."""
        dead = [(r, p.returncode) for r, p in enumerate(self.ranks) if p.poll() is not None]
        if not dead:
            return None
        rank, code = dead[0]
        return rank, f"rank {rank} exited with code {code}"

    def health(self) -> str | None:
        """Why this deployment can serve no more, for good (None: it can, or it was
        stopped): the engine's word (:meth:`Engine.health`), or a rank process that
        exited and that the watcher has not reported yet (any thread)."""
        problem = self.engine.health()
        if problem is None and not self._stopping.is_set() and self.engine.serving:
            dead = self._dead_rank()
            problem = None if dead is None else dead[1]
        return problem

    def _watch_ranks(self) -> None:
        """A rank that exits while serving fails the engine at once: it stops
        serving (/health turns 503) within RANK_WATCH_S, and its requests end with
        an error, instead of frames waiting for a completion that never comes."""
        while not self._stopping.wait(RANK_WATCH_S):
            dead = self._dead_rank()
            if dead is not None:
                rank, reason = dead
                self.engine.mark_failing(reason)
                # A rank that reports why it stops (a hung frame, a failed
                # collective) sends that completion before exiting: give the
                # engine a moment to take it, so its reason is the one kept.
                if not self._stopping.wait(RANK_EXIT_GRACE_S):
                    self.engine.rank_gone(rank, reason)
                return

    def stop(self) -> list[int | None]:
        """Stop the engine (the ranks are told to shut down) and wait for the ranks,
        all against one deadline: STOP_RANKS_S, or STOP_FAILED_RANKS_S after the
        engine's failure (a rank still there is stuck); those left are killed
        together."""
        self._stopping.set()
        try:
            self.engine.stop()
        finally:
            timeout = STOP_RANKS_S
            failed_at = self.engine.failed_at
            if failed_at is not None:
                left = failed_at + STOP_FAILED_RANKS_S - time.monotonic()
                timeout = max(STOP_FAILED_MIN_S, left)
            codes = stop_ranks(self.ranks, timeout_s=timeout)
        return codes

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
