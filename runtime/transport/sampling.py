"""Per-lane sampling settings (:class:`SamplingParams`), shared by the frame and the API.

Validated on construction like every transport message; ``ProtocolError``
names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.transport.fields import (
    INT32_MAX,
    ProtocolError,
    check_fields,
    check_float,
    check_int,
    check_seq,
    check_unique,
    set_field,
)

MAX_LOGPROBS = 20  # top log probabilities a lane may ask for (SamplingParams.logprobs)
MAX_LOGIT_BIAS = 300  # token entries of SamplingParams.logit_bias (OpenAI's bound)
LOGIT_BIAS_LIMIT = 100.0  # |bias| bound, as OpenAI and vLLM take it
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| bound (OpenAI's range)


@dataclass(frozen=True)
class SamplingParams:
    """Per-lane sampling.  ``temperature`` 0 is greedy; ``top_k`` -1 is unlimited.

    ``min_tokens``: the model's EOS ids cannot be sampled until the request has
    produced this many tokens (vLLM's ``min_tokens``).  ``logprobs``: -1 for
    none, else 0..:data:`MAX_LOGPROBS`: rank 0 returns the sampled token's log
    probability and this many top tokens with theirs (``Completion.sidecars``),
    from ``log_softmax`` of the raw logits (before logit bias, penalties,
    temperature, top-k, top-p).

    Logit adjustments, with vLLM's semantics and in vLLM's order (bias, then
    repetition, then frequency and presence), applied before temperature (so
    a greedy request takes the argmax of the adjusted logits; the log
    probabilities stay those of the raw logits): ``logit_bias``
    ((token id, bias) pairs, bias in [-100, 100], at most
    :data:`MAX_LOGIT_BIAS`, ids distinct) is added; ``presence_penalty`` and
    ``frequency_penalty`` (in [-2, 2]) subtract ``presence * [count > 0] +
    frequency * count`` over the tokens the request has generated;
    ``repetition_penalty`` (> 0, 1 = off) divides positive and multiplies
    negative logits of every token seen in the prompt or the output.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    min_tokens: int = 0
    logprobs: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        temperature = check_float("temperature", self.temperature)
        if temperature < 0:
            raise ProtocolError("temperature", f"must be >= 0, got {temperature}")
        top_p = check_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ProtocolError("top_p", f"must lie in (0, 1], got {top_p}")
        top_k = check_int("top_k", self.top_k, -1, INT32_MAX)
        if top_k == 0:
            raise ProtocolError("top_k", "must be -1 (unlimited) or >= 1, got 0")
        check_int("seed", self.seed)
        check_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        check_int("logprobs", self.logprobs, -1, MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_float(name, getattr(self, name))
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ProtocolError(name, f"must lie in [-2, 2], got {value}")
            set_field(self, name, value)
        repetition = check_float("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise ProtocolError("repetition_penalty", f"must be > 0, got {repetition}")
        set_field(self, "repetition_penalty", repetition)
        set_field(self, "logit_bias", _logit_bias(self.logit_bias))
        set_field(self, "temperature", temperature)
        set_field(self, "top_p", top_p)

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit adjustment (bias or penalty) is on."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "min_tokens": self.min_tokens,
            "logprobs": self.logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": [[token, bias] for token, bias in self.logit_bias],
        }

    @classmethod
    def from_wire(cls, data: Any) -> SamplingParams:
        return cls(**check_fields(cls, data))


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """Validated (token id, bias) pairs, ids distinct, in the order given."""
    pairs = check_seq("logit_bias", value, MAX_LOGIT_BIAS)
    out: list[tuple[int, float]] = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ProtocolError(f"logit_bias[{i}]", "must be a (token id, bias) pair")
        token = check_int(f"logit_bias[{i}][0]", pair[0], 0, INT32_MAX)
        bias = check_float(f"logit_bias[{i}][1]", pair[1])
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ProtocolError(f"logit_bias[{i}][1]", f"must lie in [-100, 100], got {bias}")
        out.append((token, bias))
    check_unique("logit_bias", [token for token, _ in out])
    return tuple(out)
