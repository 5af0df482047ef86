"""Speculative decoding settings of a deployment (docs/speculation.md).

One frozen value carries what the ranks prepare (proposer, draft model, round
widths, the target-row envelope) and what the scheduler selects with (fixed or
adaptive selection, the proposal source whose acceptance requests track):

* ``proposer``: ``draft`` (learned proposals from ``draft_model``, a smaller
  decoder sharing the target's vocabulary) or ``copy`` (n-gram lookup in the
  request's own tokens, ``prompt_lookup_min`` through ``prompt_lookup_max``).
* ``num_speculative_tokens`` N: the deepest round verifies N proposals (width
  W = N + 1).  ``selection`` ``fixed``: every decode round has width N + 1
  (vLLM's behaviour); ``adaptive``: the ranks prepare widths 2, 4, ... below
  N + 1 and N + 1 itself, plus prefix-limit programs, and the scheduler picks
  a width per round by expected useful value per time.
* ``token_capacity`` R (``--speculative-token-capacity``): programs whose
  target rows exceed R are not prepared (0: no envelope).
* ``acceptance_prior`` (``--speculative-acceptance-prior``): prefix-survival
  means s_1, s_2, ... that start the population prior of this proposer
  instead of the spec's 0.5^d (an offline measurement of the draft against
  the target; deeper depths keep 0.5^d).

:meth:`from_vllm` reads vLLM's ``--speculative-config`` JSON.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

PROPOSERS = ("draft", "copy")
SELECTIONS = ("adaptive", "fixed")
MAX_SPECULATIVE_TOKENS = 15  # W <= 16: the verification attention kernel's bound
VLLM_METHODS = {"ngram": "copy", "draft_model": "draft"}
VLLM_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
}


class SpeculationError(ValueError):
    """A speculative-decoding setting is invalid; the message names it."""


@dataclass(frozen=True)
class SpeculationConfig:
    proposer: str = "draft"
    draft_model: str | None = None
    num_speculative_tokens: int = 3
    selection: str = "adaptive"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    token_capacity: int = 0
    acceptance_prior: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise SpeculationError(f"proposer must be draft or copy, got {self.proposer!r}")
        if self.selection not in SELECTIONS:
            raise SpeculationError(f"selection must be adaptive or fixed, got {self.selection!r}")
        if self.proposer == "draft" and not self.draft_model:
            raise SpeculationError("learned proposals (proposer draft) need a draft model")
        if self.proposer == "copy" and self.draft_model:
            raise SpeculationError("copy proposals take no draft model")
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise SpeculationError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {n!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise SpeculationError(f"{name} must be an integer in [1, 64], got {value!r}")
        if lo > hi:
            raise SpeculationError(f"prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        r = self.token_capacity
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise SpeculationError(f"speculative token capacity must be >= 0, got {r!r}")
        prior = self.acceptance_prior
        if not isinstance(prior, tuple) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0
            for v in prior
        ):
            raise SpeculationError(f"acceptance prior must hold probabilities, got {prior!r}")
        if any(b > a for a, b in itertools.pairwise(prior)):
            raise SpeculationError(f"acceptance prior must not increase with depth, got {prior}")
        if len(prior) > n:
            raise SpeculationError(
                f"acceptance prior has {len(prior)} depths, num_speculative_tokens is {n}"
            )

    @property
    def widest(self) -> int:
        return self.num_speculative_tokens + 1

    @property
    def widths(self) -> tuple[int, ...]:
        """The round widths the ranks prepare (width one is ordinary decode):
        fixed, the widest; adaptive, every width through 4, then powers of two,
        and the widest."""
        if self.selection == "fixed":
            return (self.widest,)
        out = {self.widest, *range(2, min(4, self.widest) + 1)}
        w = 8
        while w < self.widest:
            out.add(w)
            w *= 2
        return tuple(sorted(out))

    @property
    def fixed_width(self) -> int:
        """The scheduler's ``fixed_speculative_width``: 0 for adaptive selection."""
        return self.widest if self.selection == "fixed" else 0

    def rank_args(self) -> list[str]:
        """The ``python -m runtime.ranks`` flags that prepare these programs."""
        args = [
            "--proposer", self.proposer,
            "--speculative-widths", ",".join(map(str, self.widths)),
            "--prompt-lookup-min", str(self.prompt_lookup_min),
            "--prompt-lookup-max", str(self.prompt_lookup_max),
        ]  # fmt: skip
        if self.draft_model:
            args += ["--draft-model", self.draft_model]
        if self.selection == "adaptive":
            args.append("--device-allocation")
        if self.token_capacity:
            args += ["--speculative-token-capacity", str(self.token_capacity)]
        return args

    @classmethod
    def from_vllm(cls, text: str, **overrides) -> SpeculationConfig:
        """vLLM's ``--speculative-config`` JSON: ``method`` ngram or draft_model,
        ``model``, ``num_speculative_tokens``, ``prompt_lookup_min`` and
        ``prompt_lookup_max``.  vLLM verifies a fixed number of tokens, so the
        selection is ``fixed`` unless ``overrides`` say otherwise."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpeculationError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise SpeculationError("--speculative-config must be a JSON object")
        unknown = set(data) - VLLM_KEYS
        if unknown:
            raise SpeculationError(
                f"--speculative-config: unsupported key(s) {sorted(unknown)}; flare reads "
                f"{sorted(VLLM_KEYS)}"
            )
        method = data.get("method", "draft_model" if "model" in data else None)
        if method not in VLLM_METHODS:
            raise SpeculationError(
                f"--speculative-config: method must be one of {sorted(VLLM_METHODS)}, "
                f"got {method!r}"
            )
        if "num_speculative_tokens" not in data:
            raise SpeculationError("--speculative-config: num_speculative_tokens is required")
        fields = {
            "proposer": VLLM_METHODS[method],
            "draft_model": data.get("model") if method == "draft_model" else None,
            "num_speculative_tokens": data["num_speculative_tokens"],
            "selection": "fixed",
        }
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if key in data:
                fields[key] = data[key]
        fields.update(overrides)
        try:
            return cls(**fields)
        except SpeculationError as exc:
            raise SpeculationError(f"--speculative-config: {exc}") from None
