"""Engine configuration and errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.coordinator.config import ConfigError, PolicyConfig
from runtime.identity import ExpectedIdentity
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.fields import MAX_WORLD_SIZE
from runtime.transport.frame_lane import MAX_SLOTS
from runtime.transport.liveness import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S
from runtime.transport.security import ServerKeys

# The coordinator's per-frame watchdog (EngineConfig.frame_watchdog_*): looser
# than the ranks' own --frame-timeout-multiple 20 / --frame-timeout-margin 60.
DEFAULT_WATCHDOG_MULTIPLE = 25.0
DEFAULT_WATCHDOG_MARGIN_S = 75.0
DEFAULT_WATCHDOG_FLOOR_S = 120.0


def frame_watchdog_ns(
    expected_ns: int, multiple: float, margin_s: float, floor_s: float, known: bool | None = None
) -> int:
    """How long the coordinator waits for every rank's completion of a frame:
    ``multiple`` x its expected duration + ``margin_s``, or, for a frame whose
    cost is still unknown (``known`` False; by default: ``expected_ns`` 0),
    ``max(floor_s, margin_s)``.  An empty frame's cost is known (nothing runs)."""
    if known is None:
        known = expected_ns > 0
    if not known:
        return round(max(floor_s, margin_s) * 1e9)
    return round(multiple * expected_ns + margin_s * 1e9)


class EngineError(RuntimeError):
    """The engine cannot do what was asked, or has failed."""


class EngineStartError(EngineError):
    """Start-up failed: handshake, catalog collection or catalog agreement."""


def _positive_seconds(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def _tcp_address(name: str, endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port)."""
    rest = endpoint[len("tcp://") :]
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError(f"endpoints.{name} must be tcp://HOST:PORT, got {endpoint!r}")
    port = int(port_text)
    if port > 65535:
        raise ConfigError(f"endpoints.{name} port must lie in [0, 65535], got {port}")
    return host.strip("[]"), port


@dataclass(frozen=True)
class EngineConfig:
    """How the coordinator engine binds, waits and schedules.

    * ``world_size``: ranks that must answer the handshake and report a catalog.
    * ``endpoints``: ``None`` binds ``ipc://`` sockets in a private run directory
      (under ``run_dir`` or the system temp dir); ``tcp://HOST:PORT`` endpoints
      (both on the same host, port 0 = any free port) bind TCP, loopback only
      unless ``allow_remote``.  Ranks connect to :attr:`Engine.endpoints`.
    * ``max_slots``: resident request slots (<= 64).  ``None``: the largest
      decode batch capacity in the ranks' catalog.  It must not exceed the number
      of slots each rank keeps.
    * ``policy``: the scheduler's policy preferences.
    * ``handshake_timeout_s``, ``catalog_timeout_s``: start-up limits (a rank
      captures its programs before reporting, so the catalog wait is long).
    * ``completion_timeout_s``: an absolute cap on how long a frame may go
      unanswered (``None``: only the frame watchdog applies).
    * ``frame_watchdog_multiple``, ``frame_watchdog_margin_s``,
      ``frame_watchdog_floor_s``: the per-frame watchdog (see
      :func:`frame_watchdog_ns`): the head frame fails the engine, naming the
      ranks that did not answer and its fence, once unanswered for ``multiple``
      x its expected duration + ``margin``, or, when its cost is still unknown,
      ``max(floor, margin)``; looser than the ranks' own ``--frame-timeout-*``
      (20 x + 60 s), so a hung rank's own report, which says where it is
      stuck, normally arrives first.
    * ``heartbeat_interval_s``, ``heartbeat_timeout_s``: liveness
      (:mod:`runtime.transport.liveness`): a heartbeat to every rank every
      interval; a rank silent for the timeout past the later of its last
      heartbeat and the head frame's expected end fails the engine, naming the
      rank and the fences in flight (``heartbeat_timeout_s=None``: heartbeats
      are sent but no rank is ever declared gone).  ``require_heartbeats``:
      every rank is watched from start-up on (real ranks always heartbeat);
      otherwise a rank is watched from its first heartbeat (test ranks that
      never send one are left to the frame watchdog).
    * ``shutdown_grace_s``: time given to the shutdown message to leave before
      the sockets close.
    * ``frame_stats``: per-frame timing records kept (oldest dropped).
    * ``poll_spin_us``: how long the engine busy-polls for a completion around
      the head frame's expected end (it sleeps in ``zmq_poll`` until then).
      Waking a sleeping thread costs tens of microseconds per hop; spinning
      costs a core.  0 never spins (right when the ranks need every core).
    * ``external_publication``: a frontend reports when output became visible
      (``Engine.publish``); otherwise the engine publishes every committed
      token the moment it is applied.
    * ``direct``: schedule with the diagnostic direct-mode scheduler
      (:mod:`runtime.direct`, ``flare run --direct``) instead of the
      coordinator's: it shares no selection code, so a fault that persists
      under it lies in the ranks, not in the scheduler.
    * ``fixed_speculative_width``, ``proposer``, ``speculative_token_capacity``:
      the scheduler's speculation settings (:class:`SchedulerConfig`); the
      ranks' catalog says which speculative programs exist.
    * ``expected_identity``: what the coordinator computed of its own model
      directory and code (:mod:`runtime.identity`); start-up fails naming "the
      coordinator" when a rank reports another model, code or protocol version.
      ``None``: the ranks are compared with each other only.
    """

    world_size: int = 1
    endpoints: ChannelEndpoints | None = None
    max_slots: int | None = None
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    handshake_timeout_s: float = 60.0
    catalog_timeout_s: float = 600.0
    completion_timeout_s: float | None = None
    frame_watchdog_multiple: float = DEFAULT_WATCHDOG_MULTIPLE
    frame_watchdog_margin_s: float = DEFAULT_WATCHDOG_MARGIN_S
    frame_watchdog_floor_s: float = DEFAULT_WATCHDOG_FLOOR_S
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float | None = HEARTBEAT_TIMEOUT_S
    require_heartbeats: bool = False
    shutdown_grace_s: float = 0.05
    run_dir: str | None = None
    record_dir: str | None = None  # record frames and rank 0's answers there (flare replay)
    allow_remote: bool = False
    frame_stats: int = 100_000
    poll_spin_us: int = 0
    external_publication: bool = False
    direct: bool = False
    fixed_speculative_width: int = 0
    proposer: str = "draft"
    speculative_token_capacity: int = 0
    acceptance_prior: tuple[float, ...] = ()  # preseeds the proposer's population prior
    enable_prefix_caching: bool = True  # SchedulerConfig.enable_prefix_caching
    debug_page_accounting: bool = False  # check page accounting after every completion
    expected_identity: ExpectedIdentity | None = None  # the start-up agreement's coordinator side
    # CURVE (runtime/transport/security.py): the coordinator's keys; None over
    # tcp: the engine creates keys for this run (Engine.rank_keys) unless
    # insecure_transport, which binds TCP without authentication.
    transport_keys: ServerKeys | None = None
    insecure_transport: bool = False

    def __post_init__(self) -> None:
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or not 1 <= ws <= MAX_WORLD_SIZE:
            raise ConfigError(f"world_size must be an integer in [1, {MAX_WORLD_SIZE}], got {ws!r}")
        if self.endpoints is not None:
            if not isinstance(self.endpoints, ChannelEndpoints):
                raise ConfigError(
                    f"endpoints must be a ChannelEndpoints or None, got {self.endpoints!r}"
                )
            self.channel_kwargs()  # validates
        slots = self.max_slots
        if slots is not None and (
            isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS
        ):
            raise ConfigError(
                f"max_slots must be None or an integer in [1, {MAX_SLOTS}], got {slots!r}"
            )
        if not isinstance(self.policy, PolicyConfig):
            raise ConfigError(f"policy must be a PolicyConfig, got {self.policy!r}")
        _positive_seconds("handshake_timeout_s", self.handshake_timeout_s)
        _positive_seconds("catalog_timeout_s", self.catalog_timeout_s)
        _positive_seconds("completion_timeout_s", self.completion_timeout_s, allow_none=True)
        multiple = self.frame_watchdog_multiple
        if (
            isinstance(multiple, bool)
            or not isinstance(multiple, (int, float))
            or not (math.isfinite(multiple) and multiple > 0)
        ):
            raise ConfigError(
                f"frame_watchdog_multiple must be a finite number > 0, got {multiple!r}"
            )
        _positive_seconds("frame_watchdog_margin_s", self.frame_watchdog_margin_s)
        _positive_seconds("frame_watchdog_floor_s", self.frame_watchdog_floor_s)
        _positive_seconds("heartbeat_interval_s", self.heartbeat_interval_s)
        _positive_seconds("heartbeat_timeout_s", self.heartbeat_timeout_s, allow_none=True)
        if (
            self.heartbeat_timeout_s is not None
            and self.heartbeat_timeout_s <= self.heartbeat_interval_s
        ):
            raise ConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s:g})"
            )
        if not isinstance(self.require_heartbeats, bool):
            raise ConfigError(f"require_heartbeats must be a bool, got {self.require_heartbeats!r}")
        grace = self.shutdown_grace_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < 60:
            raise ConfigError(f"shutdown_grace_s must be a number in [0, 60), got {grace!r}")
        if self.run_dir is not None and not isinstance(self.run_dir, str):
            raise ConfigError(f"run_dir must be a path string or None, got {self.run_dir!r}")
        if not isinstance(self.allow_remote, bool):
            raise ConfigError(f"allow_remote must be a bool, got {self.allow_remote!r}")
        spin = self.poll_spin_us
        if isinstance(spin, bool) or not isinstance(spin, int) or not 0 <= spin <= 100_000:
            raise ConfigError(f"poll_spin_us must be an integer in [0, 100000], got {spin!r}")
        if not isinstance(self.external_publication, bool):
            raise ConfigError(
                f"external_publication must be a bool, got {self.external_publication!r}"
            )
        if not isinstance(self.direct, bool):
            raise ConfigError(f"direct must be a bool, got {self.direct!r}")
        expected = self.expected_identity
        if expected is not None and not isinstance(expected, ExpectedIdentity):
            raise ConfigError(
                f"expected_identity must be an ExpectedIdentity or None, got {expected!r}"
            )
        if self.transport_keys is not None and not isinstance(self.transport_keys, ServerKeys):
            raise ConfigError(
                f"transport_keys must be ServerKeys or None, got {type(self.transport_keys)}"
            )
        if not isinstance(self.insecure_transport, bool):
            raise ConfigError(f"insecure_transport must be a bool, got {self.insecure_transport!r}")
        if self.insecure_transport and self.transport_keys is not None:
            raise ConfigError("insecure_transport contradicts transport_keys: give one")
        n = self.frame_stats
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"frame_stats must be a non-negative integer, got {n!r}")

    def channel_kwargs(self) -> dict[str, object]:
        """Keyword arguments of :class:`CoordinatorChannel` for these endpoints."""
        if self.endpoints is None:
            return {
                "transport": "ipc",
                "run_dir": self.run_dir,
                "record_dir": self.record_dir,
                "keys": self.transport_keys,
                "heartbeat": True,
            }
        frames, completions = self.endpoints.frames, self.endpoints.completions
        if not (frames.startswith("tcp://") and completions.startswith("tcp://")):
            raise ConfigError(
                "endpoints: ipc endpoints are created by the coordinator in a private run "
                "directory; pass endpoints=None (and optionally run_dir) or two tcp:// endpoints, "
                f"got {self.endpoints!r}"
            )
        frame_host, frame_port = _tcp_address("frames", frames)
        completion_host, completion_port = _tcp_address("completions", completions)
        if frame_host != completion_host:
            raise ConfigError(
                f"endpoints: frames and completions must share one host, "
                f"got {frame_host!r} and {completion_host!r}"
            )
        heartbeat_port = 0  # none named: any free port
        if self.endpoints.heartbeat:
            heartbeat_host, heartbeat_port = _tcp_address("heartbeat", self.endpoints.heartbeat)
            if heartbeat_host != frame_host:
                raise ConfigError(
                    f"endpoints: heartbeat must share the frames' host {frame_host!r}, "
                    f"got {heartbeat_host!r}"
                )
        return {
            "transport": "tcp",
            "host": frame_host,
            "frame_port": frame_port,
            "completion_port": completion_port,
            "heartbeat_port": heartbeat_port,
            "heartbeat": True,
            "allow_remote": self.allow_remote,
            "record_dir": self.record_dir,
            "keys": self.transport_keys,
        }
