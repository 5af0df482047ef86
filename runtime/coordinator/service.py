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
from dataclasses import dataclass

from runtime.catalog import GraphKind
from runtime.coordinator.cost import CostCatalog

# exp() argument bound: keeps a huge served/normalizer ratio from overflowing.
_MAX_EXPONENT = 60.0
# Fallback normalizer (per ms) when the applicable family has no measurement.
FALLBACK_NORMALIZER = 1.0


def update_rate(rate: float, ref: float, dt_ms: float, served: float, tau_ms: float) -> float:
    """One entropy-dual step of a physical rate; always positive and finite."""
    inv = 1.0 / rate + dt_ms / (tau_ms * ref)
    return math.exp(min(_MAX_EXPONENT, served / (tau_ms * ref))) / inv


def starting_rate(ref: float, population: int) -> float:
    """A request with no history starts at its fair share of the reference rate."""
    return ref / max(1, population)


@dataclass(frozen=True)
class Normalizers:
    """Reference per-request rates of the measured catalog, per ms.

    * ``prefill_tokens``: the best prompt tokens/ms of any measured prefill graph.
    * ``decode_tokens``: the best tokens/ms one stream gets from a measured decode
      graph (W / T at the fastest).
    * ``deliveries``: the best deliveries/ms of one stream (1 / T at the fastest).
    ``None`` where the family has no measured graph.
    """

    prefill_tokens: float | None
    decode_tokens: float | None
    deliveries: float | None

    def token_ref(self, decoding: bool) -> float | None:
        return self.decode_tokens if decoding else self.prefill_tokens


def catalog_normalizers(catalog: CostCatalog) -> Normalizers:
    prefill = None
    for entry in catalog.entries(GraphKind.PREFILL):
        if entry.known:
            rate = entry.descriptor.prompt_capacity / (entry.estimate_ns / 1e6)
            prefill = rate if prefill is None or rate > prefill else prefill
    decode = None
    deliveries = None
    for kind in (GraphKind.DECODE, GraphKind.SPECULATIVE):
        for entry in catalog.entries(kind):
            if entry.known:
                t_ms = entry.estimate_ns / 1e6
                d = 1.0 / t_ms
                deliveries = d if deliveries is None or d > deliveries else deliveries
                if kind is GraphKind.DECODE:
                    decode = d if decode is None or d > decode else decode
    return Normalizers(prefill, decode, deliveries)
