"""Value arithmetic (spec, "Useful service and selection").

Units: value in prompt-token units, time in ms.  For a request with token rate
x and delivery rate z the utility-gradient prices are

    prefill token   1 + f/x
    output token    beta + f/x
    output delivery g/z

For a graph of duration T serving lanes S, with active decoders D:

    rate = (sum_S priced service + sum_{S decoders} c*sigma_i*(A_i + T)) / T
           - T/2 * sum_D c_i

Lane values are additive for a fixed graph; the age value splits into a part
independent of T (c*sigma*A) and a slope (c*sigma) multiplying T.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def prefill_lane_value(tokens: int, finishes: bool, token_price: float, beta: float) -> float:
    """Consumed prompt tokens, plus the one output token a finishing chunk commits."""
    value = tokens * (1.0 + token_price)
    if finishes:
        value += beta + token_price
    return value


def prompt_chunk_value(
    position: int,
    tokens: int,
    target: int,
    history_end: int,
    token_price: float,
    finish_value: float,
) -> float:
    """A prompt chunk [position, position + tokens) of a prefill to ``target``.

    Uncached prompt tokens are worth 1 + f/x each; a chunk that reaches
    ``target`` also commits the next output token, worth ``finish_value``
    (beta + f/x for a new request; a resumed decoder's lane value, age
    included).  Tokens below ``history_end`` are restored history (a preempted
    request recomputing what it had): no value of their own (spec, "Prompt
    progress counts consumed uncached prompt tokens"); the restore is a
    prerequisite of the output it enables, so a restoring chunk that does not
    finish carries the continuation index V*T/(T+F) (spec, "Prerequisites and
    completion") of that output, with the further time F extrapolated at the
    chunk's own rate: F = T * (rest / tokens), so V*T/(T+F) = V * tokens /
    (target - position).
    """
    end = position + tokens
    fresh = max(0, end - max(position, history_end))
    value = fresh * (1.0 + token_price)
    if end >= target:
        return value + finish_value
    restored = tokens - fresh
    if restored > 0:
        value += finish_value * restored / (target - position)
    return value


def decode_lane_value(
    expected_tokens: float,
    expected_deliveries: float,
    token_price: float,
    delivery_price: float,
    beta: float,
) -> float:
    return expected_tokens * (beta + token_price) + expected_deliveries * delivery_price


def reference_interval_ms(graphs: Iterable[tuple[float, int]], streams: int, total: int) -> float:
    """sigma = K * T / min(B, k) over the measured graph minimizing T / min(B, k).

    ``graphs``: (T ms, batch capacity) of the family's measured graphs; ``streams``
    is the family's stream count k, ``total`` the delivery-bearing streams K.
    Returns 0.0 when the family has no measured graph (no interval is invented).
    """
    if streams <= 0 or total <= 0:
        return 0.0
    best = math.inf
    for t_ms, batch in graphs:
        per_stream = t_ms / min(batch, streams)
        if per_stream < best:
            best = per_stream
    return 0.0 if best == math.inf else total * best


def value_rate(value: float, age_slope: float, t_ms: float, active_age_price: float) -> float:
    """The selection objective for a measured graph.

    ``value``: priced service plus the T-independent age value (sum c*sigma*A);
    ``age_slope``: sum over served decoders of c*sigma; ``active_age_price``: sum
    over active decoders of c.
    """
    return (value + age_slope * t_ms) / t_ms - 0.5 * t_ms * active_age_price


def log_scale_for(magnitude: float) -> float:
    """Log of the shared positive factor that brings the decision's values near one."""
    if magnitude <= 0.0 or not math.isfinite(magnitude):
        return 0.0
    return -math.log(magnitude)
