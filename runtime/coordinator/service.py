"""Service prices: the entropy-dual update of each request's token and delivery rates.

docs/scheduling-utility.md derives this.  In short: each request carries a dual
rate ``x`` (tokens/ms) and, once it decodes, ``z`` (deliveries/ms), stored in
physical units.  Prices are the utility gradients f/x and g/z.  Over one
measured interval of ``dt_ms`` in which a participant received ``served`` units,
with normalizer ``ref`` (units/ms, from the measured catalog) and adaptation
time ``tau``::

    pi = ref / rate                          # normalized price
    pi <- (pi + dt/tau) * exp(-served / (tau * ref))

i.e. ``1/rate += dt / (tau * ref)`` then ``rate *= exp(served / (tau * ref))``.
Starvation raises the normalized price linearly (one unit per adaptation time);
service lowers it multiplicatively.  The fixed point under steady service at
rate r is rate ~= r, so the price tends to f / r.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from runtime.catalog import GraphKind
from runtime.coordinator.cost import CostCatalog
from runtime.coordinator.requests import Participant, Request

# Bounds that keep a rate positive and finite whatever the inputs.
_MAX_EXPONENT = 60.0
_MIN_RATE = 1e-12
_MAX_RATE = 1e12
# Fallback normalizer (per ms) when the applicable family has no measurement.
FALLBACK_NORMALIZER = 1.0


def update_rate(
    rate: float,
    ref: float,
    dt_ms: float,
    served: float,
    tau_ms: float,
    prompt: float = 0.0,
    prompt_ref: float | None = None,
) -> float:
    """One entropy-dual step of a physical rate; always positive and finite.

    ``served`` units are normalized by ``ref``; ``prompt`` tokens (from prefill
    programs) by ``prompt_ref``, the best prompt rate of the measured catalog.
    """
    inv = 1.0 / rate + dt_ms / (tau_ms * ref)
    exponent = served / (tau_ms * ref)
    if prompt:
        exponent += prompt / (tau_ms * (prompt_ref or ref))
    new = math.exp(min(_MAX_EXPONENT, exponent)) / inv
    return min(_MAX_RATE, max(_MIN_RATE, new))


def starting_rate(sigma_ms: float, population: int) -> float:
    """The rate a request with no history starts from (f/x is unbounded at x = 0).

    Its fair share: one unit per reference interval sigma, the interval at which
    each of the resident requests would be served if the fastest measured
    rotation served them all.  Without a measured family, one unit per ms shared
    by the population.
    """
    if sigma_ms > 0:
        return 1.0 / sigma_ms
    return FALLBACK_NORMALIZER / max(1, population)


@dataclass(frozen=True)
class Normalizers:
    """Reference per-stream rates of the applicable measured catalog, per ms.

    Both come from the generation family, the graphs that serve a request as a
    stream (ordinary decode; complete speculative programs join with the
    speculative rounds): ``tokens`` is the best committed tokens/ms one stream
    gets (W / T at the fastest; 1 / T for ordinary decode), ``deliveries`` the
    best deliveries/ms (1 / T).  ``prefill_tokens`` is the best prompt tokens/ms
    of a measured prefill graph (C / T): prompt service is normalized by it, so
    a prompt chunk moves a price about as much as the device time it took.
    ``None`` while the family has no measured graph.
    """

    tokens: float | None
    deliveries: float | None
    prefill_tokens: float | None = None


def catalog_normalizers(catalog: CostCatalog) -> Normalizers:
    """The best per-stream rates of the measured catalog.

    Mixed shapes take part (spec: "Mixed shapes also participate in service-rate
    references"): as generation graphs through their decode rows (W / T
    tokens, 1 / T deliveries) and as prompt graphs through their prompt
    capacity (C / T).
    """
    tokens = None
    deliveries = None
    prefill = None
    generation = catalog.entries(GraphKind.DECODE) + catalog.entries(GraphKind.MIXED)
    for entry in generation:
        if entry.known:
            t_ms = entry.estimate_ns / 1e6
            rate = entry.descriptor.token_capacity / t_ms
            tokens = rate if tokens is None or rate > tokens else tokens
            deliveries = 1.0 / t_ms if deliveries is None else max(deliveries, 1.0 / t_ms)
    for entry in catalog.entries(GraphKind.PREFILL) + catalog.entries(GraphKind.MIXED):
        if entry.known:
            rate = entry.descriptor.prompt_capacity / (entry.estimate_ns / 1e6)
            prefill = rate if prefill is None or rate > prefill else prefill
    return Normalizers(tokens, deliveries, prefill)


def account_interval(
    participants: Iterable[Participant],
    served_ids: set[int],
    fence: int,
    at_commit: Normalizers,
    now: Normalizers,
    credited_ns: int,
    tau_ms: float,
    x0: float,
) -> list[Request]:
    """One measured interval of service history for every participant.

    Service is the difference of committed counters against the counters last
    entered into the request's history.  Normalizers are those recorded at
    commit; a family still unmeasured then uses the catalog as the completion
    left it (``now``), and before any generation graph is measured the frame's
    own duration stands in (one unit per frame).  Prompt tokens are charged
    when the prompt completes (its first output), in the first interval from
    then on that has a prefill measurement.
    Returns the served requests whose delivery a publication may still correct.
    """
    dt_ms = credited_ns / 1e6
    tref = at_commit.tokens or now.tokens or 1.0 / dt_ms
    dref = at_commit.deliveries or now.deliveries or 1.0 / dt_ms
    pref = at_commit.prefill_tokens or now.prefill_tokens
    correctable: list[Request] = []
    for p in participants:
        r = p.request
        if r.cancelled:
            continue
        output = r.committed_output - r.accounted_output
        r.accounted_output = r.committed_output
        prompt = 0
        if pref is not None and r.consumed_prompt >= r.prefill_target:
            # A prompt is charged when it completes, with the first output it
            # enables (docs/scheduling-utility.md, "Prompt service"): a prompt
            # part-way through keeps its price and is not outbid by newer ones.
            prompt = r.consumed_prompt - r.accounted_prompt
            r.accounted_prompt = r.consumed_prompt
        rate = x0 if r.token_rate is None else r.token_rate
        r.token_rate = update_rate(rate, tref, dt_ms, output, tau_ms, prompt, pref)
        if p.decoding and r.delivery_rate is not None:
            # Completion records zero deliveries; publication may correct it.
            r.delivery_rate = update_rate(r.delivery_rate, dref, dt_ms, 0.0, tau_ms)
        if r.handle.id in served_ids and fence in r.unpublished:
            r.pending_delivery = (fence, dref if p.decoding else None)
            correctable.append(r)
    return correctable
