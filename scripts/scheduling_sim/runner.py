"""One simulated run: a catalog, a scheduler by name, a workload, a cost profile.

Shared by the command line (``python -m scripts.scheduling_sim``) and the
benchmark (``scripts/bench_schedulers.py``), so both build catalogs and
schedulers the same way.

* The catalog mirrors what the ranks capture (``runtime/ranks/capacity.py``):
  prefill buckets, power-of-two decode batches through the padded slot count,
  and with ``mixed_prefill`` the joint mixed catalog of ``mixed_shapes``.
* ``flare`` is the production :class:`~runtime.coordinator.Scheduler`; every
  other name is a baseline of :mod:`scripts.scheduling_sim.baselines` over the
  same catalog and slot count.
* Speculation: ``speculative_widths`` adds rectangular ``SPECULATIVE`` shapes
  (D = W - 1) at every decode batch; ``proposer`` picks the proposal source
  (``copy``: the shapes cost no draft passes, :func:`~.catalogs.profile_for`,
  and flare tracks copy acceptance); ``fixed_speculative_width`` is flare's
  ``SchedulerConfig.fixed_speculative_width`` (0 adaptive) and the width of the
  ``fixed-width`` baseline.
* Vision (flare only): ``vision`` is the scheduler's feature storage; the
  catalog adds :func:`vision_shapes`; requests with images come from
  :func:`~.workload.vision_chat` (not part of the benchmark suite).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PolicyConfig, SchedulerConfig
from runtime.coordinator.scheduler import Scheduler
from runtime.image_spans import VisionStorage
from runtime.ranks.capacity import padded_concurrency
from scripts.scheduling_sim.baselines import (
    BASELINE_NAMES,
    SPECULATIVE_BASELINE_NAMES,
    make_baseline,
)
from scripts.scheduling_sim.catalogs import PROFILES, PROPOSERS, build_catalog, profile_for
from scripts.scheduling_sim.engine import Simulation
from scripts.scheduling_sim.metrics import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS, summarize
from scripts.scheduling_sim.workload import Arrival

SCHEDULERS = ("flare", *BASELINE_NAMES)
# Baselines that speculate (they need speculative widths in the catalog to).
SPECULATIVE_SCHEDULERS = SPECULATIVE_BASELINE_NAMES
PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)


def decode_batches_for(max_slots: int) -> tuple[int, ...]:
    """Power-of-two decode batches through the padded slot count (as the ranks capture)."""
    top = padded_concurrency(max_slots)
    return tuple(1 << i for i in range(top.bit_length()))


@dataclass(frozen=True)
class RunConfig:
    scheduler: str = "flare"
    profile: str = "llama1b-h100"
    policy: str = "balanced"
    mixed_prefill: bool = False
    packed_prefill: bool = True  # flare: packed prefill programs in its catalog
    max_slots: int = 64
    prefill_buckets: tuple[int, ...] = PREFILL_BUCKETS
    decode_batches: tuple[int, ...] | None = None  # None: through the padded slot count
    max_num_batched_tokens: int | None = None  # baselines: None is each one's default
    enable_mixed_chunk: bool = False  # sglang
    ttft_slo_ms: float = DEFAULT_TTFT_SLO_MS
    tpot_slo_ms: float = DEFAULT_TPOT_SLO_MS
    tp: int = 1
    jitter: float = 0.0
    seed: int = 0
    max_seconds: float = 600.0
    # flare only: every graph's cost observed once at t = 0, as if a warm-up run
    # had measured the catalog (a reference; the goals use the cold start).
    warm: bool = False
    speculative_widths: tuple[int, ...] = ()  # W of the SPECULATIVE shapes (D = W - 1)
    proposer: str = "draft"  # "draft" or "copy"
    fixed_speculative_width: int = 0  # flare: 0 adaptive; fixed-width baseline: its W
    # flare only: the image-feature storage (docs/vision.md, "Scheduling"); the
    # catalog then adds VISION shapes through ``max_vision_images`` and the
    # snapshot and restore programs window transitions need.
    vision: VisionStorage | None = None
    max_vision_images: int = 4

    def __post_init__(self) -> None:
        known = (*SCHEDULERS, *SPECULATIVE_SCHEDULERS)
        if self.scheduler not in known:
            raise ValueError(f"scheduler must be one of {list(known)}, got {self.scheduler!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {self.profile!r}")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {list(PROPOSERS)}, got {self.proposer!r}")
        object.__setattr__(self, "speculative_widths", tuple(self.speculative_widths))
        bad = [w for w in self.speculative_widths if isinstance(w, bool) or not isinstance(w, int)]
        if bad or any(w < 1 for w in self.speculative_widths):
            raise ValueError(
                f"speculative_widths must be integers >= 1, got {self.speculative_widths}"
            )
        width = self.fixed_speculative_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise ValueError(f"fixed_speculative_width must be an integer >= 0, got {width!r}")
        if self.scheduler == "fixed-width" and width < 1:
            raise ValueError("the fixed-width baseline needs fixed_speculative_width >= 1")
        if self.vision is not None and self.scheduler != "flare":
            raise ValueError(f"vision applies to flare, not {self.scheduler}")
        if width and self.scheduler not in ("flare", "fixed-width"):
            raise ValueError(
                f"fixed_speculative_width applies to flare and fixed-width, not {self.scheduler}"
            )

    def catalog(self) -> list[GraphDescriptor]:
        batches = self.decode_batches or decode_batches_for(self.max_slots)
        catalog = build_catalog(
            self.prefill_buckets,
            batches,
            speculative_widths=self.speculative_widths,
            mixed=self.mixed_prefill,
            packed=self.packed_prefill and self.scheduler == "flare",
        )
        if self.vision is not None:
            catalog += vision_shapes(self.max_vision_images)
        return catalog

    def duration_ns(self, desc: GraphDescriptor) -> int:
        """The cost of ``desc`` under ``profile`` for ``proposer``."""
        return profile_for(self.profile, self.proposer).duration_ns(desc)


def vision_shapes(max_images: int) -> list[GraphDescriptor]:
    """VISION programs at every power of two through ``max_images`` (as the
    ranks capture them), and one snapshot and one restore program (window
    transitions; every request then retires through a terminal snapshot).
    Their costs are the profile's floor: the encoder is not modelled."""
    out = [GraphDescriptor(GraphKind.VISION, 1 << i) for i in range(max_images.bit_length())]
    return [*out, GraphDescriptor(GraphKind.SNAPSHOT, 1), GraphDescriptor(GraphKind.RESTORE, 1)]


def make_scheduler(cfg: RunConfig, catalog: Sequence[GraphDescriptor]):
    if cfg.scheduler == "flare":
        return Scheduler(
            list(catalog),
            SchedulerConfig(
                max_slots=cfg.max_slots,
                fixed_speculative_width=cfg.fixed_speculative_width,
                proposer=cfg.proposer,
                vision=cfg.vision,
            ),
            PolicyConfig.preset(cfg.policy),
        )
    return make_baseline(
        cfg.scheduler,
        list(catalog),
        max_slots=cfg.max_slots,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_mixed_chunk=cfg.enable_mixed_chunk,
        speculative_width=cfg.fixed_speculative_width,
    )


def simulate(
    cfg: RunConfig, arrivals: list[Arrival], wrap: Callable[[Any], Any] | None = None
) -> tuple[dict, Simulation]:
    """Run ``arrivals`` under ``cfg``; the summary (see metrics.summarize) and the simulation.

    ``wrap``: the simulation drives ``wrap(scheduler)`` (an observer that
    delegates to the scheduler, as ``explain`` uses).
    """
    catalog = cfg.catalog()
    scheduler = make_scheduler(cfg, catalog)
    duration_ns = profile_for(cfg.profile, cfg.proposer).duration_ns
    if cfg.warm:
        if cfg.scheduler != "flare":
            raise ValueError("warm applies to flare: the baselines keep no cost estimates")
        for desc in catalog:
            scheduler.catalog.observe(desc, duration_ns(desc), 0)
    sim = Simulation(
        scheduler if wrap is None else wrap(scheduler),
        duration_ns,
        arrivals,
        tp=cfg.tp,
        jitter=cfg.jitter,
        seed=cfg.seed,
        catalog=catalog,
    )
    sim.run(until_ns=int(cfg.max_seconds * 1e9))
    report = summarize(
        sim,
        ttft_slo_ms=cfg.ttft_slo_ms,
        tpot_slo_ms=cfg.tpot_slo_ms,
        speculation=True if cfg.speculative_widths else None,
    )
    report.update(
        scheduler=cfg.scheduler,
        policy=cfg.policy,
        profile=cfg.profile,
        mixed_prefill=cfg.mixed_prefill,
        seed=cfg.seed,
    )
    if cfg.speculative_widths:
        report.update(
            speculative_widths=list(cfg.speculative_widths),
            proposer=cfg.proposer,
            fixed_speculative_width=cfg.fixed_speculative_width,
        )
    return report, sim
