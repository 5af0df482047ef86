"""Seeded synthetic workloads: arrivals, prompt and output lengths, message endpoints.

Two ways to build one:

* :func:`make_workload` over a :class:`WorkloadConfig` (the command line's
  knobs): uniform or log-normal lengths, all at t = 0 or Poisson arrivals.
* The suite builders, each seeded and deterministic with fixed request counts,
  each returning ``list[Arrival]`` sorted by arrival time:

  ================================  ==================================================
  :func:`burst`                     64 chat-shaped requests at t = 0
  :func:`chat`                      ShareGPT-like lengths, Poisson arrivals at a rate
  :func:`long_prompt_contention`    decoding streams while 2k-8k-token prompts arrive
  :func:`two_tenants`               tenant 0 floods, tenant 1 sends steadily and low
  :func:`chat_shared`               chat requests behind a few shared system prompts
  ================================  ==================================================

  Each takes its parameters as one frozen dataclass (:class:`BurstConfig`,
  :class:`ChatConfig`, :class:`LongPromptConfig`, :class:`TwoTenantsConfig`,
  :class:`ChatSharedConfig`) whose defaults are documented on the fields; the
  builders also accept the fields as keyword arguments.

Prefix caching: only :func:`chat_shared` names its prompts' token ids
(``RequestSpec.prompt_tokens``, the prefix cache's content key), so only its
requests share cached pages; every other workload's requests have none and
neither reuse nor publish a page.

Speculative acceptance: an :class:`Arrival` may name an acceptance profile
(:data:`ACCEPTANCE`: ``high``, ``low``, ``drifting``), the probability that the
simulated ranks accept each offered draft token; :func:`assign_acceptance`
labels a workload (``mixed``: one third each).  Unlabelled arrivals use
:data:`DEFAULT_ACCEPTANCE` in the simulator.

Chat-shaped lengths (:data:`CHAT_PROMPT`, :data:`CHAT_OUTPUT`) follow the shape
of public chat traces (ShareGPT): log-normal, prompt median 200 tokens with a
long tail, output median 200 with a lighter one.  See the constants.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields, replace

from runtime.coordinator.requests import RequestSpec
from runtime.image_spans import ImageSpan


@dataclass(frozen=True)
class Arrival:
    at_ns: int
    spec: RequestSpec
    tenant: int = 0
    acceptance: str | None = None  # a name of ACCEPTANCE; None: DEFAULT_ACCEPTANCE


# -- speculative acceptance -------------------------------------------------------


@dataclass(frozen=True)
class AcceptanceProfile:
    """Per-draft acceptance probability along a request's output.

    ``first`` at the first output token (position 0), changing linearly to
    ``last`` at the last (position ``output_len - 1``); a one-token output
    uses ``first``.
    """

    name: str
    first: float
    last: float

    def __post_init__(self) -> None:
        if not (0.0 <= self.first <= 1.0 and 0.0 <= self.last <= 1.0):
            raise ValueError(f"acceptance probabilities must lie in [0, 1], got {self}")

    def probability(self, position: int, output_len: int) -> float:
        if output_len <= 1 or self.first == self.last:
            return self.first
        frac = min(1.0, max(0.0, position / (output_len - 1)))
        return self.first + (self.last - self.first) * frac


ACCEPTANCE: dict[str, AcceptanceProfile] = {
    "high": AcceptanceProfile("high", 0.9, 0.9),
    "low": AcceptanceProfile("low", 0.1, 0.1),
    "drifting": AcceptanceProfile("drifting", 0.9, 0.1),
}
# What a workload can ask for: a profile for every request, or "mixed".
ACCEPTANCE_CHOICES = (*ACCEPTANCE, "mixed")
DEFAULT_ACCEPTANCE = "high"


def assign_acceptance(arrivals: list[Arrival], acceptance: str, seed: int = 0) -> list[Arrival]:
    """``arrivals`` labelled with an acceptance profile.

    A profile name labels every request.  ``mixed`` gives one third each of
    ``high``, ``low`` and ``drifting`` (exactly, up to the remainder of n / 3,
    which goes to the profiles in that order) in an order shuffled by its own
    generator seeded with ``seed``, so the workload's other draws are untouched.
    """
    if acceptance not in ACCEPTANCE_CHOICES:
        raise ValueError(
            f"acceptance must be one of {list(ACCEPTANCE_CHOICES)}, got {acceptance!r}"
        )
    if acceptance != "mixed":
        labels = [acceptance] * len(arrivals)
    else:
        names = list(ACCEPTANCE)
        labels = [names[i % len(names)] for i in range(len(arrivals))]
        random.Random(f"acceptance:{seed}").shuffle(labels)
    return [replace(a, acceptance=label) for a, label in zip(arrivals, labels, strict=True)]


# -- length distributions -------------------------------------------------------


@dataclass(frozen=True)
class Uniform:
    """Integers uniform on ``[lo, hi]`` inclusive (one ``rng.randint`` draw)."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"expected 1 <= lo <= hi, got {self.lo}, {self.hi}")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class LogNormal:
    """``round(median * exp(sigma * N(0, 1)))``, clipped to ``[lo, hi]``.

    ``median`` is the median before clipping (clipping keeps it when
    ``lo <= median <= hi``); ``sigma`` the standard deviation of the log.  One
    ``rng.normalvariate`` draw per sample.
    """

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"expected 1 <= lo <= hi, got {self.lo}, {self.hi}")
        if self.median <= 0 or self.sigma < 0:
            raise ValueError(f"expected median > 0 and sigma >= 0, got {self}")

    def sample(self, rng: random.Random) -> int:
        value = round(self.median * math.exp(self.sigma * rng.normalvariate(0.0, 1.0)))
        return min(self.hi, max(self.lo, value))


Lengths = tuple[int, int] | Uniform | LogNormal


def sample_length(dist: Lengths, rng: random.Random) -> int:
    """A ``(lo, hi)`` tuple is uniform, drawn exactly as ``rng.randint(lo, hi)``."""
    if isinstance(dist, tuple):
        return rng.randint(*dist)
    return dist.sample(rng)


# ShareGPT-like chat lengths.  Public ShareGPT conversations have a median
# prompt of roughly 150-250 tokens with a multi-turn tail into the thousands,
# and replies of a few hundred tokens with a lighter tail.
#
# Prompt: median 200, sigma 1.0: mean ~330, p90 ~720, p99 ~2050; about 0.1 %
# beyond 4096 is clipped there (the largest default prefill bucket), and the
# shortest prompts are held at 4 tokens (a chat template's minimum).
CHAT_PROMPT = LogNormal(median=200, sigma=1.0, lo=4, hi=4096)
# Output: median 200, sigma 0.8: mean ~275, p90 ~560; about 2 % beyond 1024
# are clipped there (a common max_tokens for chat), the shortest at 4 tokens.
CHAT_OUTPUT = LogNormal(median=200, sigma=0.8, lo=4, hi=1024)


# -- the command line's workload ------------------------------------------------------


@dataclass(frozen=True)
class WorkloadConfig:
    requests: int = 16
    arrival_rate_per_s: float = 0.0  # 0: everything arrives at t=0; else Poisson
    prompt_len: Lengths = (64, 64)  # (lo, hi): uniform inclusive range; or a distribution
    output_len: Lengths = (128, 128)
    messages: tuple[int, int] = (1, 1)  # message count per prompt (endpoints between)
    seed: int = 0
    tenant: int = 0
    acceptance: str | None = None  # see assign_acceptance; None: unlabelled


def make_workload(cfg: WorkloadConfig) -> list[Arrival]:
    rng = random.Random(cfg.seed)
    t_ns = 0.0
    out: list[Arrival] = []
    for _ in range(cfg.requests):
        if cfg.arrival_rate_per_s > 0:
            t_ns += rng.expovariate(cfg.arrival_rate_per_s) * 1e9
        prompt = sample_length(cfg.prompt_len, rng)
        output = sample_length(cfg.output_len, rng)
        n_msgs = min(prompt, rng.randint(*cfg.messages))
        endpoints = tuple(sorted(rng.sample(range(1, prompt), n_msgs - 1))) if n_msgs > 1 else ()
        spec = RequestSpec(prompt, output, message_endpoints=endpoints)
        out.append(Arrival(int(t_ns), spec, cfg.tenant))
    if cfg.acceptance is not None:
        out = assign_acceptance(out, cfg.acceptance, cfg.seed)
    return out


# -- the suite ------------------------------------------------------------------------


def _config(cls, cfg, overrides):
    if cfg is None:
        cfg = cls()
    elif not isinstance(cfg, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(cfg).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return replace(cfg, **overrides)


def _requests(
    rng: random.Random, n: int, prompt: Lengths, output: Lengths
) -> list[tuple[int, int]]:
    return [(sample_length(prompt, rng), sample_length(output, rng)) for _ in range(n)]


def _poisson(rng: random.Random, n: int, rate_per_s: float, start_ns: int = 0) -> list[int]:
    if rate_per_s <= 0:
        raise ValueError(f"rate must be positive, got {rate_per_s}")
    t = float(start_ns)
    out = []
    for _ in range(n):
        t += rng.expovariate(rate_per_s) * 1e9
        out.append(int(t))
    return out


@dataclass(frozen=True)
class BurstConfig:
    requests: int = 64  # all at t = 0
    prompt_len: Lengths = CHAT_PROMPT
    output_len: Lengths = CHAT_OUTPUT
    seed: int = 0


def burst(cfg: BurstConfig | None = None, **overrides) -> list[Arrival]:
    """``requests`` (64) chat-shaped requests, all arriving at t = 0."""
    cfg = _config(BurstConfig, cfg, overrides)
    rng = random.Random(cfg.seed)
    return [
        Arrival(0, RequestSpec(p, o))
        for p, o in _requests(rng, cfg.requests, cfg.prompt_len, cfg.output_len)
    ]


@dataclass(frozen=True)
class ChatConfig:
    rate_per_s: float = 10.0  # Poisson arrival rate
    requests: int = 128
    prompt_len: Lengths = CHAT_PROMPT
    output_len: Lengths = CHAT_OUTPUT
    seed: int = 0


def chat(
    rate_per_s: float | None = None,
    n: int | None = None,
    cfg: ChatConfig | None = None,
    **overrides,
) -> list[Arrival]:
    """``n`` ShareGPT-like requests (:data:`CHAT_PROMPT`, :data:`CHAT_OUTPUT`),
    Poisson arrivals at ``rate_per_s``; the first arrives one gap after t = 0."""
    if rate_per_s is not None:
        overrides["rate_per_s"] = rate_per_s
    if n is not None:
        overrides["requests"] = n
    cfg = _config(ChatConfig, cfg, overrides)
    rng = random.Random(cfg.seed)
    lengths = _requests(rng, cfg.requests, cfg.prompt_len, cfg.output_len)
    times = _poisson(rng, cfg.requests, cfg.rate_per_s)
    return [Arrival(t, RequestSpec(p, o)) for t, (p, o) in zip(times, lengths, strict=True)]


@dataclass(frozen=True)
class LongPromptConfig:
    streams: int = 12  # decoding streams present from t = 0 (the brief: 8 to 16)
    stream_prompt_len: Lengths = Uniform(32, 256)  # short prompts
    stream_output_len: Lengths = Uniform(1024, 1536)  # long outputs: decoding outlasts the prompts
    long_prompts: int = 6  # a handful of long prompts
    long_prompt_len: Lengths = Uniform(2048, 8192)
    long_output_len: Lengths = Uniform(64, 256)  # modest outputs
    start_ms: float = 100.0  # the long prompts arrive after the streams started decoding
    rate_per_s: float = 8.0  # Poisson, from start_ms
    seed: int = 0


def long_prompt_contention(cfg: LongPromptConfig | None = None, **overrides) -> list[Arrival]:
    """``streams`` short-prompt, long-output requests at t = 0; then ``long_prompts``
    prompts of 2k-8k tokens arrive by Poisson from ``start_ms`` on.

    At the defaults the streams are decoding by 100 ms (twelve prompts of at
    most 256 tokens take about 20 ms of prefill on the 1B profile) and keep
    decoding for more than a second (1024+ tokens at one batch step each),
    while the six long prompts arrive within about a second of ``start_ms``.
    """
    cfg = _config(LongPromptConfig, cfg, overrides)
    rng = random.Random(cfg.seed)
    streams = _requests(rng, cfg.streams, cfg.stream_prompt_len, cfg.stream_output_len)
    longs = _requests(rng, cfg.long_prompts, cfg.long_prompt_len, cfg.long_output_len)
    times = _poisson(rng, cfg.long_prompts, cfg.rate_per_s, int(cfg.start_ms * 1e6))
    out = [Arrival(0, RequestSpec(p, o)) for p, o in streams]
    out += [Arrival(t, RequestSpec(p, o)) for t, (p, o) in zip(times, longs, strict=True)]
    return out


@dataclass(frozen=True)
class TwoTenantsConfig:
    # What the system serves of chat-shaped requests; set it per profile.  Saturated
    # throughput at 64 slots, decode batches to 64, prefill buckets 64-4096 (a
    # 256-request burst, prefill-first FCFS / vLLM-style chunking): about 60-65
    # req/s on llama1b-h100, 15-16 req/s on llama8b-h100.
    capacity_req_per_s: float = 60.0
    flood_factor: float = 4.0  # tenant 0: Poisson at this multiple of capacity
    flood_requests: int = 128
    steady_factor: float = 0.25  # tenant 1: evenly spaced at this multiple of capacity
    steady_requests: int = 16
    prompt_len: Lengths = CHAT_PROMPT  # both tenants, so only the scheduler tells them apart
    output_len: Lengths = CHAT_OUTPUT
    seed: int = 0


def two_tenants(
    capacity_req_per_s: float | None = None,
    cfg: TwoTenantsConfig | None = None,
    **overrides,
) -> list[Arrival]:
    """Tenant 0 floods (``flood_requests`` by Poisson at ``flood_factor`` x
    capacity); tenant 1 sends ``steady_requests`` evenly spaced at
    ``steady_factor`` x capacity, the first at t = 0.

    At the defaults the flood arrives within about 32 / capacity seconds but
    needs about 128 / capacity to serve, and tenant 1 sends over 60 / capacity
    seconds: all of tenant 1's requests meet tenant 0's backlog.
    """
    if capacity_req_per_s is not None:
        overrides["capacity_req_per_s"] = capacity_req_per_s
    cfg = _config(TwoTenantsConfig, cfg, overrides)
    if cfg.capacity_req_per_s <= 0 or cfg.steady_factor <= 0:
        raise ValueError("capacity_req_per_s and steady_factor must be positive")
    rng = random.Random(cfg.seed)
    flood = _requests(rng, cfg.flood_requests, cfg.prompt_len, cfg.output_len)
    steady = _requests(rng, cfg.steady_requests, cfg.prompt_len, cfg.output_len)
    flood_times = _poisson(rng, cfg.flood_requests, cfg.flood_factor * cfg.capacity_req_per_s)
    period_ns = 1e9 / (cfg.steady_factor * cfg.capacity_req_per_s)
    out = [Arrival(t, RequestSpec(p, o), 0) for t, (p, o) in zip(flood_times, flood, strict=True)]
    out += [Arrival(int(i * period_ns), RequestSpec(p, o), 1) for i, (p, o) in enumerate(steady)]
    out.sort(key=lambda a: (a.at_ns, a.tenant))
    return out


@dataclass(frozen=True)
class ChatSharedConfig:
    # Poisson arrival rate: near but below saturation on llama1b-h100 (see
    # chat_shared); the benchmark uses it under every profile.
    rate_per_s: float = 70.0
    requests: int = 200
    system_prompts: int = 6  # distinct system prompts
    # System prompt lengths in whole pages of ``page_size``: 32-125 pages is
    # 512-2000 tokens.  Whole pages, so every prefix cache that reuses full pages
    # reuses all of a system prompt (see chat_shared).
    system_pages: Lengths = Uniform(32, 125)
    zipf_s: float = 1.0  # system prompt k (0-based) is picked with weight 1 / (k + 1) ** s
    user_len: Lengths = CHAT_PROMPT  # the user message after the system prompt
    output_len: Lengths = CHAT_OUTPUT
    page_size: int = 16  # the prefix caches' page (flare's SchedulerConfig.page_size)
    seed: int = 0


# Token ids of chat_shared: system prompt k holds SYSTEM_TOKEN_BASE + k * TOKEN_STRIDE
# + i at position i; request j's user message USER_TOKEN_BASE + j * TOKEN_STRIDE + i.
# The stride exceeds any system prompt or user message, so no two system prompts
# and no two user messages share an id, and no user id is a system id.
TOKEN_STRIDE = 1 << 16
SYSTEM_TOKEN_BASE = 1
USER_TOKEN_BASE = 1 << 24


def chat_shared(
    rate_per_s: float | None = None,
    n: int | None = None,
    cfg: ChatSharedConfig | None = None,
    **overrides,
) -> list[Arrival]:
    """``n`` chat requests, each a shared system prompt followed by its own user
    message, Poisson arrivals at ``rate_per_s``; the first arrives one gap after t = 0.

    ``system_prompts`` (6) system prompts of ``system_pages`` whole pages
    (512-2000 tokens); each request picks one by a Zipf-like draw (weight
    1 / (k + 1) ** ``zipf_s``: at the defaults 41 %, 20 %, 14 %, 10 %, 8 %, 7 %),
    then a user message of :data:`CHAT_PROMPT` length and an output of
    :data:`CHAT_OUTPUT` length.  ``prompt_tokens`` is the system prompt's ids
    (the same for every request that picks it, distinct between system prompts)
    followed by ids unique to the request (see :data:`TOKEN_STRIDE`), so the
    prefix a request can reuse is exactly its system prompt;
    ``message_endpoints`` is ``(system prompt length,)``.

    The rate, 70 requests/s: near but below saturation on the 1B roofline
    profile (``llama1b-h100``, mixed catalog, 64 slots).  With the system prompt
    reused a request's prompt work is its user message (mean about 300 tokens)
    and its output averages about 285 tokens; run long (800 requests), flare
    sustains about 80 requests/s and vllm about 76 (22.8k and 21.5k output
    tokens/s; beyond, TTFT grows with the run: at 95/s vllm's p99 is 0.55 s),
    so 70/s is about 0.9 of what either serves, and the 200 requests of the
    default keep TTFT p99 under 30 ms for both.  Without reuse each request
    would bring about 1,500 prompt tokens (system prompts average about 1,200):
    vllm without a prefix cache at 70/s has TTFT p99 about 0.5 s, past
    saturation, so a scheduler that failed to reuse the system prompt would show.

    Draws, from one generator seeded with ``seed``: the system prompts' lengths,
    then per request its system prompt, user length and output length, then the
    arrival gaps.
    """
    if rate_per_s is not None:
        overrides["rate_per_s"] = rate_per_s
    if n is not None:
        overrides["requests"] = n
    cfg = _config(ChatSharedConfig, cfg, overrides)
    if cfg.system_prompts < 1 or cfg.page_size < 1:
        raise ValueError("system_prompts and page_size must be positive")
    rng = random.Random(cfg.seed)
    systems = []
    for k in range(cfg.system_prompts):
        length = sample_length(cfg.system_pages, rng) * cfg.page_size
        if length >= TOKEN_STRIDE:
            raise ValueError(f"a system prompt of {length} tokens exceeds {TOKEN_STRIDE}")
        base = SYSTEM_TOKEN_BASE + k * TOKEN_STRIDE
        systems.append(tuple(range(base, base + length)))
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.system_prompts)]
    picks = []
    for _ in range(cfg.requests):
        (k,) = rng.choices(range(cfg.system_prompts), weights)
        picks.append((k, sample_length(cfg.user_len, rng), sample_length(cfg.output_len, rng)))
    times = _poisson(rng, cfg.requests, cfg.rate_per_s)
    out = []
    for j, (t, (k, user, output)) in enumerate(zip(times, picks, strict=True)):
        if user >= TOKEN_STRIDE:
            raise ValueError(f"a user message of {user} tokens exceeds {TOKEN_STRIDE}")
        base = USER_TOKEN_BASE + j * TOKEN_STRIDE
        tokens = systems[k] + tuple(range(base, base + user))
        spec = RequestSpec(
            len(tokens),
            output,
            message_endpoints=(len(systems[k]),),
            prompt_tokens=tokens,
        )
        out.append(Arrival(t, spec))
    return out


@dataclass(frozen=True)
class VisionChatConfig:
    """Chat with images: each prompt is text around ``images`` images of
    ``image_tokens`` positions each (one span per image, its digest random),
    Poisson arrivals at ``rate_per_s``."""

    requests: int = 16
    rate_per_s: float = 4.0
    images: tuple[int, int] = (1, 3)
    image_tokens: int = 576
    text_len: Lengths = (16, 256)  # before each image, and after the last
    output_len: Lengths = CHAT_OUTPUT
    seed: int = 0


def vision_chat(cfg: VisionChatConfig | None = None, **overrides) -> list[Arrival]:
    """Requests with images (docs/vision.md, "Scheduling"), for flare with a
    feature storage (``RunConfig.vision``); not in :data:`SUITE`."""
    cfg = _config(VisionChatConfig, cfg, overrides)
    rng = random.Random(cfg.seed)
    out: list[Arrival] = []
    for t in _poisson(rng, cfg.requests, cfg.rate_per_s):
        spans, pos = [], 0
        for _ in range(rng.randint(*cfg.images)):
            pos += sample_length(cfg.text_len, rng)
            spans.append(ImageSpan(pos, cfg.image_tokens, f"{rng.getrandbits(256):064x}"))
            pos += cfg.image_tokens
        prompt = pos + sample_length(cfg.text_len, rng)
        spec = RequestSpec(prompt, sample_length(cfg.output_len, rng), images=tuple(spans))
        out.append(Arrival(t, spec))
    return out


SUITE = {
    "burst": burst,
    "chat": chat,
    "long_prompt_contention": long_prompt_contention,
    "two_tenants": two_tenants,
    "chat_shared": chat_shared,
}
