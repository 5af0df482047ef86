"""Prometheus metrics of the serving frontend, through ``prometheus_client``.

Two sources:

* the frontend measures what clients see: time to first token, inter-token
  latency, end-to-end latency, prompt and generation tokens, requests by
  finish reason (histograms and counters updated as responses stream);
* the coordinator's counters and gauges arrive in a :class:`Status` (queried
  when /metrics is scraped) and are exported by a collector: the spec's
  ``flare_scheduler_execution_nanoseconds_total`` and
  ``flare_scheduler_executions_total`` by ``class`` (ordinary, discovery,
  timing-refresh, acceptance-learning), ``flare_speculative_*`` for complete
  speculative programs, running and waiting requests, KV pages, and each
  prepared program's estimated duration; and per rank (:func:`rank_families`):
  device seconds by selection class, host seconds by stage, the last completed
  fence, RSS and device memory, and a histogram of each frame's skew (the
  largest minus the smallest rank interval).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from runtime.transport.api import Status

PREFIX = "flare"
SELECTION_CLASSES = ("ordinary", "discovery", "timing-refresh", "acceptance-learning")
SPECULATIVE_KIND = "speculative"
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class _StatusCollector(Collector):
    """Exports the latest coordinator :class:`Status` (set before each scrape)."""

    def __init__(self) -> None:
        self.status: Status | None = None

    def collect(self) -> Iterator:
        status = self.status
        if status is None:
            return
        v = status.values
        yield from scheduler_families(v)
        yield from engine_families(v)
        yield from prefix_cache_families(v)
        yield GaugeMetricFamily(
            f"{PREFIX}_engine_serving", "1 while the engine accepts requests.", value=status.serving
        )
        estimates = GaugeMetricFamily(
            f"{PREFIX}_graph_estimated_duration_seconds",
            "Each prepared program's duration estimate (0: not measured yet).",
            labels=["graph"],
        )
        for graph, ns in sorted(status.graph_estimates_ns.items()):
            estimates.add_metric([graph], ns / 1e9)
        yield estimates
        yield from rank_families(v)


def scheduler_families(v: dict[str, float]) -> Iterator:
    """The scheduler's executions by selection class, speculative programs, frames."""
    executions = CounterMetricFamily(
        f"{PREFIX}_scheduler_executions",
        "Executed programs by selection class.",
        labels=["class"],
    )
    execution_ns = CounterMetricFamily(
        f"{PREFIX}_scheduler_execution_nanoseconds",
        "Charged execution time by selection class.",
        labels=["class"],
    )
    for name in SELECTION_CLASSES:
        executions.add_metric([name], v.get(f"executions_total:{name}", 0.0))
        execution_ns.add_metric([name], v.get(f"execution_nanoseconds_total:{name}", 0.0))
    yield executions
    yield execution_ns
    yield CounterMetricFamily(
        f"{PREFIX}_speculative_executions",
        "Complete speculative programs executed.",
        value=v.get(f"frames_total:{SPECULATIVE_KIND}", 0.0),
    )
    yield CounterMetricFamily(
        f"{PREFIX}_speculative_device_nanoseconds",
        "Device time of complete speculative programs.",
        value=v.get(f"device_nanoseconds_total:{SPECULATIVE_KIND}", 0.0),
    )
    frames = CounterMetricFamily(
        f"{PREFIX}_frames", "Completed frames by program kind.", labels=["kind"]
    )
    for key, value in sorted(v.items()):
        if key.startswith("frames_total:"):
            frames.add_metric([key.split(":", 1)[1]], value)
    yield frames


def engine_families(v: dict[str, float]) -> Iterator:
    """The coordinator's request counts, auth refusals, trace lines, queue and KV gauges."""
    for outcome, doc in (
        ("submitted", "Requests the coordinator accepted."),
        ("finished", "Requests the coordinator finished (stop or length)."),
        ("cancelled", "Requests cancelled in the coordinator (client gone, frontend stop)."),
    ):
        yield CounterMetricFamily(
            f"{PREFIX}_engine_requests_{outcome}", doc, value=v.get(f"requests_{outcome}", 0.0)
        )
    yield CounterMetricFamily(
        f"{PREFIX}_transport_auth_denied",
        "Peers the coordinator's CURVE gate refused (no key, an unknown key, a wrong "
        "server key); each is logged with its reason.",
        value=v.get("transport_auth_denied_total", 0.0),
    )
    if "trace_lines" in v:  # the coordinator traces (--trace, --debug-endpoints)
        yield CounterMetricFamily(
            f"{PREFIX}_trace_lines", "Frames written to the live plan trace.",
            value=v["trace_lines"],
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{PREFIX}_trace_dropped",
            "Trace lines dropped because the trace writer fell behind.",
            value=v.get("trace_dropped", 0.0),
        )
    gauges = (
        ("num_requests_running", "Requests resident on the ranks.", "running"),
        ("num_requests_waiting", "Requests admitted but not yet resident.", "waiting"),
        ("frames_in_flight", "Frames dispatched and not yet completed.", "in_flight"),
        ("kv_pages_total", "KV cache pages.", "num_pages"),
    )
    # kv_pages_used: pages requests hold (cached pages nobody holds are free
    # to take: they count as free here and under kv_pages_cached_idle).
    for name, doc, key in gauges:
        yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=v.get(key, 0.0))
    total = v.get("num_pages", 0.0)
    used = total - v.get("free_pages", total)
    yield GaugeMetricFamily(f"{PREFIX}_kv_pages_used", "KV cache pages in use.", value=used)
    yield GaugeMetricFamily(
        f"{PREFIX}_kv_cache_usage_perc",
        "Fraction of KV cache pages in use (0..1).",
        value=used / total if total else 0.0,
    )


def prefix_cache_families(v: dict[str, float]) -> Iterator:
    """KV pages held by the prefix cache, its lookups and hits (in tokens, like
    vLLM's prefix_cache_queries/hits), the hit rate, evictions and preemptions."""
    yield GaugeMetricFamily(
        f"{PREFIX}_kv_pages_cached",
        "KV pages published in the prefix cache (held by requests or idle).",
        value=v.get("kv_pages_cached", 0.0),
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_kv_pages_cached_idle",
        "Prefix-cache pages no request holds (evictable).",
        value=v.get("kv_pages_cached_idle", 0.0),
    )
    queried = v.get("prefix_cache_queried_tokens", 0.0)
    hits = v.get("prefix_cache_hit_tokens", 0.0)
    yield CounterMetricFamily(
        f"{PREFIX}_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queried
    )
    yield CounterMetricFamily(
        f"{PREFIX}_prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_prefix_cache_hit_rate",
        "Prefix-cache hits over lookups, in tokens, since start (0 before any lookup).",
        value=hits / queried if queried else 0.0,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_prefix_cache_evicted_pages",
        "Prefix-cache pages evicted to make room.",
        v.get("prefix_cache_evicted_pages", 0.0),
    )
    yield CounterMetricFamily(
        f"{PREFIX}_num_preemptions",
        "Requests preempted (their pages released; they resume later).",
        v.get("preemptions", 0.0),
    )


RANK_GAUGES = (
    ("rank_last_fence", "The last fence each rank completed (-1: none yet)."),
    ("rank_rss_bytes", "Each rank process's resident set size."),
    ("rank_device_allocated_bytes", "Device memory each rank's tensors hold."),
    ("rank_device_reserved_bytes", "Device memory each rank's allocator reserved."),
)


def rank_families(v: dict[str, float]) -> Iterator:
    """The per-rank families from the coordinator's flat ``name:label:...`` values
    (see ``runtime.coordinator.engine.ranks.RankMetrics.values``)."""
    device = CounterMetricFamily(
        f"{PREFIX}_rank_device_seconds",
        "Each rank's device (replay) seconds by selection class.",
        labels=["rank", "class"],
    )
    host = CounterMetricFamily(
        f"{PREFIX}_rank_host_seconds",
        "Each rank's host seconds by stage (receive, validate, pack, launch, wait, publish).",
        labels=["rank", "stage"],
    )
    gauges = {
        name: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["rank"])
        for name, doc in RANK_GAUGES
    }
    buckets = []
    for key, value in v.items():
        name, _, labels = key.partition(":")
        if name == "rank_device_seconds_total":
            device.add_metric(labels.split(":", 1), value)
        elif name == "rank_host_seconds_total":
            host.add_metric(labels.split(":", 1), value)
        elif name in gauges:
            gauges[name].add_metric([labels], value)
        elif name == "rank_skew_seconds_bucket":
            buckets.append((float(labels), value))
    yield device
    yield host
    yield from gauges.values()
    if buckets:
        buckets.sort()
        yield HistogramMetricFamily(
            f"{PREFIX}_rank_skew_seconds",
            "Per frame, the largest minus the smallest rank interval.",
            buckets=[("+Inf" if math.isinf(le) else f"{le:g}", count) for le, count in buckets],
            sum_value=v.get("rank_skew_seconds_sum", 0.0),
        )


class ServingMetrics:
    """The frontend's registry: request metrics plus the coordinator's status."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from request arrival to its first output token.",
            buckets=LATENCY_BUCKETS,
            **labels,
        ).labels(model_name)
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            buckets=LATENCY_BUCKETS,
            **labels,
        ).labels(model_name)
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Time from request arrival to its last output token.",
            buckets=LATENCY_BUCKETS,
            **labels,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests.", **labels
        ).labels(model_name)
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Output tokens generated.", **labels
        ).labels(model_name)
        self._finished = Counter(
            f"{PREFIX}_request_success",
            "Finished requests by finish reason.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model = model_name
        self._status = _StatusCollector()
        self.registry.register(self._status)

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model, reason).inc()

    def render(self, status: Status | None) -> bytes:
        """The text exposition, with ``status`` as the coordinator's figures."""
        self._status.status = status
        return generate_latest(self.registry)
