"""Summaries of a simulation: TTFT, output gaps, throughput, goodput, fairness.

* Goodput: finished requests meeting both TTFT <= ``ttft_slo_ms`` and TPOT <=
  ``tpot_slo_ms``, where TPOT = (e2e - TTFT) / (output tokens - 1) (0 for a
  one-token output), per second of the span (first arrival to last finish);
  ``goodput_fraction`` is their share of all admitted requests (unfinished
  ones count as misses).  ``goodput_tight_*``: the same at the tight pair
  (:data:`TIGHT_TTFT_SLO_MS`, :data:`TIGHT_TPOT_SLO_MS`).
* Fairness: Jain's index over per-request slowdown, slowdown = e2e latency /
  the request's latency alone under the same costs (``solo_ns``, by default
  :meth:`Simulation.solo_ns`).  Unfinished requests count with their residence
  so far, a lower bound of their slowdown.  Slowdown, unlike tokens per
  residence time, does not mix request size into fairness.
* With several tenants: each tenant's mean slowdown, Jain's index over those
  means, and each tenant's TTFT p99.
* Prefix caching (only when some request names its prompt token ids, so no
  other workload's summary changes): ``prompt_tokens`` (all requests' prompt
  lengths), ``prompt_tokens_cached`` (what the schedulers attached from their
  prefix caches, ``GeneratedToken.cached_tokens``), ``prompt_tokens_computed``
  (prompt tokens the frames consumed, recomputation included) and
  ``cache_hit_rate`` = cached / prompt tokens.
* Speculation (:func:`speculation_summary`; when a speculative round ran, or
  when asked): request-rounds, the share of offered drafts accepted, mean
  tokens per request-round, decode frames per width, and per acceptance profile.
"""

from __future__ import annotations

from collections.abc import Callable

from scripts.scheduling_sim.engine import RequestStats, Simulation

# Interactive chat on a small model: the first token within half a second, then
# at least 20 tokens per second (well above reading speed).
DEFAULT_TTFT_SLO_MS = 500.0
DEFAULT_TPOT_SLO_MS = 50.0
# A tight pair beside it (issue 26): the first token within 200 ms, then 50
# tokens per second: ``goodput_tight_*``.
TIGHT_TTFT_SLO_MS = 200.0
TIGHT_TPOT_SLO_MS = 20.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return float(ordered[int(min(rank, len(ordered))) - 1])


def jain(values: list[float]) -> float:
    """Jain's index (sum x)^2 / (n sum x^2): 1 when all equal, 1/n when one has all."""
    if not values:
        return 1.0
    total = sum(values)
    squares = sum(v * v for v in values)
    return (total * total) / (len(values) * squares) if squares > 0 else 1.0


def meets_slo(s: RequestStats, ttft_slo_ms: float, tpot_slo_ms: float) -> bool:
    """Finished, TTFT <= ``ttft_slo_ms`` and TPOT <= ``tpot_slo_ms``."""
    ttft, tpot = s.ttft_ns, s.tpot_ns
    if s.finished_ns is None or ttft is None or tpot is None:
        return False
    return ttft <= ttft_slo_ms * 1e6 and tpot <= tpot_slo_ms * 1e6


def slowdown(s: RequestStats, solo_ns: int, now_ns: int) -> float:
    """e2e latency / solo latency; an unfinished request's residence so far."""
    end = s.finished_ns if s.finished_ns is not None else now_ns
    return (end - s.arrival_ns) / max(1, solo_ns)


def _ttfts_ms(stats: list[RequestStats]) -> list[float]:
    return [s.ttft_ns / 1e6 for s in stats if s.ttft_ns is not None]


def _acceptance_figures(stats: list[RequestStats]) -> dict:
    rounds = sum(s.spec_rounds for s in stats)
    offered = sum(s.drafts_offered for s in stats)
    accepted = sum(s.drafts_accepted for s in stats)
    tokens = sum(s.spec_tokens for s in stats)
    return {
        "requests": len(stats),
        "rounds": rounds,
        "drafts_offered": offered,
        "drafts_accepted": accepted,
        "acceptance_rate": round(accepted / offered, 4) if offered else None,
        "tokens_per_round": round(tokens / rounds, 3) if rounds else None,
    }


def speculation_summary(sim: Simulation) -> dict:
    """Speculative figures of ``sim``: ``speculative_rounds`` (request-rounds),
    ``draft_acceptance`` (accepted / offered drafts), ``tokens_per_round`` (mean
    tokens a request commits per speculative round), ``rounds_by_width``
    (decode-only frames per width, 1 = ordinary decode) and
    ``acceptance_by_profile`` (the same counts per acceptance profile)."""
    stats = list(sim.requests.values())
    overall = _acceptance_figures(stats)
    profiles = sorted({s.acceptance for s in stats})
    return {
        "speculative_rounds": overall["rounds"],
        "draft_acceptance": overall["acceptance_rate"],
        "tokens_per_round": overall["tokens_per_round"],
        "rounds_by_width": {
            str(w): n for w, n in sorted(getattr(sim, "rounds_by_width", {}).items())
        },
        "acceptance_by_profile": {
            p: _acceptance_figures([s for s in stats if s.acceptance == p]) for p in profiles
        },
    }


def summarize(
    sim: Simulation,
    *,
    ttft_slo_ms: float = DEFAULT_TTFT_SLO_MS,
    tpot_slo_ms: float = DEFAULT_TPOT_SLO_MS,
    solo_ns: Callable[[RequestStats], int] | None = None,
    speculation: bool | None = None,
) -> dict:
    """``speculation``: include :func:`speculation_summary` (None: when any
    speculative round ran)."""
    stats = list(sim.requests.values())
    ttfts = _ttfts_ms(stats)
    gaps = [g / 1e6 for s in stats for g in s.gaps_ns()]
    output = sum(s.output_tokens for s in stats)
    prompt = sum(s.prompt_len for s in stats)
    end_ns = max((s.finished_ns or sim.now_ns for s in stats), default=sim.now_ns)
    start_ns = min((s.arrival_ns for s in stats), default=0)
    span_s = max(1e-9, (end_ns - start_ns) / 1e9)
    good = sum(1 for s in stats if meets_slo(s, ttft_slo_ms, tpot_slo_ms))
    tight = sum(1 for s in stats if meets_slo(s, TIGHT_TTFT_SLO_MS, TIGHT_TPOT_SLO_MS))
    report = {
        "requests": len(stats),
        "finished": sum(1 for s in stats if s.finished_ns is not None),
        "frames": sim.frames,
        "sim_seconds": round(span_s, 6),
        "ttft_ms_p50": round(percentile(ttfts, 50), 3),
        "ttft_ms_p99": round(percentile(ttfts, 99), 3),
        "ttft_ms_max": round(max(ttfts, default=0.0), 3),
        "gap_ms_p50": round(percentile(gaps, 50), 3),
        "gap_ms_p99": round(percentile(gaps, 99), 3),
        "gap_ms_max": round(max(gaps, default=0.0), 3),
        "output_tokens_per_s": round(output / span_s, 1),
        "total_tokens_per_s": round((output + prompt) / span_s, 1),
        "device_utilization": round(sim.busy_ns / max(1, end_ns - start_ns), 4),
        "goodput_req_per_s": round(good / span_s, 3),
        "goodput_fraction": round(good / len(stats), 4) if stats else 0.0,
        "goodput_ttft_slo_ms": ttft_slo_ms,
        "goodput_tpot_slo_ms": tpot_slo_ms,
        "goodput_tight_req_per_s": round(tight / span_s, 3),
        "goodput_tight_fraction": round(tight / len(stats), 4) if stats else 0.0,
    }
    if solo_ns is None and getattr(sim, "catalog", None) is not None:
        solo_ns = sim.solo_ns
    if solo_ns is None:
        # No catalog to price requests alone: fairness is unknown.
        report.update(fairness_jain=None, slowdown_p50=None, slowdown_p99=None)
    else:
        slowdowns = {id(s): slowdown(s, solo_ns(s), sim.now_ns) for s in stats}
        values = list(slowdowns.values())
        report.update(
            fairness_jain=round(jain(values), 4),
            slowdown_p50=round(percentile(values, 50), 3),
            slowdown_p99=round(percentile(values, 99), 3),
        )
    tenants = sorted({s.tenant for s in stats})
    if len(tenants) > 1:
        by_tenant = {t: [s for s in stats if s.tenant == t] for t in tenants}
        report["tenant_ttft_ms_p99"] = {
            str(t): round(percentile(_ttfts_ms(group), 99), 3) for t, group in by_tenant.items()
        }
        if solo_ns is not None:
            means = {
                t: sum(slowdowns[id(s)] for s in group) / len(group)
                for t, group in by_tenant.items()
            }
            report["tenant_slowdown_mean"] = {str(t): round(m, 3) for t, m in means.items()}
            report["fairness_jain_tenants"] = round(jain(list(means.values())), 4)
        else:
            report["tenant_slowdown_mean"] = None
            report["fairness_jain_tenants"] = None
    if any(getattr(s, "cacheable", False) for s in stats):
        cached = sum(s.cached_tokens for s in stats)
        report.update(
            prompt_tokens=prompt,
            prompt_tokens_cached=cached,
            prompt_tokens_computed=getattr(sim, "prompt_tokens_computed", None),
            cache_hit_rate=round(cached / prompt, 4) if prompt else 0.0,
        )
    if speculation is None:
        speculation = any(getattr(s, "spec_rounds", 0) for s in stats)
    if speculation:
        report.update(speculation_summary(sim))
    report["frames_by_graph"] = dict(sorted(sim.frames_by_graph.items()))
    return report
