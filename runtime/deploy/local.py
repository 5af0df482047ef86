"""A whole deployment on one machine: the coordinator engine in this process and
N rank processes, as ``flare run`` and the Python API use it (the API's name for
it is ``runtime.local.LocalDeployment``).  With ``--ranks external`` the ranks
run elsewhere and connect over TCP (runtime/deploy/external.py).

    with LocalDeployment(tensor_parallel_size=2) as deployment:
        stream = deployment.engine.submit(prompt_ids, max_tokens=32)
        print(stream.result(timeout=60).token_ids)
"""

from __future__ import annotations

import logging
import os
import threading
import time

from runtime.coordinator.engine import Engine, EngineConfig
from runtime.deploy.config import DeploymentConfig
from runtime.deploy.external import external_channel
from runtime.deploy.launch import spawn_ranks, stop_ranks
from runtime.identity import expected_identity
from runtime.ranks.model.default import default_model_dir
from runtime.speculation import SpeculationConfig
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.recording import model_digest, write_meta
from runtime.transport.schema import PROTOCOL_VERSION

log = logging.getLogger("runtime.local")

RANK_EXIT_GRACE_S = 1.0  # the engine takes a dying rank's last completion first
RANK_WATCH_S = 0.1  # a rank process that exits stops the serving within this
STOP_RANKS_S = 30.0  # a stop: the ranks end their frame and leave (all in parallel)
# After a failure the ranks were told to shut down at once; one still there this
# long after the failure (at least STOP_FAILED_MIN_S after the stop began) is stuck
# (in a collective with a dead or hung peer) and is killed.
STOP_FAILED_RANKS_S = 2.0
STOP_FAILED_MIN_S = 0.5
START_ABORT_JOIN_S = 5.0  # the start-up waits look at their abort every 0.2 s at most


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
